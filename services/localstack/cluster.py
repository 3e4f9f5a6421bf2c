"""Start, stop and inspect a local KRaft cluster of ``settings.kafka_brokers`` nodes.

``python -m services.localstack up --brokers 3`` uses it instead of the single broker; the
checker (services/chaos) starts one of its own and kills, restarts, pauses and resumes single
nodes of it. Layout and properties: services/localstack/cluster_config.py. Each node's files
(properties, data, log, pid file) live under its own state dir; all share one cluster id.
With SASL (the default) each node is secured as the single broker is (kafka_auth: its config
and JAAS file, the admin in its storage); all nodes share the one credentials file, and
``secure`` creates the roles' users and ACLs once the cluster answers.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from services.common.settings import Settings
from services.localstack import cluster_config as cc
from services.localstack import config as cfg
from services.localstack import kafka_auth, kafka_broker, podman_service, postgres, stack
from services.localstack.processes import (
    ComponentStatus,
    StackError,
    live_pid,
    say,
    spawn,
    stop_pid,
    wait_for,
    write_if_changed,
)


def up(settings: Settings) -> Settings:
    """``stack.up`` with a cluster of ``settings.kafka_brokers`` nodes for the broker."""
    started = time.monotonic()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    nodes = start(settings)  # the JVMs boot while PostgreSQL and Podman come up
    settings = postgres.up(settings)
    podman_service.up(settings)
    wait(settings, nodes)
    kafka_broker.ensure_topics(settings)
    secure(settings)
    say(f"up in {time.monotonic() - started:.1f}s")
    return settings


def down(settings: Settings) -> None:
    """``stack.down``, and the cluster's nodes."""
    if stop(settings):
        say("kafka: cluster nodes stopped")
    stack.down(settings)


def status(settings: Settings) -> list[ComponentStatus]:
    """``stack.status`` with the cluster's state for Kafka's."""
    down = [n.node_id for n in cc.nodes(settings) if not kafka_broker.answers(n.settings)]
    if down:
        kafka = ComponentStatus("kafka", False, f"nodes {down} not answering")
    else:
        where = cc.bootstrap_list(settings)
        kafka = ComponentStatus("kafka", True, f"{settings.kafka_brokers} nodes at {where}")
    components = [kafka, postgres.status(settings), podman_service.status(settings)]
    stack.show(components)
    return components


def start(
    settings: Settings, extra: Mapping[str, str] | None = None
) -> dict[int, subprocess.Popen[bytes]]:
    """Start every node that does not run; return the new processes by node id. ``extra``:
    broker properties set on every node (``cluster_config.node_properties``)."""
    kafka_broker.resolve_libs(settings)
    started = {}
    for node in cc.nodes(settings):
        proc = start_node(settings, node, extra)
        if proc is not None:
            started[node.node_id] = proc
    return started


def start_node(
    settings: Settings, node: cc.Node, extra: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes] | None:
    """Start ``node`` unless it runs (None then); its storage is formatted on first start."""
    paths = cfg.kafka_paths(node.settings)
    pid = live_pid(paths.pid, str(paths.properties))
    if pid is not None:
        problem = kafka_auth.storage_problem(node.settings)  # started before authentication
        if problem:
            raise StackError(problem)
        say(f"kafka: node {node.node_id} running (pid {pid})")
        return None
    paths.home.mkdir(parents=True, exist_ok=True)
    template = cfg.KAFKA_PROPERTIES_TEMPLATE.read_text()
    rendered = cc.node_properties(template, settings, node, extra)
    properties, jvm_options = kafka_auth.prepare_broker(node.settings, rendered)  # JAAS per node
    write_if_changed(paths.properties, properties)
    shared_id = cc.cluster_home(settings) / "cluster.id"
    if not shared_id.exists():
        shared_id.write_text(cfg.new_kafka_cluster_id() + "\n")
    write_if_changed(paths.cluster_id, shared_id.read_text())
    kafka_broker.format_storage(node.settings)  # with the admin's SCRAM credential
    java = cfg.kafka_java_command(node.settings, "kafka.Kafka", str(paths.properties))
    proc = spawn(
        kafka_auth.with_jvm_options(java, jvm_options),
        log=paths.log,
        pidfile=paths.pid,
    )
    say(f"kafka: node {node.node_id} starting (pid {proc.pid}) on {node.address}")
    return proc


def wait(settings: Settings, procs: dict[int, subprocess.Popen[bytes]]) -> None:
    """Block until every node answers a metadata request."""
    started = time.monotonic()
    for node in cc.nodes(settings):
        wait_for(
            partial(kafka_broker.answers, node.settings),
            what=f"kafka node {node.node_id}",
            timeout=kafka_broker.START_TIMEOUT,
            log=cfg.kafka_paths(node.settings).log,
            proc=procs.get(node.node_id),
        )
    if procs:
        say(f"kafka: {len(procs)} node(s) ready after {time.monotonic() - started:.1f}s")


def secure(settings: Settings) -> None:
    """The roles' SCRAM users and their ACLs on the settings' names, created once the cluster
    answers (the metadata log replicates them to every node), as for the single broker."""
    kafka_broker.ensure_auth(settings)


def node_pid(node: cc.Node) -> int | None:
    paths = cfg.kafka_paths(node.settings)
    return live_pid(paths.pid, str(paths.properties))


def stop(settings: Settings) -> int:
    """Stop every running node (also those of a larger cluster started earlier from these
    settings' state dir); the number stopped."""
    home = cc.cluster_home(settings)
    found = len(list(home.glob("node-*"))) if home.exists() else 0
    settings = settings.model_copy(update={"kafka_brokers": max(settings.kafka_brokers, found)})
    # All at once: a node stopped last, alone, would wait for a quorum to shut down cleanly.
    with ThreadPoolExecutor(max(1, settings.kafka_brokers)) as pool:
        stopped = pool.map(_stop_node, cc.nodes(settings))
    return sum(stopped)


def _stop_node(node: cc.Node) -> bool:
    paths = cfg.kafka_paths(node.settings)
    return stop_pid(paths.pid, str(paths.properties), f"kafka node {node.node_id}")


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_FLOOR = 20000


def free_port_run(length: int) -> int:
    """A port P such that P .. P+length-1 are free now (a private cluster's port pairs).

    Below the kernel's ephemeral range: a port in it can be taken by any outgoing connection
    (a client of another test) between this check and the server's bind, seconds later."""
    rng = random.Random()
    low, high = ephemeral_ports()
    while True:
        if low - length > PORT_FLOOR:
            base = rng.randrange(PORT_FLOOR, low - length)
        else:
            base = rng.randrange(high + 1, 65536 - length)
        if all(_free(base + i) for i in range(length)):
            return base


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if unknown)."""
    try:
        low, high = EPHEMERAL_RANGE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
