"""The faults the checker injects, one at a time, each healed before the next:

- ``kill processor`` / ``kill executor`` / ``kill watcher``: SIGKILL one instance (an
  executor maybe in the middle of a Podman call; the watcher holding its lease), start it
  again a moment later;
- ``kill broker``: SIGKILL one Kafka node, start it again, wait until every replica is back
  in sync;
- ``pause broker``: SIGSTOP one Kafka node for a few seconds (to its clients, a network
  partition: connections stay open and nothing answers), then SIGCONT;
- ``restart postgres``: the private PostgreSQL stopped (fast: sessions ended; immediate: as a
  crash, with recovery at start) and started again;
- ``rebalance``: a third processor joins the group, takes partitions, and leaves.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

from aiokafka.admin import AIOKafkaAdminClient

from events.backoff import pause
from services.chaos.launch import RoleProcess
from services.chaos.postgres import PrivatePostgres
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack import cluster
from services.localstack import cluster_config as cc

KINDS = (
    "kill processor",
    "kill executor",
    "kill watcher",
    "kill broker",
    "pause broker",
    "restart postgres",
    "rebalance",
)
HEAL_TIMEOUT = 120.0


class FaultError(RuntimeError):
    """A fault could not be healed: the run cannot go on meaningfully."""


@dataclass
class Faults:
    rng: random.Random
    cluster_settings: Settings  # the Kafka nodes' layout
    client_settings: Settings  # what clients use (topics, bootstrap list)
    processors: list[RoleProcess]
    executors: list[RoleProcess]
    watcher: RoleProcess  # single-active: the only instance, so a kill leaves none a while
    joiner: RoleProcess  # the processor that joins and leaves for a rebalance
    postgres: PrivatePostgres
    counts: Counter[str] = field(default_factory=Counter)
    every_kind: asyncio.Event = field(default_factory=asyncio.Event)  # each injected once

    async def run(self, stop: asyncio.Event, interval: tuple[float, float]) -> None:
        """A fault every ``interval`` seconds (uniformly drawn) until ``stop``: every kind once
        in each round of ``len(KINDS)``, in a random order, so short runs see them all."""
        order: list[str] = []
        while not await pause(stop, self.rng.uniform(*interval)):
            if not order:
                order = self.rng.sample(KINDS, len(KINDS))
            kind = order.pop()
            await self.inject(kind)
            self.counts[kind] += 1
            if all(self.counts[k] for k in KINDS):
                self.every_kind.set()

    async def inject(self, kind: str) -> None:
        match kind:
            case "kill processor":
                await self._kill_role(self.rng.choice(self.processors))
            case "kill executor":
                await self._kill_role(self.rng.choice(self.executors))
            case "kill watcher":
                await self._kill_role(self.watcher)
            case "kill broker":
                await self._kill_broker(self.rng.choice(cc.nodes(self.cluster_settings)))
            case "pause broker":
                await self._pause_broker(self.rng.choice(cc.nodes(self.cluster_settings)))
            case "restart postgres":
                mode = self.rng.choice(("fast", "immediate"))
                await asyncio.to_thread(self.postgres.restart, mode)
            case "rebalance":
                await self._rebalance()
            case _:
                raise ValueError(f"unknown fault {kind!r}")

    async def _kill_role(self, role: RoleProcess) -> None:
        role.kill()
        await asyncio.sleep(self.rng.uniform(0.2, 3.0))
        role.start()

    async def _kill_broker(self, node: cc.Node) -> None:
        pid = cluster.node_pid(node)
        if pid is None:
            raise FaultError(f"kafka node {node.node_id} is not running")
        os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(_wait_gone, node)
        await asyncio.sleep(self.rng.uniform(1.0, 6.0))
        await asyncio.to_thread(self._restart_node, node)
        await self.wait_in_sync()

    def _restart_node(self, node: cc.Node) -> None:
        proc = cluster.start_node(self.cluster_settings, node)
        cluster.wait(self.cluster_settings, {node.node_id: proc} if proc else {})

    async def _pause_broker(self, node: cc.Node) -> None:
        pid = cluster.node_pid(node)
        if pid is None:
            raise FaultError(f"kafka node {node.node_id} is not running")
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.rng.uniform(2.0, 8.0))
        finally:
            os.kill(pid, signal.SIGCONT)
        await self.wait_in_sync()

    async def _rebalance(self) -> None:
        self.joiner.start()
        deadline = time.monotonic() + HEAL_TIMEOUT
        while not _assigned(self.joiner):
            if time.monotonic() > deadline or not self.joiner.running():
                self.joiner.stop()
                raise FaultError(f"{self.joiner.name} was never assigned partitions")
            await asyncio.sleep(0.2)
        await asyncio.sleep(self.rng.uniform(0.5, 4.0))
        await asyncio.to_thread(self.joiner.stop)

    async def wait_in_sync(self) -> None:
        """Until every partition of the run's topics has all its replicas in sync."""
        deadline = time.monotonic() + HEAL_TIMEOUT
        while not await _in_sync(self.client_settings):
            if time.monotonic() > deadline:
                raise FaultError("replicas not back in sync")
            await asyncio.sleep(0.5)


def _wait_gone(node: cc.Node) -> None:
    while cluster.node_pid(node) is not None:
        time.sleep(0.05)


def _assigned(role: RoleProcess) -> bool:
    """The joiner's log of this start says it was assigned at least one partition."""
    try:
        latest = role.log.read_text(errors="replace").rsplit("\n--- ", 1)[-1]
    except OSError:
        return False
    return any("assigned partitions [" in line and "[]" not in line for line in latest.splitlines())


async def _in_sync(settings: Settings) -> bool:
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"), request_timeout_ms=5000)
    try:
        await admin.start()
        described = await admin.describe_topics(list(settings.topics))
    except Exception:
        return False
    finally:
        await admin.close()
    return all(
        t["error_code"] == 0 and all(len(p["isr"]) == len(p["replicas"]) for p in t["partitions"])
        for t in described
    )
