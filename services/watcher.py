"""Driver watchers and the reconcile loop: what the runtime really did, as observations.

Both only report; the processor decides. The reconcile loop compares the driver's listing with
the phase rows and reports a runtime that vanished behind sandstream's back (RuntimeRemoved)
and an orphan runtime carrying our marker but no live row (a snapshot the processor records
as ignored), never fixing anything itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import asyncpg
from aiokafka import AIOKafkaProducer

from drivers.protocol import Driver, RuntimeInfo
from events.codec import encode
from events.common import Phase
from events.observations import Observation, RuntimeRemoved, RuntimeSnapshot
from services.executor import Clock, utcnow
from services.settings import Settings

log = logging.getLogger("sandstream.watcher")

# Phases in which the current generation's runtime must exist; its absence is news.
EXPECTS_RUNTIME = (Phase.READY, Phase.STOPPING)


@dataclass(frozen=True, slots=True)
class LiveRow:
    key: str
    sandbox_id: UUID
    generation: int
    phase: Phase


def reconcile(
    rows: Iterable[LiveRow], runtimes: Iterable[RuntimeInfo], now: datetime
) -> list[Observation]:
    """Observations for the differences between the rows and the runtime listing (pure).

    Read the rows before listing the runtimes: a runtime launched after the rows were read is
    then at worst reported as an orphan of a newer generation, which the processor ignores.
    """
    by_key = {r.key: r for r in rows}
    present = {(rt.key, rt.generation) for rt in runtimes}
    out: list[Observation] = []
    for rt in runtimes:
        row = by_key.get(rt.key)
        if row is None or row.sandbox_id != rt.sandbox_id:
            out.append(
                RuntimeSnapshot(
                    type="RuntimeSnapshot",
                    observation_id=f"reconcile:orphan:{rt.runtime_id}:{rt.state}",
                    key=rt.key,
                    generation=rt.generation,
                    occurred_at=now,
                    actor="reconciler",
                    state=rt.state,
                    exit_code=rt.exit_code,
                    runtime_id=rt.runtime_id,
                    source="reconcile",
                )
            )
    for row in by_key.values():
        if row.phase in EXPECTS_RUNTIME and (row.key, row.generation) not in present:
            out.append(
                RuntimeRemoved(
                    type="RuntimeRemoved",
                    observation_id=f"reconcile:vanished:{row.sandbox_id}:{row.generation}",
                    key=row.key,
                    generation=row.generation,
                    occurred_at=now,
                    actor="reconciler",
                    source="reconcile",
                )
            )
    return out


async def live_rows(pool: asyncpg.Pool[asyncpg.Record]) -> list[LiveRow]:
    rows = await pool.fetch(
        "SELECT key, sandbox_id, generation, phase FROM sandboxes WHERE phase <> 'Deleted'"
    )
    return [LiveRow(r["key"], r["sandbox_id"], r["generation"], Phase(r["phase"])) for r in rows]


async def publish(producer: AIOKafkaProducer, topic: str, observation: Observation) -> None:
    await producer.send_and_wait(topic, value=encode(observation), key=observation.key.encode())


async def run_watcher(
    driver: Driver, producer: AIOKafkaProducer, settings: Settings, stop: asyncio.Event
) -> None:
    """Forward the driver's watch stream to the observations topic until ``stop``."""
    stream = driver.watch()
    try:
        while not stop.is_set():
            observation = await stream.__anext__()
            await publish(producer, settings.topic_observations, observation)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def run_reconciler(
    driver: Driver,
    pool: asyncpg.Pool[asyncpg.Record],
    producer: AIOKafkaProducer,
    settings: Settings,
    stop: asyncio.Event,
    interval: float,
    clock: Clock = utcnow,
) -> None:
    """Every ``interval`` seconds report differences, each one once per process."""
    reported: set[str] = set()
    while not stop.is_set():
        try:
            rows = await live_rows(pool)
            runtimes = await driver.list()
            for observation in reconcile(rows, runtimes, clock()):
                if observation.observation_id not in reported:
                    reported.add(observation.observation_id)
                    await publish(producer, settings.topic_observations, observation)
        except Exception:
            log.exception("reconcile pass failed; next pass in %ss", interval)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
