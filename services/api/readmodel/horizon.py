"""The horizon of both feeds: up to which value of a sequence drawn in the processor's
transactions every value is committed, so that no reader steps over a change still being written.

``change_seq`` (the row change feed) and the outbox ids (the decided-event feed) are drawn from
sequences inside the processor's transactions, so a transaction can commit a lower value after
another committed a higher one; a watcher that moved its cursor past the higher value would miss
the lower one forever. Both are drawn only by statements holding a write lock on the sandboxes
table (taken before the statement runs), so: read the sequence's last value, then wait until the
transactions that held the lock at that moment have ended. Every value up to it is then
committed (or rolled back) and visible to any query that starts afterwards. Writer transactions
last milliseconds.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from events.backoff import Backoff
from services.common.database import Pool

# The sequences drawn under the sandboxes table's write lock: rows' change_seq, outbox ids.
Drawn = Literal["sandbox_changes", "outbox_id_seq"]


async def _writers(conn: Any, among: list[str] | None = None) -> list[str]:
    """Transactions (virtual ids) holding a write lock on this schema's sandboxes table."""
    found = await conn.fetchval(
        "SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{}') FROM pg_locks "
        "WHERE locktype = 'relation' AND relation = to_regclass('sandboxes') "
        "AND mode = 'RowExclusiveLock' AND pid <> pg_backend_pid() "
        "AND ($1::text[] IS NULL OR virtualtransaction = ANY($1::text[]))",
        among,
    )
    return list(found)


async def committed_through(conn: Any, sequence: Drawn, timeout: float = 2.0) -> int | None:
    """The highest value of ``sequence`` below which every value is committed (None: the
    writers of the moment it was read did not end within ``timeout``)."""
    row = await conn.fetchrow(f"SELECT last_value, is_called FROM {sequence}")
    last = int(row["last_value"]) if row["is_called"] else 0
    writers = await _writers(conn)
    if writers:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        polls = Backoff(0.002, 0.05)  # writers last milliseconds: poll fast, then less often
        while writers:
            if loop.time() > deadline:
                return None
            await asyncio.sleep(polls.next())  # a commit does not notify before its lock goes
            writers = await _writers(conn, writers)
    return last


async def change_horizon(conn: Any, timeout: float = 2.0) -> int | None:
    """The highest ``change_seq`` below which every row change is committed (None: not known
    yet)."""
    return await committed_through(conn, "sandbox_changes", timeout)


async def current_horizon(pool: Pool) -> int | None:
    async with pool.acquire() as conn:
        return await change_horizon(conn)


async def event_horizon(pool: Pool, timeout: float = 2.0) -> int | None:
    """The highest outbox id below which every id is committed (None: not known yet)."""
    async with pool.acquire() as conn:
        return await committed_through(conn, "outbox_id_seq", timeout)
