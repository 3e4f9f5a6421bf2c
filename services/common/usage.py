"""Use of sandboxes through sandstream's doors, recorded coarsely for idle suspend.

A door calls ``touch(name)`` for a call (an exec, a file call, a read of logs) and holds
``using(name)`` while a session lasts (an exec running, a followed log, a watch of one
sandbox). Nothing is written per call: every ``flush_seconds`` one statement upserts the
sandboxes touched since the last flush and those with a session open, at the flush's time,
into ``sandbox_use``. So a sandbox costs at most one row write per flush interval per API
process however busy it is, and a session longer than any idle timeout keeps its sandbox awake
(it is written at every flush while it lasts). The scheduler reads the table (``idle_rows``,
its idle scan) and puts what it read on the log; the decision is the fold's
(projections/lifecycle/idle.py). The same scan forgets the use of deleted sandboxes
(``forget_deleted``): a door may record a use just after a delete, so removing the row at the
delete alone would leave some behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from projections.store import DATABASE_ERRORS
from services.common.database import Pool

log = logging.getLogger("sandstream.usage")
T = TypeVar("T")

_UPSERT = """
INSERT INTO sandbox_use (key, last_used_at)
SELECT k, $2 FROM unnest($1::text[]) AS k
ON CONFLICT (key) DO UPDATE
SET last_used_at = greatest(sandbox_use.last_used_at, excluded.last_used_at)
"""


# Ready sandboxes with an idle timeout whose last sign of use (the row's last change or the
# doors' recorded use) is older than the timeout plus the doors' flush interval ($2): a use not
# yet flushed is never taken for idle time. A warm pool's unclaimed member is never idle. The
# partial index sandboxes_idle holds only these rows (and the members).
_IDLE = """
SELECT key, generation, version, last_used_at, since + make_interval(secs => idle + $2) AS due_at
FROM (
    SELECT s.key, s.generation, s.version, u.last_used_at,
           greatest(s.updated_at, u.last_used_at) AS since,
           (s.spec->>'idle_suspend_seconds')::float8 AS idle
    FROM sandboxes s LEFT JOIN sandbox_use u ON u.key = s.key
    WHERE s.phase = 'Ready' AND s.hold IS NULL AND s.spec ? 'idle_suspend_seconds'
      AND (s.pool IS NULL OR s.claim_id IS NOT NULL)  -- a pool's unclaimed member is never idle
) AS ready
WHERE since + make_interval(secs => idle + $2) <= $1
"""


# The use of sandboxes deleted since (a tombstone) or gone from the table: nothing reads it any
# more. At most $1 rows per call, so a burst of deletes is forgotten over a few scans.
_FORGET = """
DELETE FROM sandbox_use WHERE key IN (
    SELECT u.key FROM sandbox_use u LEFT JOIN sandboxes s ON s.key = u.key
    WHERE s.key IS NULL OR s.phase = 'Deleted'
    LIMIT $1
)
"""


async def forget_deleted(pool: Pool, limit: int) -> int:
    """Remove the recorded use of up to ``limit`` deleted sandboxes; how many were removed."""
    status = await pool.execute(_FORGET, limit)
    return int(status.rsplit(" ", 1)[-1])


async def idle_rows(pool: Pool, now: datetime, flush_seconds: float) -> list[Any]:
    """Every Ready row idle at ``now`` by the recorded use (the scheduler's idle scan): key,
    generation, version, last_used_at, due_at."""
    return list(await pool.fetch(_IDLE, now, flush_seconds))


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class UseRecorder:
    """The sandboxes used since the last flush and those in use now (one per API process,
    shared by its doors)."""

    pool: Pool | None
    flush_seconds: float
    clock: Callable[[], datetime] = utcnow
    written: int = 0  # rows written since start (one per sandbox per flush)
    _touched: set[str] = field(default_factory=set)
    _open: Counter[str] = field(default_factory=Counter)

    def touch(self, name: str) -> None:
        self._touched.add(name)

    @contextmanager
    def using(self, name: str) -> Iterator[None]:
        """In use while inside (written at every flush), and touched when it ends."""
        self._open[name] += 1
        try:
            yield
        finally:
            self._open[name] -= 1
            if not self._open[name]:
                del self._open[name]
            self._touched.add(name)

    def in_use(self) -> set[str]:
        return set(self._open)

    async def while_using(self, names: Iterable[str], items: AsyncIterator[T]) -> AsyncIterator[T]:
        """``items``, the sandboxes ``names`` in use while they are read; ``items`` is closed
        with it (a download's runtime stream must not wait for the garbage collector)."""
        with ExitStack() as stack:
            for name in set(names):
                stack.enter_context(self.using(name))
            try:
                async for item in items:
                    yield item
            finally:
                closing = getattr(items, "aclose", None)
                if closing is not None:
                    await closing()

    async def begin(self, name: str, idle_seconds: int | None) -> None:
        """A session begins on a sandbox with an idle timeout: its use is written now, not at
        the next flush. The scheduler may find the sandbox idle at any moment after its timeout
        (it waits one flush interval past it only for uses before it), so a command begun then
        would be cut off by a suspend decided on the last flush's record."""
        if idle_seconds is None or self.pool is None:
            return
        try:
            await self.pool.execute(_UPSERT, [name], self.clock())
        except DATABASE_ERRORS as exc:
            self._touched.add(name)
            log.warning("use of %s not recorded yet (%s); next flush", name, exc)
        else:
            self.written += 1

    async def flush(self) -> int:
        """Write the sandboxes used since the last flush or in use now; how many. A failed
        write keeps them for the next flush."""
        names = self._touched | set(self._open)
        if not names or self.pool is None:
            return 0
        self._touched = set()
        try:
            await self.pool.execute(_UPSERT, sorted(names), self.clock())
        except DATABASE_ERRORS as exc:
            self._touched |= names
            log.warning("use of %d sandboxes not recorded yet (%s); next flush", len(names), exc)
            return 0
        self.written += len(names)
        return len(names)

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every ``flush_seconds`` until ``stop``, then once more."""
        while not stop.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.flush_seconds)
            await self.flush()
