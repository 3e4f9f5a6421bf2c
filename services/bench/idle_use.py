"""What idle suspend costs at many busy sandboxes (``python -m services.bench idle-use``).

A schema of its own with ``sandboxes`` Ready rows, each with an idle timeout, all of them in
use. Per flush interval the doors of one API process write one upsert of every sandbox used
(``UseRecorder.flush``) and the scheduler runs one idle scan (``usage.idle_rows``, then
``usage.forget_deleted``), which finds nothing due and nothing deleted: busy sandboxes put
nothing on the log. Each is timed (the median of ``rounds``), with the WAL it writes, and
divided by the default flush interval for the steady cost per second.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from services.common.settings import Settings
from services.common.usage import UseRecorder, forget_deleted, idle_rows
from services.localstack.isolation import isolated

_ROW = """
INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers, identity,
                       created_at, updated_at, partition, change_seq)
SELECT k, gen_random_uuid(), 'Ready', 1, 2, $2::jsonb, '{}', 'rid-' || k, $3, $3, 0,
       nextval('sandbox_changes')
FROM unnest($1::text[]) AS k
"""
_WAL = "SELECT pg_current_wal_lsn()"
_WAL_BYTES = "SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)"


async def _timed(pool: asyncpg.Pool[asyncpg.Record], work: object) -> tuple[float, float]:
    """(ms, WAL bytes) of one awaited ``work()``."""
    before = await pool.fetchval(_WAL)
    began = time.perf_counter()
    await work()  # type: ignore[operator]
    ms = (time.perf_counter() - began) * 1000
    wal = float(await pool.fetchval(_WAL_BYTES, await pool.fetchval(_WAL), before))
    return ms, wal


async def idle_use_figures(settings: Settings, sandboxes: int, rounds: int) -> None:
    flush = Settings().use_flush_seconds
    async with isolated(settings, "bench") as (_, pool):
        names = [f"busy-{i:06d}-{uuid.uuid4().hex[:6]}" for i in range(sandboxes)]
        spec = json.dumps({"image": "img", "idle_suspend_seconds": 900})
        await pool.execute(_ROW, names, spec, datetime.now(UTC))
        await pool.execute("ANALYZE sandboxes")
        use = UseRecorder(pool, flush)
        flushes, scans = [], []
        for _ in range(rounds):
            for name in names:  # every sandbox used in the interval
                use.touch(name)
            flushes.append(await _timed(pool, use.flush))
            now = datetime.now(UTC) + timedelta(seconds=60)

            async def scan(at: datetime = now) -> None:
                assert await idle_rows(pool, at, flush) == []  # all busy: nothing due
                assert await forget_deleted(pool, 1000) == 0  # none deleted: nothing to forget

            scans.append(await _timed(pool, scan))
        await pool.execute("ANALYZE sandbox_use")
    _report(sandboxes, flush, flushes, scans)


def _report(
    sandboxes: int,
    flush: float,
    flushes: list[tuple[float, float]],
    scans: list[tuple[float, float]],
) -> None:
    def median(values: list[tuple[float, float]], i: int) -> float:
        return statistics.median(v[i] for v in values)

    write_ms, write_wal = median(flushes, 0), median(flushes, 1)
    scan_ms = median(scans, 0)
    print(f"idle suspend at {sandboxes} busy sandboxes (median of {len(flushes)} rounds)")
    print(f"  doors' flush (one upsert of {sandboxes} rows): {write_ms:.1f} ms, "
          f"{write_wal / 1024:.0f} KiB of WAL")  # fmt: skip
    print(f"  scheduler's idle scan (none due): {scan_ms:.1f} ms")
    print(f"  per second at the default flush interval ({flush:g} s): "
          f"{(write_ms + scan_ms) / flush:.1f} ms of PostgreSQL, "
          f"{write_wal / flush / 1024:.0f} KiB/s of WAL; 0 messages on the log")  # fmt: skip
