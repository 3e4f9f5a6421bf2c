"""Create → Ready at low load with the processor's hand-over and without it (``python -m
services.bench handoff [--quick]``).

Two control planes as ``sandstream up`` runs them in one process (processor, executor, watcher;
the fake driver, whose launch returns at once), each on topics and a schema of its own, one
with ``up_handoff`` and one without. Creates are published one at a time through the API's
producer, alternating between the two, each timed from its publish to its row Ready (read when
the change feed wakes). What differs is the hop from the processor's commit to the executor:
the events topic, or the hand-over in the process. Beside them, Kafka's own round trip in the
same run (the API's producer to a consumer with the processor's fetch settings).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from drivers.fake import FakeDriver
from events.commands import CreateSandbox
from events.publisher import CommandPublisher
from services.api.readmodel.changes import ChangeFeed
from services.bench.decided import figures, kafka_round_trips
from services.bench.workload import SPEC
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack.isolation import isolated
from services.up.control_plane import ControlPlane


@dataclass
class Plane:
    """One control plane, its producer of commands and its change feed."""

    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    publisher: CommandPublisher
    feed: ChangeFeed

    async def create_until_ready(self, key: str) -> None:
        mark = self.feed.mark()
        command = CreateSandbox(
            type="CreateSandbox", command_id=f"c-{key}", key=key, spec=SPEC,
            occurred_at=datetime.now(UTC), actor="bench",
        )  # fmt: skip
        await self.publisher.publish(command)
        read = "SELECT phase FROM sandboxes WHERE key = $1"
        while await self.pool.fetchval(read, key) != "Ready":
            await self.feed.wait(mark, 5.0)
            mark = self.feed.mark()


@contextlib.asynccontextmanager
async def plane(settings: Settings, handoff: bool) -> AsyncIterator[Plane]:
    async with isolated(settings, "bench", up_handoff=handoff) as (s, pool):
        control = ControlPlane(s, FakeDriver(), pool, reconcile_interval=3600)
        await control.start()
        feed = ChangeFeed(pool)
        await feed.start()
        publisher = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
        await publisher.__aenter__()
        try:
            yield Plane(s, pool, publisher, feed)
        finally:
            await publisher.__aexit__()
            await feed.close()
            await control.stop()


async def handoff_figures(settings: Settings, n: int) -> None:
    """``n`` creates on each plane, alternating, after ten on each as a warm-up."""
    async with plane(settings, False) as log_only, plane(settings, True) as handed:
        samples: dict[bool, list[float]] = {False: [], True: []}
        for i in range(10 + n):
            for on, which in ((False, log_only), (True, handed)):
                began = time.perf_counter()
                await which.create_until_ready(f"b-{i}")
                if i >= 10:
                    samples[on].append((time.perf_counter() - began) * 1000)
        kafka = await kafka_round_trips(log_only.settings, n)
    log_p50, handed_p50 = statistics.median(samples[False]), statistics.median(samples[True])
    saved = log_p50 - handed_p50
    print(
        f"handoff     {n} creates on each control plane, alternating, publish -> row Ready "
        "(fake driver)\n"
        f"            events topic   {figures(samples[False])}\n"
        f"            handed over    {figures(samples[True])}\n"
        f"            Kafka alone    {figures(kafka)}   (produce acks=all -> consume)\n"
        f"            p50 saved {saved:.1f} ms of {log_p50:.1f} ({saved / log_p50:.0%})"
    )
