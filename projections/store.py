"""The PostgreSQL side of the projection: read rows and outcomes, write one batch atomically."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Final, TypeAlias
from uuid import UUID

import asyncpg
import orjson
from pydantic import TypeAdapter

from events.codec import encode
from events.common import Deadline, Hold, Phase, Restarts, SandboxSpec, TemplateRef
from events.outcomes import CommandOutcome
from events.topics import CHANGES_CHANNEL, POOLS_CHANNEL
from projections.chain import CHAIN_LINKS, ChainId
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
    # "cannot switch to state N; another operation is in progress": the server's goodbye
    # ("terminating connection") reached an idle connection before its close did, and the
    # next query on it fails so. Seen in PostgreSQL restarts; the connection is dead.
    asyncpg.exceptions.InternalClientError,
)
# Any trouble with PostgreSQL: a lost connection, or an error the server answered with.
DATABASE_ERRORS: tuple[type[Exception], ...] = (asyncpg.PostgresError, *CONNECTION_ERRORS)


SANDBOX_COLUMNS = (
    "key, sandbox_id, phase, generation, version, spec, providers, identity, exit_code, reason, "
    "created_at, updated_at, deadline, expires_at, on_expiry, on_exit, hold, awaited, restarts, "
    "template, pool, adopted_as, claim_id, bound_to, claim_providers, adopted_generation, "
    "exited_at"
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
        deadline=_json_model(Deadline, r["deadline"]),
        expires_at=_timestamp(r["expires_at"]) if r["expires_at"] is not None else None,
        on_expiry=r["on_expiry"],
        on_exit=r["on_exit"],
        hold=_json_model(Hold, r["hold"]),
        awaited=_json_dict(r["awaited"]),
        restarts=_json_model(Restarts, r["restarts"]),
        template=_json_model(TemplateRef, r["template"]),
        pool=r["pool"],
        adopted_as=r["adopted_as"],
        claim_id=r["claim_id"],
        bound_to=r["bound_to"],
        claim_providers=tuple(r["claim_providers"] or ()),
        adopted_generation=r["adopted_generation"],
        exited_at=_timestamp(r["exited_at"]) if r["exited_at"] is not None else None,
    )


def _json_model(model: Any, value: Any) -> Any:
    """A jsonb column (text from asyncpg, an object inside json_build_object), or None."""
    if value is None:
        return None
    return (
        model.model_validate_json(value) if isinstance(value, str) else model.model_validate(value)
    )


def _json_dict(value: Any) -> dict[str, int]:
    """A jsonb object column (text from asyncpg, an object inside json_build_object)."""
    return dict(json.loads(value) if isinstance(value, str) else value)


def _timestamp(value: datetime | str) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)


TopicPartitionKey = tuple[str, int]


# The batch's offsets, rows and known outcomes in one round trip and one snapshot. Nothing is
# locked: every writer commits rows and offsets together, so what this returns is consistent,
# and the write (below) only succeeds if none of these offsets moved since.
#
# Rows, outcomes and chain heads are each one index probe per key (LATERAL ... LIMIT 1): the
# processor runs this as a generic plan, made once per connection, often on small or empty
# tables (a new installation, a benchmark), and kept as they grow. Joined with the key arrays
# instead, that plan scanned sandboxes and command_outcomes whole at every read.
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
    'updated_at', updated_at, 'deadline', deadline, 'expires_at', expires_at,
    'on_expiry', on_expiry, 'on_exit', on_exit, 'hold', hold, 'awaited', awaited,
    'restarts', restarts, 'template', template, 'pool', pool, 'adopted_as', adopted_as,
    'claim_id', claim_id, 'bound_to', bound_to, 'claim_providers', claim_providers,
    'adopted_generation', adopted_generation, 'exited_at', exited_at)
FROM unnest($3::text[]) AS k, LATERAL (SELECT * FROM sandboxes WHERE key = k LIMIT 1) AS s
UNION ALL
SELECT 'outcome', NULL, NULL, NULL, o.outcome::json
FROM unnest($4::text[], $5::text[]) AS u(k, c),
     LATERAL (SELECT outcome FROM command_outcomes WHERE key = u.k AND command_id = u.c
              LIMIT 1) AS o
UNION ALL
SELECT 'head', k, NULL, NULL, json_build_object('hash', encode(h.entry_hash, 'hex'))
FROM unnest($6::text[]) AS k,
     LATERAL (SELECT entry_hash FROM history WHERE key = k ORDER BY id DESC LIMIT 1) AS h
UNION ALL
SELECT 'head', NULL, p, NULL, json_build_object('hash', encode(h.entry_hash, 'hex'))
FROM unnest($7::int[]) AS p,
     LATERAL (SELECT entry_hash FROM history WHERE key IS NULL AND partition = p
              ORDER BY id DESC LIMIT 1) AS h
"""


@dataclass(frozen=True, slots=True)
class BatchRead:
    offsets: dict[TopicPartitionKey, int]  # next offset per (topic, partition); 0 if none yet
    sandboxes: dict[str, Sandbox]
    outcomes: dict[tuple[str, str], CommandOutcome]  # by (sandbox key, command id)
    # The newest entry hash of each history chain asked for (absent: an empty chain).
    chain_heads: dict[ChainId, bytes | None]


async def read_batch(
    conn: Connection,
    partitions: Iterable[TopicPartitionKey],
    keys: Iterable[str],
    idents: Iterable[tuple[str, str]],
    chains: Iterable[ChainId] = (),
) -> BatchRead:
    """The offsets of ``partitions`` and the rows, outcomes and history chain heads a batch
    needs, as of one moment."""
    pairs = sorted(set(partitions))
    wanted = list(idents)
    chain_ids = set(chains)
    records = await conn.fetch(
        _READ_BATCH,
        [t for t, _ in pairs],
        [p for _, p in pairs],
        list(keys),
        [k for k, _ in wanted],
        [c for _, c in wanted],
        sorted(k for k, _ in chain_ids if k is not None),
        sorted(p for k, p in chain_ids if k is None and p is not None),
    )
    read = BatchRead({}, {}, {}, {})
    for r in records:
        if r["kind"] == "offset":
            read.offsets[(r["topic"], r["partition"])] = r["next_offset"]
        elif r["kind"] == "head":
            head = json.loads(r["body"])["hash"]
            chain = (r["topic"], None) if r["topic"] is not None else (None, r["partition"])
            read.chain_heads[chain] = bytes.fromhex(head) if head is not None else None
        elif r["kind"] == "row":
            sandbox = sandbox_from_record(json.loads(r["body"]))
            read.sandboxes[sandbox.key] = sandbox
        else:
            outcome = CommandOutcome.model_validate_json(r["body"])
            read.outcomes[(outcome.key, outcome.command_id)] = outcome
    return read


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
    sandbox_id: UUID | None = None  # the incarnation of the row after it
    # The hash chain (projections/chain.py): set by chain_rows just before the write.
    prev_hash: bytes | None = None
    entry_hash: bytes | None = None


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
    # Compare-and-set of the rows: the stored version each written row was decided from, by
    # key (absent: no stored row). A row not at that version aborts the write.
    decided_from: Mapping[str, int] = field(default_factory=dict)


class RowVersionMoved(Exception):
    """A sandbox row was not at the version the batch was decided from: written meanwhile by
    a writer of another partition, which the one-partition-per-sandbox rule forbids. Nothing of
    the batch was written."""


# The SQLSTATE rows_fence() raises (compose/migrations/0004_input_edges.sql).
ROW_VERSION_MOVED = "SSV01"


class OffsetsMoved(Exception):
    """Another writer committed offsets of the batch's partitions after they were read: the
    batch was decided on stale rows and nothing of it was written."""


class ChainMoved(Exception):
    """Another writer linked an entry onto a chain head the batch was decided on (a dead
    letter's entry joins its key's chain from another partition): the database refuses a
    second link to one entry (migration 0135), and nothing of the batch was written."""


HISTORY_COLUMNS: Final = (
    "key", "topic", "partition", "offset", "message_type", "command_id", "disposition", "reason",
    "phase", "generation", "version", "event_types", "message", "occurred_at", "sandbox_id",
    "prev_hash", "entry_hash",
)  # fmt: skip
OUTBOX_COLUMNS: Final = ("id", "partition", "topic", "key", "value")


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Row tuples as one list per column, for ``unnest`` (one round trip for any row count)."""
    return [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]


# A small batch is one statement, so one round trip and one implicit transaction: data-modifying
# CTEs, one per table. A large one moves its history and outbox rows by binary COPY instead
# (see write_batch).
#
# Sandbox and history rows travel as one JSON array of arrays each (_json), read by
# position on the server; outcomes as a JSON array of the outcome documents, whose fields the
# server reads out. asyncpg checks every element of an array parameter against
# collections.abc in Python before it encodes it, which cost the processor more CPU than the
# rest of the write; orjson writes a table in one C call, and reading it by position costs the
# server no more than decoding the arrays did (docs/benchmarks.md). A bytea travels as a
# "\x..." hex string, a history message as a JSON string cast back to json (its text kept).
# The outbox keeps bytea arrays: its values are large, and hex in JSON costs the server more
# than the arrays cost the client. Multi-valued columns (provider names, event types: neither
# can contain a comma) travel comma-joined, as they always have.
#
# `moved` runs first (every other CTE waits for `fence`): it moves each offset only if it still
# is the value the batch was read at, and its owner epoch the one the writer's assignment raised
# ($15, aligned with the offsets; empty or NULL: not checked), taking the offset row locks, so
# writers of one partition are serialized. A writer that lost a race (or a zombie after a
# rebalance) moves fewer rows than it expected and offsets_fence() aborts the whole statement:
# nothing is written. Offsets only move forward (never below what was read). The NOTIFY
# (delivered at commit) wakes outcome waiters and watchers.
_WRITE_BATCH = f"""
WITH moved AS (
    INSERT INTO input_offsets AS o (topic, partition, next_offset, owner_epoch)
    SELECT t, p, n, coalesce(ep, 0)
    FROM unnest($1::text[], $2::int[], $3::bigint[], $4::bigint[], $15::bigint[])
         AS u(t, p, e, n, ep) ORDER BY t, p
    ON CONFLICT (topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset,
        updated_at = now()
    WHERE (o.next_offset, o.owner_epoch) = (
        SELECT e, coalesce(ep, o.owner_epoch)
        FROM unnest($1::text[], $2::int[], $3::bigint[], $15::bigint[]) AS x(t, p, e, ep)
        WHERE x.t = o.topic AND x.p = o.partition)
    RETURNING 1
), fence AS (
    SELECT offsets_fence((SELECT count(*) FROM moved), cardinality($1::text[])) AS ok
), decided_rows AS (
    -- The positions _sandbox_positions writes; base: the stored version it was decided from.
    SELECT r->>0 AS key, (r->>1)::uuid AS sandbox_id, r->>2 AS phase,
           (r->>3)::int AS generation, (r->>4)::bigint AS version,
           string_to_array(r->>5, ',') AS providers, r->>6 AS identity,
           (r->>7)::int AS exit_code, r->>8 AS reason, (r->>9)::timestamptz AS created_at,
           (r->>10)::timestamptz AS updated_at, (r->>11)::int AS partition,
           (r->>12)::timestamptz AS expires_at, r->>13 AS on_expiry, r->>14 AS on_exit,
           (r->>15)::bigint AS base, r->16 AS spec, nullif(r->17, 'null') AS deadline,
           nullif(r->18, 'null') AS hold, r->19 AS awaited,
           nullif(r->20, 'null') AS restarts, nullif(r->21, 'null') AS template,
           r->>22 AS pool, r->>23 AS adopted_as, r->>24 AS claim_id, r->>25 AS bound_to,
           string_to_array(r->>26, ',') AS claim_providers, (r->>27)::int AS adopted_generation,
           (r->>28)::timestamptz AS exited_at
    FROM jsonb_array_elements($5::jsonb) AS r
    WHERE (SELECT ok FROM fence)
), inserted AS (
    -- New rows (decided from no stored row): one that exists by now is not overwritten.
    INSERT INTO sandboxes ({SANDBOX_COLUMNS}, partition, change_seq, deadline_at)
    SELECT {SANDBOX_COLUMNS}, partition, nextval('sandbox_changes'),
           (deadline->>'due_at')::timestamptz
    FROM decided_rows WHERE base IS NULL
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
), updated AS (
    -- Stored rows, only at the version they were decided from (re-checked after a row lock).
    UPDATE sandboxes s SET sandbox_id = u.sandbox_id, phase = u.phase,
        generation = u.generation, version = u.version, spec = u.spec,
        providers = u.providers, identity = u.identity, exit_code = u.exit_code,
        reason = u.reason, created_at = u.created_at, updated_at = u.updated_at,
        partition = u.partition, change_seq = nextval('sandbox_changes'),
        deadline = u.deadline, deadline_at = (u.deadline->>'due_at')::timestamptz,
        expires_at = u.expires_at, on_expiry = u.on_expiry, on_exit = u.on_exit,
        hold = u.hold, awaited = u.awaited, restarts = u.restarts, template = u.template,
        pool = u.pool, adopted_as = u.adopted_as, claim_id = u.claim_id, bound_to = u.bound_to,
        claim_providers = u.claim_providers, adopted_generation = u.adopted_generation,
        exited_at = u.exited_at
    FROM decided_rows u
    WHERE u.base IS NOT NULL AND s.key = u.key AND s.version = u.base
    RETURNING 1
), recorded AS (
    -- The positions _history_positions writes.
    INSERT INTO history (key, topic, partition, "offset", message_type, command_id,
                         disposition, reason, phase, generation, version, event_types,
                         occurred_at, sandbox_id, prev_hash, entry_hash, message)
    SELECT r->>0, r->>1, (r->>2)::int, (r->>3)::bigint, r->>4, r->>5, r->>6, r->>7, r->>8,
           (r->>9)::int, (r->>10)::bigint, string_to_array(r->>11, ','),
           (r->>12)::timestamptz, (r->>13)::uuid, (r->>14)::bytea, (r->>15)::bytea,
           (r->>16)::json
    FROM jsonb_array_elements($6::jsonb) AS r
    WHERE (SELECT ok FROM fence)
), decided AS (
    INSERT INTO command_outcomes (command_id, key, command_type, status, code, message, outcome)
    SELECT o->>'command_id', o->>'key', o->>'command_type', o->>'status', o->>'code',
           o->>'message', o
    FROM jsonb_array_elements($7::jsonb) AS o
    WHERE (SELECT ok FROM fence)
    ON CONFLICT DO NOTHING
), queued AS (
    INSERT INTO outbox (partition, topic, key, value)
    SELECT p, t, k, v FROM unnest($8::int[], $9::text[], $10::bytea[], $11::bytea[])
         WITH ORDINALITY AS u(p, t, k, v, n)
    WHERE (SELECT ok FROM fence)
    ORDER BY n
    RETURNING id
), reserved AS (
    -- Ids for outbox records the caller copies in after this statement, in the same
    -- transaction (taken under the offset locks, so they too grow in commit order).
    SELECT nextval('outbox_id_seq') AS id FROM generate_series(1, $12::int)
    WHERE (SELECT ok FROM fence)
)
SELECT ARRAY(SELECT id FROM queued ORDER BY id) || ARRAY(SELECT id FROM reserved ORDER BY id)
       AS ids, pg_notify(notify_channel($13), ''),
       CASE WHEN $14::text IS NOT NULL THEN pg_notify(notify_channel($14), '') END,
       rows_fence((SELECT count(*) FROM inserted) + (SELECT count(*) FROM updated),
                  jsonb_array_length($5::jsonb))
"""


# The session of a connection that reads and writes batches (the processor's own). Its
# statements are planned once, not at every poll: one plan serves every batch size, and a small
# poll's PostgreSQL CPU fell by 15-25 % without the planning (docs/benchmarks.md). That generic
# plan is made at the connection's first batch, often on small or empty tables (a new
# installation, a benchmark), and kept as they grow: joined by hash, the row update's plan made
# then scanned sandboxes whole at every write. Every table these statements touch is looked up
# by key, so they are joined by nested loops only: an index probe per key, whatever the size.
BATCH_SESSION: Final = (
    "SET plan_cache_mode = force_generic_plan; SET enable_hashjoin = off; "
    "SET enable_mergejoin = off"
)


# Above this many history and outbox rows a batch copies them in (binary COPY, PostgreSQL's
# bulk insert path: about half the server's cost of inserting them from arrays; the history
# from the statement's JSON instead saved the client less than it cost the server) in a
# transaction around the statement. Smaller batches, such as a processor catching up with a
# steady rate of commands writes, keep the single round trip: the transaction and the COPYs
# add six, which lengthened the latency tail in paired runs.
COPY_ABOVE: Final = 500


async def write_batch(
    conn: Connection,
    batch: BatchWrite,
    copy_above: int = COPY_ABOVE,
    epochs: Mapping[TopicPartitionKey, int] | None = None,
) -> list[int]:
    """Write a decided batch atomically; returns the outbox ids in order.

    Raises OffsetsMoved (and writes nothing) if the offsets are no longer those it was read at,
    or (``epochs``: per partition, the epoch the writer's assignment raised, ``claim_partitions``)
    another assignment raised a partition's epoch since; ChainMoved if a chain head it links
    onto is no longer its chain's head.
    """
    try:
        if len(batch.history) + len(batch.outbox) <= copy_above:
            return await _write_statement(conn, batch, inline=True, epochs=epochs)
        async with conn.transaction():
            # The statement first: it moves the offsets by compare-and-set (taking their
            # locks) before anything is copied, so a fenced writer copies nothing.
            ids = await _write_statement(conn, batch, inline=False, epochs=epochs)
            await conn.copy_records_to_table(
                "history", records=_history_tuples(batch.history), columns=HISTORY_COLUMNS
            )
            outbox = zip(ids, batch.outbox, strict=True)
            await conn.copy_records_to_table(
                "outbox",
                records=[(i, o.partition, o.topic, o.key, o.value) for i, o in outbox],
                columns=OUTBOX_COLUMNS,
            )
            return ids
    except (asyncpg.SerializationError, asyncpg.DeadlockDetectedError) as exc:
        # Two writers of one partition can also deadlock on its offset rows: the same race.
        raise OffsetsMoved(str(exc)) from exc
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name in CHAIN_LINKS:
            raise ChainMoved(str(exc)) from exc
        raise
    except asyncpg.PostgresError as exc:
        if exc.sqlstate == ROW_VERSION_MOVED:
            raise RowVersionMoved(str(exc)) from exc
        raise


# A history row's HISTORY_COLUMNS as one tuple (read in C).
_history_tuple = attrgetter(*HISTORY_COLUMNS)


def _history_tuples(history: Sequence[HistoryRow]) -> list[tuple[Any, ...]]:
    return list(map(_history_tuple, history))


_OUTCOMES: Final = TypeAdapter(list[CommandOutcome])


async def _write_statement(
    conn: Connection,
    batch: BatchWrite,
    *,
    inline: bool,
    epochs: Mapping[TopicPartitionKey, int] | None = None,
) -> list[int]:
    """The batch's statement; with ``inline`` false, its history and outbox are left out and
    as many outbox ids as it has records are reserved for the caller to copy them in with."""
    offsets = [(t, p, e, n) for (t, p), (e, n) in sorted(batch.offsets.items())]
    owned = [epochs.get((t, p)) for t, p, _, _ in offsets] if epochs else []
    bases = batch.decided_from
    outbox = [(o.partition, o.topic, o.key, o.value) for o in batch.outbox] if inline else []
    ids = await conn.fetchval(
        _WRITE_BATCH,
        *_columns(offsets, 4),
        _json([_sandbox_positions(p, s, bases.get(s.key)) for p, s in batch.sandboxes]),
        _json([_history_positions(h) for h in batch.history] if inline else []),
        _OUTCOMES.dump_json(list(batch.outcomes)).decode(),  # one pydantic call for all
        *_columns(outbox, 4),
        0 if inline else len(batch.outbox),  # outbox ids to reserve
        CHANGES_CHANNEL,
        POOLS_CHANNEL if any(s.pool is not None for _, s in batch.sandboxes) else None,
        owned,
    )
    return list(ids)


def _sandbox_positions(partition: int, s: Sandbox, base: int | None) -> tuple[Any, ...]:
    """A row as the positions _WRITE_BATCH's decided_rows reads."""
    return (
        s.key, s.sandbox_id, s.phase.value, s.generation, s.version, ",".join(s.providers),
        s.identity, s.exit_code, s.reason, s.created_at, s.updated_at, partition, s.expires_at,
        s.on_expiry, s.on_exit, base, orjson.Fragment(encode(s.spec)),
        orjson.Fragment(encode(s.deadline)) if s.deadline else None,
        orjson.Fragment(encode(s.hold)) if s.hold else None, s.awaited,
        orjson.Fragment(encode(s.restarts)) if s.restarts else None,
        orjson.Fragment(encode(s.template)) if s.template else None,
        s.pool, s.adopted_as, s.claim_id, s.bound_to, ",".join(s.claim_providers),
        s.adopted_generation, s.exited_at,
    )  # fmt: skip


def _history_positions(h: HistoryRow) -> tuple[Any, ...]:
    """A history row as the positions _WRITE_BATCH's recorded reads."""
    return (
        h.key, h.topic, h.partition, h.offset, h.message_type, h.command_id, h.disposition,
        h.reason, h.phase, h.generation, h.version, ",".join(h.event_types), h.occurred_at,
        h.sandbox_id, h.prev_hash, h.entry_hash, h.message,
    )  # fmt: skip


def _json(rows: list[Any]) -> str:
    """The JSON text of a json parameter. orjson writes UUIDs and aware datetimes (RFC 3339,
    with their offset: the same instant back) itself; the rest goes through _to_json."""
    return orjson.dumps(rows, default=_to_json).decode()


def _to_json(value: Any) -> str:
    if isinstance(value, bytes):
        return "\\x" + value.hex()  # PostgreSQL's hex form of a bytea
    if isinstance(value, UUID):  # asyncpg's own UUID type (rows read back), not uuid.UUID
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# The cursor as a bound of the index scan: a join would read the partition's whole outbox,
# published or not, and the outbox is kept after publishing.
