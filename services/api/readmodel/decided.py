"""The feed of decided events (``/v1/watch/events``), from the outbox: every event the
processor decided, in commit order (per sandbox: version order), each with its outbox id as the
cursor, read up to ``horizon.event_horizon``.

The outbox may be pruned by housekeeping (docs/operations.md): a cursor below the oldest
retained id is answered with a gap notice saying from where the feed is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final
from uuid import UUID

from services.common.database import Pool, planned_for_now


@dataclass(frozen=True, slots=True)
class Decided:
    seq: int  # the outbox id: the cursor
    body: str  # the event as published on the events topic


RETAINED_FROM: Final = "SELECT min(id) FROM outbox WHERE topic = $1"


async def retained_from(pool: Pool, topic: str) -> int | None:
    """The oldest outbox id still kept for ``topic`` (None: none kept)."""
    # Planned for the outbox as it is now (the first id of the topic, through the primary
    # key): a generic plan kept from when it was empty scanned it whole at every start.
    async with planned_for_now(pool) as conn:
        value: Any = await conn.fetchval(RETAINED_FROM, topic)
    return int(value) if value is not None else None


EVENTS_PAGE: Final = 500  # events per read of the feed


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
