"""One observer for every drain: the processor's and the same-work ceiling's are timed by the
same reads of PostgreSQL, from the same point to the same point.

The clock starts at the first committed batch (a group join or a first fetch is not
throughput) and stops when every input is committed and every outbox record is acknowledged
by Kafka with the publish cursor moved past it: the whole of the work, whichever part of it a
drain overlaps. The CPU per input is counted over the same window.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from services.bench import cpu
from services.common.settings import Settings

EVERY = 0.02  # s between the observer's reads (the same for every drain it times)

# The outbox records above their partition's publish cursor (the cursors only move past
# acknowledged records); an index probe per partition, not a scan of the outbox.
_UNPUBLISHED = """
SELECT count(*) FROM generate_series(0, $1::int - 1) AS p
LEFT JOIN outbox_cursor c ON c.partition = p
WHERE EXISTS (SELECT 1 FROM outbox o WHERE o.partition = p
              AND o.id > coalesce(c.published_id, 0))
"""


@dataclass(frozen=True, slots=True)
class Drained:
    first: int  # inputs in the first committed batch (not timed)
    elapsed: float  # s from the first committed batch until all committed and published
    used: cpu.PerInput | None  # CPU per timed input (None: nothing timed)
    total: int

    @property
    def rate(self) -> float:
        return self.timed / self.elapsed if self.elapsed > 0 else float("nan")

    @property
    def timed(self) -> int:
        return self.total - self.first


async def applied(conn: asyncpg.Connection[asyncpg.Record] | asyncpg.Pool[asyncpg.Record]) -> int:
    """Inputs recorded so far (the offsets sum to it, and are cheaper to read than history)."""
    return int(await conn.fetchval("SELECT coalesce(sum(next_offset), 0) FROM input_offsets"))


async def timed_drain(
    settings: Settings,
    total: int,
    backends: Callable[[], list[int]] = list,
    broker: int | None = None,
) -> Drained:
    """Wait until ``total`` inputs of ``settings``' schema are committed and published, timing
    it (above) and counting the CPU this process, the ``backends`` and the ``broker`` spend."""
    session = {"search_path": settings.pg_schema}
    conn = await asyncpg.connect(settings.pg_dsn, server_settings=session)
    try:
        while not (first := await applied(conn)):
            await asyncio.sleep(EVERY)
        started, cpu_started = time.perf_counter(), cpu.mark(backends(), broker)
        while await applied(conn) < total or await conn.fetchval(
            _UNPUBLISHED, settings.kafka_partitions
        ):
            await asyncio.sleep(EVERY)
        elapsed = time.perf_counter() - started
        used = cpu.spent(cpu_started, cpu.mark(backends(), broker), total - first)
    finally:
        await conn.close()
    return Drained(first, elapsed, used, total)
