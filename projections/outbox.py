"""The outbox's way to the events topic in PostgreSQL: what a partition's owner has not yet
published (above its publish cursor), what it set aside as too large to send, and the cursor
moved over what Kafka acknowledged (docs/adr/0002-outbox-published-off-the-ordered-path.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from projections.store import OutboxRecord

if TYPE_CHECKING:
    from projections.store import Connection

_UNPUBLISHED = """
SELECT id, topic, key, value FROM outbox
WHERE partition = $1
  AND id > coalesce((SELECT published_id FROM outbox_cursor WHERE partition = $1), 0)
ORDER BY id
"""


async def set_aside_outbox(
    conn: Connection, records: Sequence[tuple[int, OutboxRecord]], reason: str
) -> None:
    """Record outbox records that will never be sent (``outbox_set_aside``); once is enough."""
    await conn.executemany(
        "INSERT INTO outbox_set_aside (outbox_id, partition, topic, key, size, reason) "
        "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (outbox_id) DO NOTHING",
        [(i, r.partition, r.topic, r.key, len(r.key or b"") + len(r.value), reason)
         for i, r in records],
    )  # fmt: skip


async def unpublished_outbox(conn: Connection, partition: int) -> list[tuple[int, OutboxRecord]]:
    rows = await conn.fetch(_UNPUBLISHED, partition)
    return [(r["id"], OutboxRecord(partition, r["topic"], r["key"], r["value"])) for r in rows]


# The cursor of a partition moves over the outbox ids a publisher had acknowledged, but never
# past an id of that partition it did not send (a record another owner committed and did not
# publish): it stops below the first such gap, so nothing committed is ever skipped.
_MARK_PUBLISHED = """
WITH acked AS (
    SELECT * FROM unnest($1::int[], $2::bigint[]) AS a(p, id)
), cur AS (
    SELECT ps.p, coalesce(c.published_id, 0) AS at
    FROM (SELECT DISTINCT p FROM acked) ps LEFT JOIN outbox_cursor c ON c.partition = ps.p
), gap AS (
    -- The first unacknowledged id above the cursor is among the first n + 1 ids above it
    -- (n: the distinct acknowledged ids above it), so only those are read, through
    -- outbox_partition: a cost of the acknowledged ids, not of the outbox's size.
    SELECT cur.p, min(o.id) AS first_missing
    FROM cur CROSS JOIN LATERAL (
        SELECT id FROM outbox WHERE partition = cur.p AND id > cur.at ORDER BY id
        LIMIT (SELECT count(DISTINCT a.id) FROM acked a WHERE a.p = cur.p AND a.id > cur.at) + 1
    ) AS o
    WHERE NOT EXISTS (SELECT 1 FROM acked a WHERE a.p = cur.p AND a.id = o.id)
    GROUP BY cur.p
), target AS (
    SELECT cur.p, max(a.id) AS to_id
    FROM cur JOIN acked a ON a.p = cur.p AND a.id > cur.at
    LEFT JOIN gap g ON g.p = cur.p
    WHERE g.first_missing IS NULL OR a.id < g.first_missing
    GROUP BY cur.p
), moved AS (
    INSERT INTO outbox_cursor (partition, published_id) SELECT p, to_id FROM target
    ON CONFLICT (partition) DO UPDATE SET published_id =
        GREATEST(outbox_cursor.published_id, EXCLUDED.published_id)
)
SELECT g.p AS partition, g.first_missing FROM gap g
WHERE g.first_missing < (SELECT max(a.id) FROM acked a WHERE a.p = g.p)
"""


async def mark_published(conn: Connection, acked: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """Move the publish cursors over acknowledged outbox ids (``acked``: input partition to
    ids). Returns, per partition whose cursor had to stop early, the first id below the
    acknowledged ones that was never acknowledged (it must be published again)."""
    items = [(p, i) for p, ids in sorted(acked.items()) for i in ids]
    if not items:
        return {}
    rows = await conn.fetch(_MARK_PUBLISHED, [p for p, _ in items], [i for _, i in items])
    return {r["partition"]: r["first_missing"] for r in rows}
