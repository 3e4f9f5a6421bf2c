"""The PostgreSQL side of the projection: read rows and outcomes, write one batch atomically."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeAlias

import asyncpg

from events.common import Phase, SandboxSpec
from events.outcomes import CommandOutcome
from events.topics import CHANGES_CHANNEL
from projections.lifecycle import Sandbox

if TYPE_CHECKING:
    Connection: TypeAlias = (
        asyncpg.Connection[asyncpg.Record] | asyncpg.pool.PoolConnectionProxy[asyncpg.Record]
    )


SANDBOX_COLUMNS = (
    "key, sandbox_id, phase, generation, version, spec, providers, identity, exit_code, reason, "
    "created_at, updated_at"
)


def sandbox_from_record(r: Any) -> Sandbox:
    return Sandbox(
        key=r["key"],
        sandbox_id=r["sandbox_id"],
        phase=Phase(r["phase"]),
        generation=r["generation"],
        version=r["version"],
        spec=SandboxSpec.model_validate_json(r["spec"]),
        providers=tuple(r["providers"]),
        identity=r["identity"],
        exit_code=r["exit_code"],
        reason=r["reason"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
    )


def sandbox_params(s: Sandbox) -> tuple[Any, ...]:
    return (
        s.key,
        s.sandbox_id,
        s.phase.value,
        s.generation,
        s.version,
        s.spec.model_dump_json(),
        list(s.providers),
        s.identity,
        s.exit_code,
        s.reason,
        s.created_at,
        s.updated_at,
    )


async def load_sandboxes(conn: Connection, keys: Iterable[str]) -> dict[str, Sandbox]:
    rows = await conn.fetch(
        f"SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE key = ANY($1::text[])", list(keys)
    )
    return {r["key"]: sandbox_from_record(r) for r in rows}


async def load_outcomes(
    conn: Connection, idents: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], CommandOutcome]:
    """Known outcomes by (sandbox key, command id)."""
    pairs = list(idents)
    if not pairs:
        return {}
    rows = await conn.fetch(
        "SELECT key, command_id, outcome FROM command_outcomes "
        "WHERE (key, command_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))",
        [k for k, _ in pairs],
        [c for _, c in pairs],
    )
    return {
        (r["key"], r["command_id"]): CommandOutcome.model_validate_json(r["outcome"]) for r in rows
    }


async def lock_offsets(conn: Connection, partition: int, topics: Sequence[str]) -> dict[str, int]:
    """Lock the partition's offset rows (creating them at 0) and return the next offsets.

    Every writer of a partition takes these locks first, in the same order, so writers of one
    partition are serialized and a stale one sees offsets it cannot go below.
    """
    await conn.executemany(
        "INSERT INTO input_offsets (topic, partition, next_offset) VALUES ($1, $2, 0) "
        "ON CONFLICT DO NOTHING",
        [(t, partition) for t in topics],
    )
    rows = await conn.fetch(
        "SELECT topic, next_offset FROM input_offsets WHERE partition = $1 AND topic = ANY($2) "
        "ORDER BY topic FOR UPDATE",
        partition,
        list(topics),
    )
    return {r["topic"]: r["next_offset"] for r in rows}


async def stored_offsets(conn: Connection, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    rows = await conn.fetch(
        "SELECT topic, partition, next_offset FROM input_offsets WHERE topic = ANY($1)",
        list(topics),
    )
    return {(r["topic"], r["partition"]): r["next_offset"] for r in rows}


@dataclass(frozen=True, slots=True)
class HistoryRow:
    key: str | None
    topic: str
    partition: int
    offset: int
    message_type: str | None
    command_id: str | None
    disposition: str
    reason: str
    phase: str | None
    generation: int | None
    version: int | None
    event_types: list[str]
    message: str | None
    occurred_at: datetime | None


HISTORY_COLUMNS = (
    "key", "topic", "partition", "offset", "message_type", "command_id", "disposition", "reason",
    "phase", "generation", "version", "event_types", "message", "occurred_at",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    topic: str
    key: bytes | None
    value: bytes


@dataclass(frozen=True, slots=True)
class BatchWrite:
    partition: int
    sandboxes: Sequence[Sandbox]
    history: Sequence[HistoryRow]
    outcomes: Sequence[CommandOutcome]
    outbox: Sequence[OutboxRecord]
    next_offsets: Mapping[str, int]


async def write_batch(conn: Connection, batch: BatchWrite) -> list[int]:
    """Write a decided batch; the caller holds the offset locks and the transaction.

    Returns the outbox ids, in order.
    """
    if batch.sandboxes:
        await conn.executemany(
            f"INSERT INTO sandboxes ({SANDBOX_COLUMNS}, partition, change_seq) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, "
            "nextval('sandbox_changes')) "
            "ON CONFLICT (key) DO UPDATE SET sandbox_id = EXCLUDED.sandbox_id, "
            "phase = EXCLUDED.phase, generation = EXCLUDED.generation, "
            "version = EXCLUDED.version, spec = EXCLUDED.spec, providers = EXCLUDED.providers, "
            "identity = EXCLUDED.identity, exit_code = EXCLUDED.exit_code, "
            "reason = EXCLUDED.reason, created_at = EXCLUDED.created_at, "
            "updated_at = EXCLUDED.updated_at, partition = EXCLUDED.partition, "
            "change_seq = EXCLUDED.change_seq",
            [(*sandbox_params(s), batch.partition) for s in batch.sandboxes],
        )
    if batch.history:
        await conn.copy_records_to_table(
            "history",
            columns=HISTORY_COLUMNS,
            records=[
                (
                    h.key,
                    h.topic,
                    h.partition,
                    h.offset,
                    h.message_type,
                    h.command_id,
                    h.disposition,
                    h.reason,
                    h.phase,
                    h.generation,
                    h.version,
                    h.event_types,
                    h.message,
                    h.occurred_at,
                )
                for h in batch.history
            ],
        )
    if batch.outcomes:
        await conn.executemany(
            "INSERT INTO command_outcomes (command_id, key, command_type, status, code, message, "
            "outcome) VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
            [
                (
                    o.command_id,
                    o.key,
                    o.command_type,
                    o.status,
                    o.code.value,
                    o.message,
                    o.model_dump_json(),
                )
                for o in batch.outcomes
            ],
        )
    ids: list[int] = []
    if batch.outbox:
        rows = await conn.fetch(
            "INSERT INTO outbox (partition, topic, key, value) "
            "SELECT $1, t, k, v FROM unnest($2::text[], $3::bytea[], $4::bytea[]) "
            "WITH ORDINALITY AS u(t, k, v, n) ORDER BY n RETURNING id",
            batch.partition,
            [o.topic for o in batch.outbox],
            [o.key for o in batch.outbox],
            [o.value for o in batch.outbox],
        )
        ids = sorted(r["id"] for r in rows)
    await conn.executemany(
        "UPDATE input_offsets SET next_offset = $3, updated_at = now() "
        "WHERE topic = $1 AND partition = $2 AND next_offset <= $3",
        [(t, batch.partition, o) for t, o in batch.next_offsets.items()],
    )
    await conn.execute("SELECT pg_notify($1, $2)", CHANGES_CHANNEL, str(batch.partition))
    return ids


async def unpublished_outbox(conn: Connection, partition: int) -> list[tuple[int, OutboxRecord]]:
    rows = await conn.fetch(
        "SELECT o.id, o.topic, o.key, o.value FROM outbox o "
        "LEFT JOIN outbox_cursor c ON c.partition = o.partition "
        "WHERE o.partition = $1 AND o.id > coalesce(c.published_id, 0) ORDER BY o.id",
        partition,
    )
    return [(r["id"], OutboxRecord(r["topic"], r["key"], r["value"])) for r in rows]


async def mark_published(conn: Connection, partition: int, up_to_id: int) -> None:
    await conn.execute(
        "INSERT INTO outbox_cursor (partition, published_id) VALUES ($1, $2) "
        "ON CONFLICT (partition) DO UPDATE SET published_id = "
        "GREATEST(outbox_cursor.published_id, EXCLUDED.published_id)",
        partition,
        up_to_id,
    )


def to_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
