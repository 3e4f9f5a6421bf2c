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


# A lost or refused PostgreSQL connection (as opposed to a bad statement): the server went away,
# restarts, or ended the session. Callers wait and retry, or answer "unavailable".
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    OSError,  # refused, reset, timed out
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,  # the connection is closed (or was released when it closed)
    asyncpg.exceptions.OperatorInterventionError,  # shutdown, starting up, terminated
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


TopicPartitionKey = tuple[str, int]


# The batch's offsets, rows and known outcomes in one round trip and one snapshot. Nothing is
# locked: every writer commits rows and offsets together, so what this returns is consistent,
# and the write (below) only succeeds if none of these offsets moved since.
_READ_BATCH = """
SELECT 'offset' AS kind, u.t AS topic, u.p AS partition, coalesce(o.next_offset, 0) AS next_offset,
       NULL::json AS body
FROM unnest($1::text[], $2::int[]) AS u(t, p)
LEFT JOIN input_offsets o ON o.topic = u.t AND o.partition = u.p
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
class BatchRead:
    offsets: dict[TopicPartitionKey, int]  # next offset per (topic, partition); 0 if none yet
    sandboxes: dict[str, Sandbox]
    outcomes: dict[tuple[str, str], CommandOutcome]  # by (sandbox key, command id)


async def read_batch(
    conn: Connection,
    partitions: Iterable[TopicPartitionKey],
    keys: Iterable[str],
    idents: Iterable[tuple[str, str]],
) -> BatchRead:
    """The offsets of ``partitions`` and the rows and outcomes a batch needs, as of one moment."""
    pairs = sorted(set(partitions))
    wanted = list(idents)
    records = await conn.fetch(
        _READ_BATCH,
        [t for t, _ in pairs],
        [p for _, p in pairs],
        list(keys),
        [k for k, _ in wanted],
        [c for _, c in wanted],
    )
    read = BatchRead({}, {}, {})
    for r in records:
        if r["kind"] == "offset":
            read.offsets[(r["topic"], r["partition"])] = r["next_offset"]
        elif r["kind"] == "row":
            sandbox = sandbox_from_record(json.loads(r["body"]))
            read.sandboxes[sandbox.key] = sandbox
        else:
            outcome = CommandOutcome.model_validate_json(r["body"])
            read.outcomes[(outcome.key, outcome.command_id)] = outcome
    return read


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
    # Compare-and-set of the input offsets: every (topic, partition) the batch was decided on,
    # from the offset it was read at to its new one (unchanged where no record of it was new).
    offsets: Mapping[TopicPartitionKey, tuple[int, int]]


class OffsetsMoved(Exception):
    """Another writer committed offsets of the batch's partitions after they were read: the
    batch was decided on stale rows and nothing of it was written."""


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Row tuples as one list per column, for ``unnest`` (one round trip for any row count)."""
    return [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]


# The whole batch is one statement, so one round trip and one implicit transaction whatever its
# size: data-modifying CTEs, one per table, each inserting from unnest() of column arrays.
# Multi-valued columns (provider names, event types: neither can contain a comma) travel
# comma-joined, because unnest() cannot take ragged 2-D arrays.
#
# `moved` runs first (every other CTE waits for `fence`): it moves each offset only if it still
# is the value the batch was read at, taking the offset row locks, so writers of one partition
# are serialized. A writer that lost a race (or a zombie after a rebalance) moves fewer rows
# than it expected and offsets_fence() aborts the whole statement: nothing is written. Offsets
# only move forward (never below what was read). The NOTIFY (delivered at commit) wakes
# outcome waiters and watchers.
_WRITE_BATCH = f"""
WITH moved AS (
    INSERT INTO input_offsets AS o (topic, partition, next_offset)
    SELECT t, p, n FROM unnest($1::text[], $2::int[], $3::bigint[], $4::bigint[])
         AS u(t, p, e, n) ORDER BY t, p
    ON CONFLICT (topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset,
        updated_at = now()
    WHERE o.next_offset = (SELECT e FROM unnest($1::text[], $2::int[], $3::bigint[]) AS x(t, p, e)
                           WHERE x.t = o.topic AND x.p = o.partition)
    RETURNING 1
), fence AS (
    SELECT offsets_fence((SELECT count(*) FROM moved), cardinality($1::text[])) AS ok
), upserted AS (
    INSERT INTO sandboxes ({SANDBOX_COLUMNS}, partition, change_seq)
    SELECT k, i, ph, g, v, sp, string_to_array(pr, ','), id, ec, r, ca, ua, pa,
           nextval('sandbox_changes')
    FROM unnest($5::text[], $6::uuid[], $7::text[], $8::int[], $9::bigint[], $10::jsonb[],
                $11::text[], $12::text[], $13::int[], $14::text[], $15::timestamptz[],
                $16::timestamptz[], $17::int[])
         AS u(k, i, ph, g, v, sp, pr, id, ec, r, ca, ua, pa)
    WHERE (SELECT ok FROM fence)
    ON CONFLICT (key) DO UPDATE SET sandbox_id = EXCLUDED.sandbox_id, phase = EXCLUDED.phase,
        generation = EXCLUDED.generation, version = EXCLUDED.version, spec = EXCLUDED.spec,
        providers = EXCLUDED.providers, identity = EXCLUDED.identity,
        exit_code = EXCLUDED.exit_code, reason = EXCLUDED.reason,
        created_at = EXCLUDED.created_at, updated_at = EXCLUDED.updated_at,
        partition = EXCLUDED.partition, change_seq = EXCLUDED.change_seq
), recorded AS (
    INSERT INTO history (key, topic, partition, "offset", message_type, command_id,
                         disposition, reason, phase, generation, version, event_types, message,
                         occurred_at)
    SELECT k, t, p, o, mt, c, d, r, ph, g, v, string_to_array(e, ','), m, oa
    FROM unnest($18::text[], $19::text[], $20::int[], $21::bigint[], $22::text[], $23::text[],
                $24::text[], $25::text[], $26::text[], $27::int[], $28::bigint[], $29::text[],
                $30::json[], $31::timestamptz[])
         AS u(k, t, p, o, mt, c, d, r, ph, g, v, e, m, oa)
    WHERE (SELECT ok FROM fence)
), decided AS (
    INSERT INTO command_outcomes (command_id, key, command_type, status, code, message, outcome)
    SELECT * FROM unnest($32::text[], $33::text[], $34::text[], $35::text[], $36::text[],
                         $37::text[], $38::jsonb[])
    WHERE (SELECT ok FROM fence)
    ON CONFLICT DO NOTHING
), queued AS (
    INSERT INTO outbox (partition, topic, key, value)
    SELECT p, t, k, v FROM unnest($39::int[], $40::text[], $41::bytea[], $42::bytea[])
         WITH ORDINALITY AS u(p, t, k, v, n)
    WHERE (SELECT ok FROM fence)
    ORDER BY n
    RETURNING id
)
SELECT ARRAY(SELECT id FROM queued ORDER BY id) AS ids, pg_notify($43, '')
"""


async def write_batch(conn: Connection, batch: BatchWrite) -> list[int]:
    """Write a decided batch atomically, in one statement; returns the outbox ids in order.

    Raises OffsetsMoved (and writes nothing) if the offsets are no longer those it was read at.
    """
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
    offsets = [(t, p, e, n) for (t, p), (e, n) in sorted(batch.offsets.items())]
    try:
        ids = await conn.fetchval(
            _WRITE_BATCH,
            *_columns(offsets, 4),
            *_columns(sandboxes, 13),
            *_columns(history, 14),
            *_columns(outcomes, 7),
            *_columns(outbox, 4),
            CHANGES_CHANNEL,
        )
    except (asyncpg.SerializationError, asyncpg.DeadlockDetectedError) as exc:
        # Two writers of one partition can also deadlock on its offset rows: the same race.
        raise OffsetsMoved(str(exc)) from exc
    return list(ids)


async def unpublished_outbox(conn: Connection, partition: int) -> list[tuple[int, OutboxRecord]]:
    rows = await conn.fetch(
        "SELECT o.id, o.topic, o.key, o.value FROM outbox o "
        "LEFT JOIN outbox_cursor c ON c.partition = o.partition "
        "WHERE o.partition = $1 AND o.id > coalesce(c.published_id, 0) ORDER BY o.id",
        partition,
    )
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
    SELECT cur.p, min(o.id) AS first_missing
    FROM cur JOIN outbox o ON o.partition = cur.p AND o.id > cur.at
    WHERE NOT EXISTS (SELECT 1 FROM acked a WHERE a.p = o.partition AND a.id = o.id)
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
