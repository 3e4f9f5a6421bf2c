"""Who may move an input partition's stored offsets: the offsets a processor resumes from, and
the owner epoch an assignment raises so that a previous owner still running (a zombie) commits
nothing after it (compose/migrations/0210_owner_epoch.sql; the batch write checks it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from projections.store import TopicPartitionKey

if TYPE_CHECKING:
    from projections.store import Connection

# Statement order (topic, partition), as the batch writes lock them: no deadlock between them.
_CLAIM = """
INSERT INTO input_offsets AS o (topic, partition, next_offset, owner_epoch)
SELECT t, p, 0, 1 FROM unnest($1::text[], $2::int[]) AS u(t, p) ORDER BY t, p
ON CONFLICT (topic, partition) DO UPDATE SET owner_epoch = o.owner_epoch + 1
RETURNING topic, partition, owner_epoch
"""


async def claim_partitions(
    conn: Connection, partitions: Iterable[TopicPartitionKey]
) -> dict[TopicPartitionKey, int]:
    """Raise the owner epoch of each of ``partitions`` (its row made at offset 0 if none) and
    return the new ones: a batch written with an older epoch (a previous owner's, still
    running) is fenced from now on. Waits for a batch in flight on them to commit first (their
    row locks), so what it committed is read after this returns."""
    pairs = sorted(set(partitions))
    rows = await conn.fetch(_CLAIM, [t for t, _ in pairs], [p for _, p in pairs])
    return {(r["topic"], r["partition"]): r["owner_epoch"] for r in rows}


async def owner_epochs(
    conn: Connection, partitions: Iterable[TopicPartitionKey]
) -> dict[TopicPartitionKey, int]:
    """The stored owner epoch of each of ``partitions`` that has a row."""
    pairs = sorted(set(partitions))
    rows = await conn.fetch(
        "SELECT topic, partition, owner_epoch FROM input_offsets "
        "WHERE (topic, partition) IN (SELECT * FROM unnest($1::text[], $2::int[]))",
        [t for t, _ in pairs],
        [p for _, p in pairs],
    )
    return {(r["topic"], r["partition"]): r["owner_epoch"] for r in rows}


async def stored_offsets(conn: Connection, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    rows = await conn.fetch(
        "SELECT topic, partition, next_offset FROM input_offsets WHERE topic = ANY($1)",
        list(topics),
    )
    return {(r["topic"], r["partition"]): r["next_offset"] for r in rows}
