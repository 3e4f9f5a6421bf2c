"""Single-active roles: a lease held as a PostgreSQL advisory lock on a dedicated connection.

Every instance of a single-active role (the watcher and reconciler, the scheduler) runs
``Lease.run``: it tries ``pg_try_advisory_lock`` every ``lease_check_seconds``; the instance
that gets the lock runs the role's work until it stops, and the others wait as standbys.

- **Takeover.** The lock belongs to the holder's database session. When the holder dies its
  connection closes and PostgreSQL releases the lock at once; a standby takes it at its next
  try, within ``lease_check_seconds``. When the holder's host or network goes away instead,
  PostgreSQL notices through the TCP keepalive and user timeout set on the session
  (``RELEASE_AFTER_SECONDS``), then releases it.
- **Giving up.** The holder checks its connection every ``lease_check_seconds`` (a query
  answered within the same time); when the check fails it stops the work at once, before
  PostgreSQL can have released the lock to anyone else (the check fails well within
  ``RELEASE_AFTER_SECONDS``), and goes back to trying.
- **A work that fails on PostgreSQL.** A work whose own connection is lost or refused (a
  restart the check has not seen yet) gives the lease up and tries again, as a lost lease;
  any other failure of the work is raised (the process exits, for a supervisor to restart).
- **Scope.** The lock's key is derived from the schema and the lease's name, so isolated
  environments (one schema each) never share a lease.

What the work produces are observations, which the processor decides idempotently: an
overlap (a holder whose work takes longer to stop than PostgreSQL takes to release the lock)
repeats reports, and cannot change a row in a way one report would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from events.backoff import pause
from projections.store import CONNECTION_ERRORS, DATABASE_ERRORS
from services.common import metrics
from services.common.settings import Settings
from services.common.tasks import STOP_TIMEOUT

log = logging.getLogger("sandstream.lease")

# PostgreSQL drops a silent holder's session (and the lock) after about this long: keepalive
# probes after 5s idle, every 2s, 3 of them; unacknowledged data after 11s.
KEEPALIVE = {
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "11000",
}
RELEASE_AFTER_SECONDS = 11.0
# What fails a try or a check: PostgreSQL away or refusing, or no answer in time.
_TROUBLE: tuple[type[Exception], ...] = (*DATABASE_ERRORS, TimeoutError)

Work = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


def lock_key(schema: str, name: str) -> int:
    """The advisory lock's 64-bit key for lease ``name`` in ``schema``."""
    digest = hashlib.blake2b(f"sandstream:{schema}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass
class Lease:
    """Runs ``work`` only while this instance holds the lease ``name``."""

    settings: Settings
    name: str
    held: bool = False
    acquisitions: int = 0  # how often this instance took the lease
    last_error: str | None = None  # why the last attempt or check failed
    _conn: asyncpg.Connection[asyncpg.Record] | None = field(default=None, repr=False)

    @property
    def interval(self) -> float:
        return self.settings.lease_check_seconds

    async def run(self, stop: asyncio.Event, work: Work) -> None:
        """Until ``stop``: take the lease, run ``work`` while holding it. ``work`` gets its
        own stop event (set when the lease is lost or ``stop`` is set); if it ends by
        itself, the lease is released and its error (if any) raised."""
        metrics.LEASE_HELD.labels(self.name).set(0)
        try:
            while not stop.is_set():
                if await self._acquire():
                    await self._hold(stop, work)
                    continue
                if await pause(stop, self.interval):
                    return
        finally:
            await self._release()

    async def _acquire(self) -> bool:
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await asyncpg.connect(
                    self.settings.pg_dsn, server_settings=KEEPALIVE, timeout=self.interval * 2
                )
            got = await self._conn.fetchval(
                "SELECT pg_try_advisory_lock($1)",
                lock_key(self.settings.pg_schema, self.name),
                timeout=self.interval * 2,
            )
        except _TROUBLE as exc:
            self.last_error = repr(exc)
            await self._drop_connection()
            return False
        self.last_error = None
        return bool(got)

    async def _hold(self, stop: asyncio.Event, work: Work) -> None:
        self.held = True
        self.acquisitions += 1
        metrics.LEASE_HELD.labels(self.name).set(1)
        log.info("lease %s taken: this instance is active", self.name)
        lost = asyncio.Event()
        task = asyncio.create_task(work(lost), name=f"lease:{self.name}")
        try:
            while not task.done():
                if stop.is_set() or not await self._still_held():
                    break
                waiter = asyncio.ensure_future(stop.wait())
                await asyncio.wait([task, waiter], timeout=self.interval,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                waiter.cancel()
        finally:
            lost.set()
            self.held = False
            metrics.LEASE_HELD.labels(self.name).set(0)
            ended_by_itself = task.done()
            await _finish(task)
        if ended_by_itself and not stop.is_set():
            await self._release()
            try:
                task.result()  # raises the work's error
            except CONNECTION_ERRORS as exc:
                # PostgreSQL went away under the work before this check saw it (a restart):
                # as a lost lease, not a crash. A standby may take it meanwhile.
                self.last_error = repr(exc)
                log.warning("lease %s given up: its work failed on PostgreSQL (%r); trying "
                            "to take it again", self.name, exc)  # fmt: skip
                await pause(stop, self.interval)
                return
            raise RuntimeError(f"the work of lease {self.name} ended by itself")
        if not stop.is_set():
            log.warning("lease %s lost (%s): work stopped; trying to take it again",
                        self.name, self.last_error)  # fmt: skip

    async def _still_held(self) -> bool:
        assert self._conn is not None
        try:
            await self._conn.fetchval("SELECT 1", timeout=self.interval)
        except _TROUBLE as exc:
            self.last_error = repr(exc)
            await self._drop_connection()
            return False
        return True

    async def _release(self) -> None:
        """Close the session: PostgreSQL releases its lock with it."""
        if self._conn is not None and not self._conn.is_closed():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._conn.close(), timeout=self.interval)
        await self._drop_connection()

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            conn.terminate()


async def _finish(task: asyncio.Task[None]) -> None:
    """Wait for the work to end after its stop event was set (cancelled if it overstays)."""
    with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
        await asyncio.wait_for(asyncio.shield(task), timeout=STOP_TIMEOUT)
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
