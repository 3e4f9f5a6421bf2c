"""The feed of decided events, from the outbox: every event the processor decided, in commit
order (per sandbox: version order), each with its outbox id as the cursor.

Outbox ids are drawn inside the processor's write statements, which all hold a write lock on
the sandboxes table from their start (the same argument as the row change feed's horizon in
readmodel.py): read the id sequence, wait for the writers of that moment to end, and every id
up to it is committed or rolled back.

The outbox may be pruned by housekeeping (docs/operations.md): a cursor below the oldest
retained id is answered with a gap notice saying from where the feed is complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final
from uuid import UUID

from services.api.readmodel import Pool, _writers


@dataclass(frozen=True, slots=True)
class Decided:
    seq: int  # the outbox id: the cursor
    body: str  # the event as published on the events topic


async def event_horizon(pool: Pool, timeout: float = 2.0) -> int | None:
    """The highest outbox id below which every id is committed (None: not known yet)."""
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT last_value, is_called FROM outbox_id_seq")
        assert row is not None
        last = int(row["last_value"]) if row["is_called"] else 0
        writers = await _writers(conn)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.002
        while writers:
            if loop.time() > deadline:
                return None
            await asyncio.sleep(delay)  # a writer's commit does not notify before its lock goes
            delay = min(delay * 2, 0.05)
            writers = await _writers(conn, writers)
    return last


RETAINED_FROM: Final = "SELECT min(id) FROM outbox WHERE topic = $1"


async def retained_from(pool: Pool, topic: str) -> int | None:
    """The oldest outbox id still kept for ``topic`` (None: none kept)."""
    async with pool.acquire() as conn, conn.transaction():
        # Planned for the outbox as it is now (the first id of the topic, through the primary
        # key): a generic plan kept from when it was empty scanned it whole at every start.
        await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
        value: Any = await conn.fetchval(RETAINED_FROM, topic)
    return int(value) if value is not None else None


EVENTS_PAGE = 500


_NARROW: Final = (
    "AND ($5::uuid IS NULL OR (convert_from(value, 'UTF8')::json->>'sandbox_id')::uuid = $5) "
    "AND ($6::int IS NULL OR (convert_from(value, 'UTF8')::json->>'generation')::int = $6)"
)
EVENTS: Final = (
    "SELECT id, convert_from(value, 'UTF8') AS body FROM outbox "
    f"WHERE topic = $1 AND id > $2 AND id <= $3 {_NARROW} ORDER BY id LIMIT $4"
)
# One walk of outbox_key per name, from the cursor on: the events of the names, not every
# event since the cursor (from cursor 0, the whole outbox). The LIMIT keeps each walk a walk
# of the index (not flattened into a join the planner may make a scan of the outbox).
EVENTS_OF_NAMES: Final = (
    "SELECT id, convert_from(value, 'UTF8') AS body "
    "FROM (SELECT DISTINCT name FROM unnest($4::text[]) AS name) AS n CROSS JOIN LATERAL ("
    "SELECT id, value FROM outbox WHERE key = convert_to(n.name, 'UTF8') AND id > $2 "
    f"AND id <= $3 AND topic = $1 {_NARROW} ORDER BY id LIMIT $7) AS o ORDER BY id LIMIT $7"
)
# The name of an incarnation, from its history (history_incarnation); none once its entries
# are archived, or for entries written before migration 0041.
INCARNATION_NAME: Final = "SELECT key FROM history WHERE sandbox_id = $1 LIMIT 1"


async def events_after(
    pool: Pool,
    topic: str,
    cursor: int,
    horizon: int,
    *,
    names: Sequence[str] = (),
    incarnation: UUID | None = None,
    generation: int | None = None,
    limit: int = EVENTS_PAGE,
) -> list[Decided]:
    """The events of ``topic`` after ``cursor`` up to ``horizon``, in id order, optionally of
    some names, of one incarnation, at one generation."""
    if incarnation is not None and not names:
        named = await pool.fetchval(INCARNATION_NAME, incarnation)
        names = [named] if named is not None else ()  # not named: read every event since
    if names:
        records = await pool.fetch(
            EVENTS_OF_NAMES, topic, cursor, horizon, list(names), incarnation, generation, limit
        )
    else:
        records = await pool.fetch(EVENTS, topic, cursor, horizon, limit, incarnation, generation)
    return [Decided(r["id"], r["body"]) for r in records]
