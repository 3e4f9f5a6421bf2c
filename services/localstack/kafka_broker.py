"""The local stack's single Kafka broker (KRaft): its jars, storage, start and readiness, the
project topics (also of any other cluster), the roles' users and ACLs, and its status line."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
import time

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from services.common.kafka_clients import TLS_PROTOCOLS, kafka_client_args
from services.common.settings import Settings
from services.localstack import config as cfg
from services.localstack import kafka_auth
from services.localstack.processes import (
    ComponentStatus,
    StackError,
    live_pid,
    port_open,
    run,
    say,
    spawn,
    stop_pid,
    tail,
    wait_for,
    write_if_changed,
)

START_TIMEOUT = 90.0
TOPICS_READY_TIMEOUT = 30.0
TOPIC_ALREADY_EXISTS = 36  # Kafka error code
DYNAMIC_TOPIC_CONFIG = 1  # a config entry's source: set on the topic itself


def _tls_problem(settings: Settings) -> str | None:
    """Why a broker of the local stack's cannot serve these settings' TLS clients, if so: its
    client listener takes no TLS, so they would fail their handshakes until the start timeout."""
    if settings.kafka_security_protocol not in TLS_PROTOCOLS:
        return None
    return (
        f"kafka: the local stack's broker takes no TLS, but SANDSTREAM_KAFKA_SECURITY_PROTOCOL is "
        f"{settings.kafka_security_protocol}: use SASL_PLAINTEXT (or PLAINTEXT) locally, or point "
        "SANDSTREAM_KAFKA_BOOTSTRAP at a TLS cluster of your own (docs/security.md)"
    )


def start(settings: Settings) -> subprocess.Popen[bytes] | None:
    """Start the broker if it should run here and does not; return the new process."""
    host, port = cfg.split_host_port(settings.kafka_bootstrap)
    paths = cfg.kafka_paths(settings)
    if not cfg.is_local_host(host):
        say(f"kafka: using external cluster {settings.kafka_bootstrap}")
        return None
    pid = live_pid(paths.pid, str(paths.properties))
    if pid is not None:
        problem = kafka_auth.storage_problem(settings) or _tls_problem(settings)
        if problem:
            raise StackError(problem)
        say(f"kafka: running (pid {pid})")
        return None
    if port_open(host, port):
        say(f"kafka: {settings.kafka_bootstrap} is served by a process we did not start; using it")
        return None
    problem = _tls_problem(settings)
    if problem:
        raise StackError(problem)
    resolve_libs(settings)
    template = cfg.KAFKA_PROPERTIES_TEMPLATE.read_text()
    rendered = cfg.render_server_properties(template, settings)
    properties, jvm_options = kafka_auth.prepare_broker(settings, rendered)
    write_if_changed(paths.properties, properties)
    format_storage(settings)
    proc = spawn(
        kafka_auth.with_jvm_options(
            cfg.kafka_java_command(settings, "kafka.Kafka", str(paths.properties)), jvm_options
        ),
        log=paths.log,
        pidfile=paths.pid,
    )
    say(f"kafka: broker starting (pid {proc.pid}), log {paths.log}")
    return proc


def stop(settings: Settings) -> None:
    """Stop the broker ``start`` started (by its pid file), if it runs."""
    paths = cfg.kafka_paths(settings)
    stopped = stop_pid(paths.pid, str(paths.properties), "kafka broker")
    say("kafka: stopped" if stopped else "kafka: not running")


def wait(settings: Settings, proc: subprocess.Popen[bytes] | None) -> None:
    """Block until the broker answers a metadata request; StackError if ``proc`` exits or the
    start timeout passes first."""
    started = time.monotonic()
    wait_for(
        lambda: answers(settings),
        what="kafka broker",
        timeout=START_TIMEOUT,
        log=cfg.kafka_paths(settings).log,
        proc=proc,
    )
    if proc is not None:
        say(f"kafka: broker ready after {time.monotonic() - started:.1f}s more")


def resolve_libs(settings: Settings) -> None:
    """Copy kafka_2.13 and its runtime dependencies from Maven into the cache, once."""
    libs = cfg.kafka_paths(settings).libs
    stamp = libs / ".resolved"
    wanted = f"{settings.kafka_version} {hashlib.sha256(cfg.KAFKA_POM.read_bytes()).hexdigest()}"
    if stamp.exists() and stamp.read_text().strip() == wanted:
        return
    say(f"kafka: resolving kafka_2.13:{settings.kafka_version} with Maven into {libs}")
    partial = libs.with_name("libs.partial")
    shutil.rmtree(partial, ignore_errors=True)
    run(cfg.maven_command(settings, partial), what="maven dependency:copy-dependencies")
    (partial / ".resolved").write_text(wanted + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)


def format_storage(settings: Settings) -> None:
    """Format the KRaft storage directory once, with a cluster id kept in the state dir."""
    paths = cfg.kafka_paths(settings)
    if (paths.data / "meta.properties").exists():
        problem = kafka_auth.storage_problem(settings)
        if problem:
            raise StackError(problem)
        return
    if not paths.cluster_id.exists():
        paths.cluster_id.write_text(cfg.new_kafka_cluster_id() + "\n")
    cluster_id = paths.cluster_id.read_text().strip()
    cmd = cfg.kafka_java_command(
        settings,
        "kafka.tools.StorageTool",
        "format",
        "--cluster-id",
        cluster_id,
        "--config",
        str(paths.properties),
        "--ignore-formatted",
    )
    with (
        kafka_auth.format_command(settings, cmd, "kafka.tools.StorageTool") as cmd,
        paths.format_log.open("wb") as out,
    ):
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        raise StackError(f"kafka: formatting storage failed\n{tail(paths.format_log)}")
    kafka_auth.storage_formatted(settings)


def answers(settings: Settings) -> bool:
    """True when the broker accepts connections and answers a metadata request."""
    if not port_open(*cfg.split_host_port(settings.kafka_bootstrap)):
        return False
    try:
        asyncio.run(_list_topics(settings))
    except Exception:
        return False
    return True


async def _list_topics(settings: Settings) -> list[str]:
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"), request_timeout_ms=5000)
    await admin.start()
    try:
        topics: list[str] = await admin.list_topics()
        return topics
    finally:
        await admin.close()


def ensure_topics(settings: Settings) -> None:
    """Create the missing project topics and wait for their leaders; StackError if not. Topics
    made before they recorded the broker's append time are switched to it."""
    created = asyncio.run(_create_topics(settings))
    if created:
        say(f"kafka: created topics {', '.join(created)}")
    switched = asyncio.run(_log_append_time(settings))
    if switched:
        say(f"kafka: {', '.join(switched)} now record the broker's append time")
    say(f"kafka: topics ready ({settings.kafka_partitions} partitions each)")


async def _create_topics(settings: Settings) -> list[str]:
    """Create the missing project topics; fail on a partition count other than configured."""
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in settings.topics if t not in existing]
        if missing:
            response = await admin.create_topics(
                [
                    NewTopic(
                        t,
                        settings.kafka_partitions,
                        cfg.replication_factor(settings),
                        topic_configs=cfg.topic_configs(settings),
                    )
                    for t in missing
                ]
            )
            for topic, code, message in response.topic_errors:
                if code not in (0, TOPIC_ALREADY_EXISTS):
                    raise StackError(f"kafka: creating topic {topic} failed ({code}): {message}")
        await _wait_topics_ready(admin, settings)
        return missing
    finally:
        await admin.close()


async def _log_append_time(settings: Settings) -> list[str]:
    """Set message.timestamp.type=LogAppendTime on the project topics that lack it (the
    processor counts a command's time from it: cfg.topic_configs). AlterConfigs replaces a
    topic's whole set, so the topic's own other settings are sent along unchanged."""
    wanted = "message.timestamp.type"
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
    await admin.start()
    try:
        topics = [ConfigResource(ConfigResourceType.TOPIC, t) for t in settings.topics]
        own: dict[str, dict[str, str]] = {}
        for response in await admin.describe_configs(topics):
            for _, _, _, name, entries in response.resources:
                own[name] = {e[0]: e[1] for e in entries if e[3] == DYNAMIC_TOPIC_CONFIG}
        stale = [t for t in settings.topics if own.get(t, {}).get(wanted) != "LogAppendTime"]
        if stale:
            changes = [
                ConfigResource(ConfigResourceType.TOPIC, t, {**own[t], wanted: "LogAppendTime"})
                for t in stale
            ]
            for response in await admin.alter_configs(changes):
                for code, message, _, topic in response.resources:
                    if code:
                        raise StackError(
                            f"kafka: setting message.timestamp.type=LogAppendTime on {topic} "
                            f"failed ({code}): {message}; set it with kafka-configs.sh (see "
                            "docs/operations.md, Retention) or grant the admin role AlterConfigs"
                        )
        return stale
    finally:
        await admin.close()


async def _wait_topics_ready(admin: AIOKafkaAdminClient, settings: Settings) -> None:
    """Wait until every partition of the project topics has a leader."""
    deadline = time.monotonic() + TOPICS_READY_TIMEOUT
    while True:
        pending = []
        for topic in await admin.describe_topics(list(settings.topics)):
            partitions = topic["partitions"]
            if topic["error_code"] == 0 and len(partitions) != settings.kafka_partitions:
                raise StackError(
                    f"kafka: topic {topic['topic']} has {len(partitions)} partitions but "
                    f"settings.kafka_partitions is {settings.kafka_partitions}; delete the topic "
                    f"(or {settings.state_dir / 'kafka'}) or change SANDSTREAM_KAFKA_PARTITIONS"
                )
            if topic["error_code"] != 0 or any(p["leader"] < 0 for p in partitions):
                pending.append(topic["topic"])
        if not pending:
            return
        if time.monotonic() > deadline:
            raise StackError(f"kafka: topics without leaders after timeout: {pending}")
        await asyncio.sleep(0.2)


def ensure_auth(settings: Settings) -> None:
    """The roles' SCRAM users and ACLs on a local broker (a real cluster's are its operator's:
    docs/security.md)."""
    if not kafka_auth.enabled(settings):
        say("kafka: no authentication (kafka_security_protocol PLAINTEXT)")
        return
    addresses = settings.kafka_bootstrap.split(",")  # a local cluster's clients get every node
    if not all(cfg.is_local_host(cfg.split_host_port(a.strip())[0]) for a in addresses):
        say("kafka: users and ACLs of an external cluster are left to its operator")
        return
    try:
        users = kafka_auth.ensure_users(settings)
        acls = kafka_auth.grant(settings)
    except RuntimeError as exc:
        raise StackError(str(exc)) from exc
    say(f"kafka: {len(users)} role users and {acls} ACLs in place")


def status(settings: Settings) -> ComponentStatus:
    paths = cfg.kafka_paths(settings)
    pid = live_pid(paths.pid, str(paths.properties))
    if not answers(settings):
        detail = f"broker pid {pid} not answering" if pid else "not running"
        return ComponentStatus("kafka", False, detail)
    topics = set(asyncio.run(_list_topics(settings)))
    missing = [t for t in settings.topics if t not in topics]
    owner = f"pid {pid}" if pid else "not started by us"
    detail = f"{settings.kafka_bootstrap} ({owner})"
    if missing:
        return ComponentStatus("kafka", False, f"{detail}; missing topics {', '.join(missing)}")
    return ComponentStatus("kafka", True, f"{detail}; {len(settings.topics)} topics")
