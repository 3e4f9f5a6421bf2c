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
from typing import Any, Final, Literal, get_args

from events.backoff import Backoff
from services.common.database import Pool

# The sequences drawn under the sandboxes table's write lock: rows' change_seq, outbox ids.
Drawn = Literal["sandbox_changes", "outbox_id_seq"]


def _writers(seen: str) -> str:
    """Transactions (virtual ids) holding a write lock on this schema's sandboxes table, among
    those ``seen`` allows."""
    return (
        "SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{}') FROM pg_locks "
        "WHERE locktype = 'relation' AND relation = to_regclass('sandboxes') "
        f"AND mode = 'RowExclusiveLock' AND pid <> pg_backend_pid() AND {seen}"
    )


_STILL_WRITING: Final = _writers("virtualtransaction = ANY($1::text[])")
# The sequence and the writers of that moment in one statement. The lock scan must come after
# the sequence's read (a writer that locks and draws after the scan but before the read would
# be missed): as a subquery correlated with the sequence's row it is run once that row is read.
_SEQUENCE_THEN_WRITERS: Final = {
    sequence: f"SELECT s.last_value, s.is_called, ({_writers('s.is_called IS NOT NULL')}) "
    f"AS writers FROM {sequence} AS s"
    for sequence in get_args(Drawn)
}


async def committed_through(conn: Any, sequence: Drawn, timeout: float = 2.0) -> int | None:
    """The highest value of ``sequence`` below which every value is committed (None: the
    writers of the moment it was read did not end within ``timeout``)."""
    row = await conn.fetchrow(_SEQUENCE_THEN_WRITERS[sequence])
    last = int(row["last_value"]) if row["is_called"] else 0
    writers = list(row["writers"])
    if writers:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        polls = Backoff(0.002, 0.05)  # writers last milliseconds: poll fast, then less often
        while writers:
            if loop.time() > deadline:
                return None
            await asyncio.sleep(polls.next())  # a commit does not notify before its lock goes
            writers = list(await conn.fetchval(_STILL_WRITING, writers))
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
