"""Input partitions stopped at a record PostgreSQL refused to store, and the operator's way on.

The processor dead-letters a record a batch write refuses; if even that write is refused, it
stops the record's partition (records it here, pauses it, goes on with the others) instead of
failing again forever. An operator then skips the record (the offset moves past it and the
history says who skipped it and why) or lets the processor retry it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import asyncpg

from projections.chain import CHAIN_LINKS, Chains, HistoryContent, chain_of

if TYPE_CHECKING:
    from projections.store import Connection


@dataclass(frozen=True, slots=True)
class StoppedPartition:
    topic: str
    partition: int
    offset: int
    key: str | None
    reason: str
    stopped_at: datetime

    def describe(self) -> str:
        return (
            f"partition {self.partition} stopped at {self.topic} offset {self.offset}: "
            f"{self.reason} (skip it with `sandstream processor skip --topic {self.topic} "
            f"--partition {self.partition} --offset {self.offset}`)"
        )


class NotStoppedThere(Exception):
    """The partition is not stopped at that record (a wrong offset, or already skipped)."""


async def record_stop(
    conn: Connection, topic: str, partition: int, offset: int, key: str | None, reason: str
) -> None:
    await conn.execute(
        'INSERT INTO stopped_partitions (topic, partition, "offset", key, reason) '
        "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (topic, partition) DO UPDATE SET "
        '"offset" = EXCLUDED."offset", key = EXCLUDED.key, reason = EXCLUDED.reason, '
        "stopped_at = now()",
        topic, partition, offset, key, reason,
    )  # fmt: skip


async def stopped_partitions(conn: Connection, topics: list[str]) -> list[StoppedPartition]:
    rows = await conn.fetch(
        'SELECT topic, partition, "offset", key, reason, stopped_at FROM stopped_partitions '
        "WHERE topic = ANY($1) ORDER BY partition, topic",
        topics,
    )
    return [
        StoppedPartition(r["topic"], r["partition"], r["offset"], r["key"], r["reason"],
                         r["stopped_at"])
        for r in rows
    ]  # fmt: skip


async def skip_record(
    conn: Connection, topic: str, partition: int, offset: int, actor: str, note: str
) -> StoppedPartition:
    """Move the partition's offset past the record it stopped at, record that in the history,
    and clear the stop; the processor then goes on after it. All or nothing."""
    async with conn.transaction():
        stopped = await _take(conn, topic, partition, offset)
        moved = await conn.execute(
            "UPDATE input_offsets SET next_offset = $3 + 1, updated_at = now() "
            "WHERE topic = $1 AND partition = $2 AND next_offset = $3",
            topic, partition, offset,
        )  # fmt: skip
        if moved == "UPDATE 0":
            created = await conn.execute(
                "INSERT INTO input_offsets (topic, partition, next_offset) "
                "SELECT $1, $2, $3 + 1 WHERE $3 = 0 AND NOT EXISTS "
                "(SELECT FROM input_offsets WHERE topic = $1 AND partition = $2)",
                topic, partition, offset,
            )  # fmt: skip
            if created == "INSERT 0 0":
                raise NotStoppedThere(
                    f"{topic} partition {partition}: its stored offset is not {offset}"
                )
        reason = f"skipped by {actor}: {note} (the processor could not store it: {stopped.reason})"
        await _link_skipped(conn, stopped, reason)
    return stopped


async def _link_skipped(conn: Connection, stopped: StoppedPartition, reason: str) -> None:
    """Write the skip's history entry linked onto its chain like every entry the processor
    writes (its head by the processor's probes). The partition is stopped, but its chain can
    still move: a record on a partition its key is not on joins its key's chain, which the
    owner of the key's partition writes. The database refuses a second link to one head
    (``CHAIN_LINKS``); then the entry is linked again onto the new head."""
    key, topic, partition, offset = stopped.key, stopped.topic, stopped.partition, stopped.offset
    content: HistoryContent = (
        key, topic, partition, offset, None, None, "skipped", reason, None, None, None, [],
        None, None, None,
    )  # fmt: skip
    while True:
        head = await (
            conn.fetchval(_KEYED_HEAD, key)
            if key is not None
            else conn.fetchval(_UNKEYED_HEAD, partition)
        )
        prev, own = Chains({chain_of(key, partition): head}).linked(content)
        try:
            async with conn.transaction():  # a savepoint: a refused link leaves the skip whole
                await conn.execute(
                    'INSERT INTO history (key, topic, partition, "offset", disposition, reason, '
                    "event_types, prev_hash, entry_hash) VALUES ($1, $2, $3, $4, 'skipped', $5, "
                    "'{}', $6, $7)",
                    key, topic, partition, offset, reason, prev, own,
                )  # fmt: skip
            return
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name not in CHAIN_LINKS:
                raise


_KEYED_HEAD = "SELECT entry_hash FROM history WHERE key = $1 ORDER BY id DESC LIMIT 1"
_UNKEYED_HEAD = (
    "SELECT entry_hash FROM history WHERE key IS NULL AND partition = $1 ORDER BY id DESC LIMIT 1"
)


async def retry_record(conn: Connection, topic: str, partition: int, offset: int) -> None:
    """Clear the stop: the processor tries the record again (after a fix of the database)."""
    async with conn.transaction():
        await _take(conn, topic, partition, offset)


async def _take(conn: Connection, topic: str, partition: int, offset: int) -> StoppedPartition:
    row = await conn.fetchrow(
        'DELETE FROM stopped_partitions WHERE topic = $1 AND partition = $2 AND "offset" = $3 '
        'RETURNING topic, partition, "offset", key, reason, stopped_at',
        topic, partition, offset,
    )  # fmt: skip
    if row is None:
        raise NotStoppedThere(
            f"{topic} partition {partition} is not stopped at offset {offset} "
            "(see `sandstream status` or /readyz for where it is stopped)"
        )
    return StoppedPartition(
        row["topic"], row["partition"], row["offset"], row["key"], row["reason"],
        row["stopped_at"],
    )  # fmt: skip
