"""The PostgreSQL side of the projection: read rows and outcomes, write one batch atomically."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeAlias
from uuid import UUID

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
    """A row from a database record, or from its JSON form (``json_build_object`` of it)."""
    spec, sandbox_id = r["spec"], r["sandbox_id"]
    return Sandbox(
        key=r["key"],
        sandbox_id=sandbox_id if isinstance(sandbox_id, UUID) else UUID(sandbox_id),
        phase=Phase(r["phase"]),
        generation=r["generation"],
        version=r["version"],
        spec=(
            SandboxSpec.model_validate_json(spec)
            if isinstance(spec, str)
            else SandboxSpec.model_validate(spec)
        ),
        providers=tuple(r["providers"]),
        identity=r["identity"],
        exit_code=r["exit_code"],
        reason=r["reason"],
        created_at=_timestamp(r["created_at"]),
        updated_at=_timestamp(r["updated_at"]),
    )


def _timestamp(value: datetime | str) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)


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


TopicPartitionKey = tuple[str, int]


# Lock the batch's offset rows (creating them at 0) and, in the same round trip, read its rows
# and known outcomes. Every writer takes these row locks first, in (topic, partition) order, so
# writers of one partition are serialized and a stale one sees the offsets it can no longer go
# below. The reads use the statement's snapshot, taken before the lock was granted: the caller
# may trust them only if the locked offsets are the ones it saw committed last (nobody wrote
# these partitions since); otherwise it must read again under the lock (load_sandboxes/outcomes).
_LOCK_AND_LOAD = """
WITH locked AS (
    INSERT INTO input_offsets (topic, partition, next_offset)
    SELECT t, p, 0 FROM unnest($1::text[], $2::int[]) AS u(t, p) ORDER BY t, p
    ON CONFLICT (topic, partition) DO UPDATE SET next_offset = input_offsets.next_offset
    RETURNING topic, partition, next_offset
)
SELECT 'offset' AS kind, topic, partition, next_offset, NULL::json AS body FROM locked
UNION ALL
SELECT 'row', NULL, NULL, NULL, json_build_object(
    'key', key, 'sandbox_id', sandbox_id, 'phase', phase, 'generation', generation,
    'version', version, 'spec', spec, 'providers', providers, 'identity', identity,
    'exit_code', exit_code, 'reason', reason, 'created_at', created_at,
    'updated_at', updated_at)
FROM sandboxes WHERE key = ANY($3::text[])
UNION ALL
SELECT 'outcome', NULL, NULL, NULL, outcome::json FROM command_outcomes
WHERE (key, command_id) IN (SELECT * FROM unnest($4::text[], $5::text[]))
"""


@dataclass(frozen=True, slots=True)
class Locked:
    offsets: dict[TopicPartitionKey, int]
    sandboxes: dict[str, Sandbox]
    outcomes: dict[tuple[str, str], CommandOutcome]


async def lock_and_load(
    conn: Connection,
    partitions: Iterable[TopicPartitionKey],
    keys: Iterable[str],
    idents: Iterable[tuple[str, str]],
) -> Locked:
    """Lock the offsets and read rows and outcomes in one round trip (see above for when the
    rows and outcomes may be trusted)."""
    pairs = sorted(set(partitions))
    wanted = list(idents)
    records = await conn.fetch(
        _LOCK_AND_LOAD,
        [t for t, _ in pairs],
        [p for _, p in pairs],
        list(keys),
        [k for k, _ in wanted],
        [c for _, c in wanted],
    )
    locked = Locked({}, {}, {})
    for r in records:
        if r["kind"] == "offset":
            locked.offsets[(r["topic"], r["partition"])] = r["next_offset"]
        elif r["kind"] == "row":
            sandbox = sandbox_from_record(json.loads(r["body"]))
            locked.sandboxes[sandbox.key] = sandbox
        else:
            outcome = CommandOutcome.model_validate_json(r["body"])
            locked.outcomes[(outcome.key, outcome.command_id)] = outcome
    return locked


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


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    partition: int  # the input partition it came from: the publish cursor is per partition
    topic: str
    key: bytes | None
    value: bytes


@dataclass(frozen=True, slots=True)
class BatchWrite:
    sandboxes: Sequence[tuple[int, Sandbox]]  # (input partition, row)
    history: Sequence[HistoryRow]
    outcomes: Sequence[CommandOutcome]
    outbox: Sequence[OutboxRecord]
    next_offsets: Mapping[TopicPartitionKey, int]


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Row tuples as one list per column, for ``unnest`` (one round trip for any row count)."""
    return [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]


# The whole batch is one statement (one round trip whatever its size): data-modifying CTEs, one
# per table, each inserting from unnest() of column arrays. Multi-valued columns (provider names,
# event types: neither can contain a comma) travel comma-joined, because unnest() cannot take
# ragged 2-D arrays. Offsets only move forward, and the NOTIFY
# (delivered at commit) wakes outcome waiters and watchers.
_WRITE_BATCH = f"""
WITH upserted AS (
    INSERT INTO sandboxes ({SANDBOX_COLUMNS}, partition, change_seq)
    SELECT k, i, ph, g, v, sp, string_to_array(pr, ','), id, ec, r, ca, ua, pa,
           nextval('sandbox_changes')
    FROM unnest($1::text[], $2::uuid[], $3::text[], $4::int[], $5::bigint[], $6::jsonb[],
                $7::text[], $8::text[], $9::int[], $10::text[], $11::timestamptz[],
                $12::timestamptz[], $13::int[])
         AS u(k, i, ph, g, v, sp, pr, id, ec, r, ca, ua, pa)
    ON CONFLICT (key) DO UPDATE SET sandbox_id = EXCLUDED.sandbox_id, phase = EXCLUDED.phase,
        generation = EXCLUDED.generation, version = EXCLUDED.version, spec = EXCLUDED.spec,
        providers = EXCLUDED.providers, identity = EXCLUDED.identity,
        exit_code = EXCLUDED.exit_code, reason = EXCLUDED.reason,
        created_at = EXCLUDED.created_at, updated_at = EXCLUDED.updated_at,
        partition = EXCLUDED.partition, change_seq = EXCLUDED.change_seq
    RETURNING 1
), recorded AS (
    INSERT INTO history (key, topic, partition, "offset", message_type, command_id,
                         disposition, reason, phase, generation, version, event_types, message,
                         occurred_at)
    SELECT k, t, p, o, mt, c, d, r, ph, g, v, string_to_array(e, ','), m, oa
    FROM unnest($14::text[], $15::text[], $16::int[], $17::bigint[], $18::text[], $19::text[],
                $20::text[], $21::text[], $22::text[], $23::int[], $24::bigint[], $25::text[],
                $26::json[], $27::timestamptz[])
         AS u(k, t, p, o, mt, c, d, r, ph, g, v, e, m, oa)
    RETURNING 1
), decided AS (
    INSERT INTO command_outcomes (command_id, key, command_type, status, code, message, outcome)
    SELECT * FROM unnest($28::text[], $29::text[], $30::text[], $31::text[], $32::text[],
                         $33::text[], $34::jsonb[])
    ON CONFLICT DO NOTHING
    RETURNING 1
), queued AS (
    INSERT INTO outbox (partition, topic, key, value)
    SELECT p, t, k, v FROM unnest($35::int[], $36::text[], $37::bytea[], $38::bytea[])
         WITH ORDINALITY AS u(p, t, k, v, n) ORDER BY n
    RETURNING id
), moved AS (
    UPDATE input_offsets o SET next_offset = u.n, updated_at = now()
    FROM unnest($39::text[], $40::int[], $41::bigint[]) AS u(t, p, n)
    WHERE o.topic = u.t AND o.partition = u.p AND o.next_offset <= u.n
    RETURNING 1
)
SELECT ARRAY(SELECT id FROM queued ORDER BY id) AS ids, pg_notify($42, '') AS notified,
       (SELECT count(*) FROM upserted) + (SELECT count(*) FROM recorded)
       + (SELECT count(*) FROM decided) + (SELECT count(*) FROM moved) AS written
"""


async def write_batch(conn: Connection, batch: BatchWrite) -> list[int]:
    """Write a decided batch in one statement; the caller holds the offset locks and the
    transaction. Returns the outbox ids, in order."""
    sandboxes = [
        (s.key, s.sandbox_id, s.phase.value, s.generation, s.version, s.spec.model_dump_json(),
         ",".join(s.providers), s.identity, s.exit_code, s.reason, s.created_at,
         s.updated_at, partition)
        for partition, s in batch.sandboxes
    ]  # fmt: skip
    history = [
        (h.key, h.topic, h.partition, h.offset, h.message_type, h.command_id, h.disposition,
         h.reason, h.phase, h.generation, h.version, ",".join(h.event_types), h.message,
         h.occurred_at)
        for h in batch.history
    ]  # fmt: skip
    outcomes = [
        (o.command_id, o.key, o.command_type, o.status, o.code.value, o.message,
         o.model_dump_json())
        for o in batch.outcomes
    ]  # fmt: skip
    outbox = [(o.partition, o.topic, o.key, o.value) for o in batch.outbox]
    offsets = [(t, p, n) for (t, p), n in sorted(batch.next_offsets.items())]
    ids = await conn.fetchval(
        _WRITE_BATCH,
        *_columns(sandboxes, 13),
        *_columns(history, 14),
        *_columns(outcomes, 7),
        *_columns(outbox, 4),
        *_columns(offsets, 3),
        CHANGES_CHANNEL,
    )
    return list(ids)


async def unpublished_outbox(conn: Connection, partition: int) -> list[tuple[int, OutboxRecord]]:
    rows = await conn.fetch(
        "SELECT o.id, o.topic, o.key, o.value FROM outbox o "
        "LEFT JOIN outbox_cursor c ON c.partition = o.partition "
        "WHERE o.partition = $1 AND o.id > coalesce(c.published_id, 0) ORDER BY o.id",
        partition,
    )
    return [(r["id"], OutboxRecord(partition, r["topic"], r["key"], r["value"])) for r in rows]


async def mark_published(conn: Connection, up_to: Mapping[int, int]) -> None:
    """Move the publish cursors forward: ``up_to`` maps input partition to outbox id."""
    items = sorted(up_to.items())
    await conn.execute(
        "INSERT INTO outbox_cursor (partition, published_id) "
        "SELECT * FROM unnest($1::int[], $2::bigint[]) "
        "ON CONFLICT (partition) DO UPDATE SET published_id = "
        "GREATEST(outbox_cursor.published_id, EXCLUDED.published_id)",
        [p for p, _ in items],
        [i for _, i in items],
    )
