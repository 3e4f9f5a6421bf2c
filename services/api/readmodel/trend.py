"""Live sandboxes per phase now and over a recent window, from the history (the console's chart).

The counts at the end of each bucket are worked out backwards from now: the current counts
(``sandboxes``), undoing each phase change the history recorded in the window, newest first. A
phase change is an entry whose phase differs from its sandbox's previous entry (the previous
entry before the window is found through ``history_key``, one probe per sandbox that changed).

The cost is that of the inputs recorded in the window, never the whole history: migration 0130's
BRIN index on ``recorded_at`` finds them (ranges autovacuum has not summarised yet, the newest,
are read whole), the statement is planned for its window each time (``force_custom_plan``: a
generic plan made on a small table would scan), and a statement timeout bounds it
(tests/test_read_plans.py checks the plan with 20,000 sandboxes' history over a week).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

import asyncpg

from events.common import LIVE_PHASES, Phase
from services.common.database import Pool

BUCKETS: Final = 60  # points of the series, whatever the window
TREND_WINDOWS: Final = (1, 6, 24)  # hours a chart may cover
STATEMENT_TIMEOUT: Final = "5s"  # the longest the window's query may take

LIVE_COUNTS: Final = (
    "SELECT phase, count(*) AS n FROM sandboxes WHERE phase <> 'Deleted' GROUP BY phase"
)
# Phase changes in the window, counted per bucket: (bucket, before, after, n). Dead letters
# decided nothing (their phase is null while the row stood): they are no change.
MOVES: Final = """
WITH w AS MATERIALIZED (
    SELECT id, key, phase, recorded_at FROM history
    WHERE recorded_at >= $1 AND key IS NOT NULL AND disposition <> 'dead-lettered'
), t AS (
    SELECT w.recorded_at, w.phase AS after,
           CASE WHEN lag(w.id) OVER k IS NULL
                THEN (SELECT h.phase FROM history h
                      WHERE h.key = w.key AND h.id < w.id AND h.disposition <> 'dead-lettered'
                      ORDER BY h.id DESC LIMIT 1)
                ELSE lag(w.phase) OVER k END AS before
    FROM w WINDOW k AS (PARTITION BY w.key ORDER BY w.id)
)
SELECT least(floor(extract(epoch FROM t.recorded_at - $1) / $2)::int, $3 - 1) AS bucket,
       before, after, count(*) AS n
FROM t WHERE before IS DISTINCT FROM after GROUP BY 1, 2, 3
"""


class TrendTooLarge(RuntimeError):
    """The window's history could not be read within the statement timeout."""


@dataclass(frozen=True, slots=True)
class Move:
    """``n`` sandboxes went from ``before`` to ``after`` (None: no row) during ``bucket``."""

    bucket: int
    before: str | None
    after: str | None
    n: int


@dataclass(frozen=True, slots=True)
class Trend:
    """Live sandboxes per phase at the end of each bucket, oldest first; the last is now."""

    start: datetime
    step: timedelta
    counts: list[dict[Phase, int]]

    @property
    def now(self) -> dict[Phase, int]:
        return self.counts[-1]

    def end_of(self, bucket: int) -> datetime:
        return self.start + self.step * (bucket + 1)


def series(now: Mapping[Phase, int], moves: Iterable[Move], buckets: int) -> list[dict[Phase, int]]:
    """The counts at the end of each bucket, from the counts now and the moves in each bucket."""
    by_bucket: dict[int, list[Move]] = {}
    for move in moves:
        by_bucket.setdefault(min(max(move.bucket, 0), buckets - 1), []).append(move)
    counts: dict[Phase, int] = {p: now.get(p, 0) for p in LIVE_PHASES}
    out: list[dict[Phase, int]] = []
    for bucket in range(buckets - 1, -1, -1):
        out.append({p: max(n, 0) for p, n in counts.items()})
        # Undo the bucket's moves: the counts as it began. A sum, so their order does not matter.
        for move in by_bucket.get(bucket, ()):
            _shift(counts, move.after, -move.n)
            _shift(counts, move.before, move.n)
    out.reverse()
    return out


def _shift(counts: dict[Phase, int], phase: str | None, n: int) -> None:
    if phase is not None and phase != Phase.DELETED.value:
        counts[Phase(phase)] += n


async def live_counts(pool: Pool) -> dict[Phase, int]:
    """Live sandboxes per phase, now (every live phase, zero ones included)."""
    records = await pool.fetch(LIVE_COUNTS)
    found = {Phase(r["phase"]): int(r["n"]) for r in records}
    return {p: found.get(p, 0) for p in LIVE_PHASES}


async def phase_trend(
    pool: Pool, hours: int, buckets: int = BUCKETS, timeout: str = STATEMENT_TIMEOUT
) -> Trend:
    """The counts over the last ``hours`` (one of ``TREND_WINDOWS``), read in one snapshot;
    ``TrendTooLarge`` if the window's history takes longer than ``timeout`` to read."""
    if hours not in TREND_WINDOWS:
        raise ValueError(f"hours: one of {', '.join(map(str, TREND_WINDOWS))}")
    if not re.fullmatch(r"\d+(ms|s)", timeout):
        raise ValueError(f"timeout: a PostgreSQL duration such as 5s, got {timeout!r}")
    async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        await conn.execute(
            "SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL jit = off; "
            f"SET LOCAL statement_timeout = '{timeout}'"
        )
        now = await conn.fetchval("SELECT now()")
        step = timedelta(hours=hours) / buckets
        start = now - step * buckets
        counts = {Phase(r["phase"]): int(r["n"]) for r in await conn.fetch(LIVE_COUNTS)}
        try:
            records = await conn.fetch(MOVES, start, step.total_seconds(), buckets)
        except asyncpg.QueryCanceledError:
            raise TrendTooLarge(
                f"the history of the last {hours} h takes longer than {timeout} to read"
            ) from None
    moves = [Move(r["bucket"], r["before"], r["after"], int(r["n"])) for r in records]
    return Trend(start, step, series(counts, moves, buckets))
