"""The same-work ceiling: the processor's output for the benchmark's log, with the least Python.

Written for the benchmark, never used by the product. It consumes the same input topics as the
processor (every partition assigned, no group, the processor's fetch sizes), validates every
record as the processor's intake does (the same strict pydantic-core validators, the key and
partition checks), reads per poll what the processor reads (``read_batch``: the stored offsets,
the rows it does not keep, the outcomes of the poll's commands, the chain heads) and decides on
it (fencing, de-duplication, chains continued from their stored heads), and per poll writes,
with the processor's own statement and COPY (projections/store.py), the same rows, history
entries linked onto their hash chains, command outcomes and outbox records — byte for byte
what the processor writes for the same decisions (tests/test_bench_same_work.py compares every
table) — then publishes the outbox and moves the publish cursors as the processor does. It
overlaps as the processor does: a poll's write in flight while the next poll is fetched, read
and decided; acknowledgements awaited and cursors moved off that path. This module decides and
writes; the read, the drain and its measurement are services/bench/same_work_drain.py.

Where it saves is the common path of the benchmark's log: a create, a running snapshot, a stop
and an exited snapshot of a plain sandbox (no providers, time to live, hold or other policy),
and a snapshot of no sandbox yet or with no effect in the sandbox's phase (a poll often holds
one topic of a partition without the other, and the processor ignores those too),
each decided in a few lines from the ceiling's own row state and written out as JSON directly,
instead of through the lifecycle tables, models and dataclasses. Anything else (a snapshot
fetched before its create, a duplicate, a rejection, another command) goes through the
product's own ``fold`` (projections/), as the processor decides it, and that sandbox stays on
that path until its row is plain again. It keeps in memory the rows the processor's row cache
keeps (as many, let go in the same order, and read back when next needed), and has no
ownership, rebalance, dead-letter or retry machinery: a record that fails validation, or
offsets another writer moved, stop it (``Unsupported``).

Coupling, kept here: the write statement, the positions it reads a product row at and its COPY
columns (``projections.store``, two of them private names), the chain's canonical content
(``projections.chain``), the name-based ids, the deadlines, the observation table and ``fold``
(``projections.lifecycle``); of services/processor only its pure checkpoint function and its
slice size. The common path's reasons and
event layouts are written out below; the equality test fails when the lifecycle rules change
them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeAlias
from uuid import UUID

import asyncpg
import orjson
from aiokafka import ConsumerRecord
from pydantic import TypeAdapter

from events.codec import COMMANDS, OBSERVATIONS, DecodeError, decode, encode
from events.common import Cause, Deadline, Phase, SandboxSpec
from events.outcomes import CommandOutcome
from events.topics import CHANGES_CHANNEL, partition_for
from events.trusted import builder
from projections.chain import GENESIS, content_json
from projections.fold import fold
from projections.lifecycle import (
    OBSERVATION_TABLE,
    Limits,
    Sandbox,
    event_id_for,
    identity_for,
    launch_deadline,
    sandbox_id_for,
    stop_deadline,
)
from projections.store import (
    _WRITE_BATCH,
    COPY_ABOVE,
    HISTORY_COLUMNS,
    OUTBOX_COLUMNS,
    HistoryRow,
    _sandbox_positions,
)
from services.common.settings import Settings
from services.processor.checkpoints import checkpoint_records

Record: TypeAlias = ConsumerRecord[bytes, bytes]
Parsed: TypeAlias = tuple[Record, Any, Cause]  # a record, its message and its cause
_cause = builder(Cause, "topic", "partition", "offset", "message_type", "command_id")
_OUTCOME = TypeAdapter(CommandOutcome)
CURSOR_EVERY = 0.1  # s between publish-cursor writes, as the processor
LAUNCH_PENDING = ("Provisioning", "Starting")
STOPPABLE = ("Provisioning", "Starting", "Ready")  # where the lifecycle admits a stop
# Per phase, the kinds of observation that have an effect (the lifecycle's own table).
NO_EFFECT = {phase.value: set(kinds) for phase, kinds in OBSERVATION_TABLE.items()}


class Unsupported(Exception):
    """A record the ceiling does not apply (one the processor would dead-letter)."""


def timestamp(value: datetime) -> str:
    """A time as pydantic writes it in JSON (``Z`` for UTC, microseconds only when set)."""
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


@dataclass(slots=True)
class Row:
    """A plain sandbox's row as the common path keeps it (the columns it changes)."""

    sandbox_id: UUID
    identity: str
    generation: int
    version: int
    phase: str
    spec: str  # the spec's JSON
    spec_model: SandboxSpec
    created_at: datetime
    updated_at: datetime
    exit_code: int | None = None
    reason: str | None = None
    deadline: str | None = None  # the deadline's JSON

    def sandbox(self, key: str) -> Sandbox:
        """The product's row, for the general path."""
        deadline = Deadline.model_validate_json(self.deadline) if self.deadline else None
        return Sandbox(
            key, self.sandbox_id, Phase(self.phase), self.generation, self.version,
            self.spec_model, (), self.identity, self.exit_code,
            self.reason, self.created_at, self.updated_at, deadline=deadline,
        )  # fmt: skip


@dataclass(slots=True)
class Batch:
    """One poll's output, in the forms the write takes."""

    history: list[tuple[Any, ...]] = field(default_factory=list)  # HISTORY_COLUMNS order
    outbox: list[tuple[int, str, bytes, bytes]] = field(default_factory=list)
    outcomes: list[bytes] = field(default_factory=list)
    decided: dict[tuple[str, str], bytes] = field(default_factory=dict)  # the outcomes by id
    changed: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # key: (p, base)
    keys: dict[str, int] = field(default_factory=dict)  # every key decided: its partition


class SameWork:
    """The ceiling's state: rows (as the processor's row cache), the outcomes and chain heads
    of the poll being decided and the write in flight, offsets, partition memo."""

    def __init__(self, settings: Settings) -> None:
        self.commands = settings.topic_commands
        self.observations = settings.topic_observations
        # Rows kept between polls: those the processor's row cache keeps (``kept``).
        self.capacity = settings.processor_row_cache
        self.kept: dict[int, dict[str, None]] = {}  # per partition: keys, oldest use first
        self.kept_size = 0
        self.events = settings.topic_events
        self.checkpoints = settings.topic_checkpoints
        self.partitions = settings.kafka_partitions
        self.limits: Limits = settings.lifecycle_limits
        self.rows: dict[str, Row] = {}
        self.general: dict[str, Sandbox] = {}  # sandboxes whose rows are not plain
        self.outcomes: dict[tuple[str, str], bytes] = {}  # (key, command id): outcome JSON
        self.heads: dict[str, bytes] = {}
        self.offsets: dict[tuple[str, int], int] = {}  # as decided (the write in flight's)
        self.in_flight_from: dict[tuple[str, int], int] = {}  # what the write in flight CASes
        self.in_flight_outcomes: dict[tuple[str, str], bytes] = {}
        self.in_flight_chains: set[str] = set()
        self.placed: dict[str, int] = {}
        self.by_rules = 0  # inputs decided through fold (the rest took the common path)

    # -- decide ---------------------------------------------------------------------------

    def parse(self, record: Record) -> Parsed:
        """The record validated as the processor's intake does, with its cause."""
        is_command = record.topic == self.commands
        adapter: Any = COMMANDS if is_command else OBSERVATIONS
        try:
            message: Any = decode(adapter, record.value)
        except DecodeError as exc:
            raise Unsupported(f"{record.topic} {record.partition}@{record.offset}: {exc}") from exc
        key = message.key
        if record.key is None or record.key.decode() != key:
            raise Unsupported(f"record key {record.key!r} is not the body's {key!r}")
        expected = self.placed.get(key)
        if expected is None:
            expected = self.placed[key] = partition_for(key.encode(), self.partitions)
        if record.partition != expected:
            raise Unsupported(f"{key!r} on partition {record.partition}, not {expected}")
        command_id = message.command_id if is_command else None
        cause = _cause(record.topic, record.partition, record.offset, message.type, command_id)
        return record, message, cause

    # -- decide ---------------------------------------------------------------------------

    def decide(self, record: Record, message: Any, cause: Cause, batch: Batch) -> None:
        key, kind, command_id = message.key, message.type, cause.command_id
        if key in self.general or (command_id is not None and (key, command_id) in self.outcomes):
            return self._general(record, message, cause, batch)
        at: datetime = message.occurred_at
        row = self.rows.get(key)
        if kind == "CreateSandbox" and row is None and _plain(message):
            row = self._create(key, message, at)
            event, phase_was = "SandboxCreated", None
            why = f"sandbox {key!r} created at generation 1"
            extra = (
                f',"spec":{row.spec},"providers":[],"identity":"{row.identity}",'
                f'"deadline":{row.deadline or "null"},"expires_at":null,"on_expiry":"stop",'
                '"on_exit":"keep"'
            )
        elif row is None:
            if kind == "RuntimeSnapshot":  # the lifecycle ignores observations of no sandbox
                what = f"RuntimeSnapshot({_seen(message)}) of generation {message.generation}"
                self._history(batch, record, message, None, "ignored",
                              f"unknown sandbox: {what}", None, None, None, [], None)  # fmt: skip
                return None
            return self._general(record, message, cause, batch)
        elif kind == "StopSandbox" and row.phase in STOPPABLE and message.expected_version is None:
            phase_was, event = row.phase, "SandboxStopping"
            row.deadline = _deadline_json(stop_deadline(row.spec_model, at, self.limits))
            row.phase = "Stopping"
            why = f"StopSandbox accepted: sandbox {key!r} is Stopping"
            extra = f',"deadline":{row.deadline or "null"}'
        elif kind == "RuntimeSnapshot" and message.generation == row.generation:
            seen = _seen(message)
            what = f"RuntimeSnapshot({seen}) of generation {row.generation}"
            effects = NO_EFFECT.get(row.phase)
            if effects is not None and seen not in effects:
                # No effect in this phase (the lifecycle's table): recorded, nothing changes.
                why = f"no effect in phase {row.phase}: {what}"
                self._history(batch, record, message, None, "ignored", why, row.phase,
                              row.generation, row.version, [], row.sandbox_id)  # fmt: skip
                return None
            if seen == "running" and row.phase in LAUNCH_PENDING:
                phase_was, event, row.phase = row.phase, "SandboxReady", "Ready"
                row.exit_code = row.reason = None
            elif seen in ("exited_ok", "exited_error") and row.phase == "Stopping":
                phase_was, event, row.phase = row.phase, "SandboxStopped", "Stopped"
                row.reason = None
            else:
                return self._general(record, message, cause, batch)
            row.deadline = None
            why = f"{what}: {phase_was} -> {row.phase}"
            extra = ""
        else:
            return self._general(record, message, cause, batch)
        if phase_was is not None:
            row.version += 1
            row.updated_at = max(row.updated_at, at)  # as the processor's evolve
        p = record.partition
        if key not in batch.changed:
            batch.changed[key] = (p, None if phase_was is None else row.version - 1)
        value = self._event(key, row, cause, message.actor, at, event, extra)
        batch.outbox.append((p, self.events, record.key, value))
        if command_id is not None:
            outcome = orjson.dumps(
                {"command_id": command_id, "key": key, "command_type": kind,
                 "status": "accepted", "code": "OK", "message": why,
                 "sandbox_id": row.sandbox_id, "phase": row.phase,
                 "generation": row.generation, "version": row.version, "identity": row.identity}
            )  # fmt: skip
            self.outcomes[(key, command_id)] = batch.decided[(key, command_id)] = outcome
            batch.outcomes.append(outcome)
        self._history(batch, record, message, command_id, "applied", why, row.phase,
                      row.generation, row.version, [event], row.sandbox_id)  # fmt: skip
        return None

    def _history(
        self, batch: Batch, record: Record, message: Any, command_id: str | None,
        disposition: str, reason: str, phase: str | None, generation: int | None,
        version: int | None, events: list[str], sandbox_id: UUID | None,
    ) -> None:  # fmt: skip
        """The input's history entry, linked onto its sandbox's chain."""
        key = message.key
        content = (
            key, record.topic, record.partition, record.offset, message.type, command_id,
            disposition, reason, phase, generation, version, events, record.value.decode(),
            message.occurred_at, sandbox_id,
        )  # fmt: skip
        prev = self.heads.get(key)
        own = hashlib.sha256((prev or GENESIS) + content_json(*content)).digest()
        self.heads[key] = own
        batch.history.append((*content, prev, own))

    def _general(self, record: Record, message: Any, cause: Cause, batch: Batch) -> None:
        """The input decided by the product's own rules (``fold``); the sandbox returns to the
        common path when its row is plain again."""
        key = message.key
        self.by_rules += 1
        state: Sandbox | None
        if key in self.general:
            state = self.general[key]
        else:
            row = self.rows.pop(key, None)
            state = row.sandbox(key) if row is not None else None
        command_id = cause.command_id
        known = {}
        if command_id is not None and (first := self.outcomes.get((key, command_id))):
            known[(key, command_id)] = _OUTCOME.validate_json(first)
        result = fold({key: state}, known, [(cause, message)], limits=self.limits)
        decision = result.steps[0].decision
        new = decision.state
        plain = _plain_row(new) if new is not None else None
        if plain is not None:
            self.rows[key] = plain
            self.general.pop(key, None)
        elif new is not None:
            self.general[key] = new
        p = record.partition
        for event in decision.events:
            batch.outbox.append((p, self.events, record.key, encode(event)))
        if decision.events and new is not None and key not in batch.changed:
            batch.changed[key] = (p, None if state is None else state.version)
        for outcome in result.outcomes.values():
            dumped = _OUTCOME.dump_json(outcome)
            self.outcomes[(key, outcome.command_id)] = dumped
            batch.decided[(key, outcome.command_id)] = dumped
            batch.outcomes.append(dumped)
        self._history(
            batch, record, message, command_id, decision.disposition, decision.reason,
            str(new.phase) if new else None, new.generation if new else None,
            new.version if new else None, [e.type for e in decision.events],
            new.sandbox_id if new else None,
        )  # fmt: skip

    def _create(self, key: str, message: Any, at: datetime) -> Row:
        sandbox_id = sandbox_id_for(key, 1, message.command_id)
        spec = message.spec
        row = Row(
            sandbox_id, identity_for(sandbox_id, 1, message.command_id), 1, 1, "Provisioning",
            spec.__pydantic_serializer__.to_json(spec).decode(), spec, at, at,
            deadline=_deadline_json(launch_deadline(at, self.limits)),
        )  # fmt: skip
        self.rows[key] = row
        return row

    @staticmethod
    def _event(
        key: str, row: Row, cause: Cause, actor: str, at: datetime, event: str, extra: str
    ) -> bytes:
        """The decided event's JSON as pydantic writes it (fields in the models' order; a
        sandbox name needs no escaping, free text goes through orjson)."""
        return (
            f'{{"schema_version":1,"event_id":"{event_id_for(cause)}","key":"{key}",'
            f'"sandbox_id":"{row.sandbox_id}","version":{row.version},'
            f'"generation":{row.generation},"occurred_at":"{timestamp(at)}",'
            f'"actor":{_text(actor)},"cause":{{"topic":{_text(cause.topic)},'
            f'"partition":{cause.partition},"offset":{cause.offset},'
            f'"message_type":"{cause.message_type}","command_id":{_text(cause.command_id)}}},'
            f'"type":"{event}"{extra}}}'
        ).encode()

    # -- write ----------------------------------------------------------------------------

    def positions(self, batch: Batch) -> list[tuple[Any, ...]]:
        """The changed rows as the write statement's decided_rows reads them."""
        out: list[tuple[Any, ...]] = []
        for key, (p, base) in batch.changed.items():
            if (s := self.general.get(key)) is not None:
                out.append(_sandbox_positions(p, s, base))
                continue
            r = self.rows[key]
            out.append(
                (key, r.sandbox_id, r.phase, r.generation, r.version, "", r.identity,
                 r.exit_code, r.reason, r.created_at, r.updated_at, p, None, "stop", "keep",
                 base, orjson.Fragment(r.spec),
                 orjson.Fragment(r.deadline) if r.deadline is not None else None, None, {},
                 None, None, None, None, None, None, "", None, None)  # restarts .. exited_at
            )  # fmt: skip
        return out

    def checkpoint_records(
        self, batch: Batch, moved: dict[tuple[str, int], int]
    ) -> list[tuple[int, str, bytes, bytes]]:
        """The poll's chain checkpoints, as the processor puts them after its events (its own
        pure function, on the poll's history rows and offsets)."""
        history = [HistoryRow(*h) for h in batch.history]
        offsets = {tp: (self.offsets.get(tp, 0), n) for tp, n in moved.items()}
        records = checkpoint_records(history, offsets, self.checkpoints)
        return [(r.partition, r.topic, r.key or b"", r.value) for r in records]

    def decided(
        self, batch: Batch, moved: dict[tuple[str, int], int], expected: dict[tuple[str, int], int]
    ) -> None:
        """A poll decided and about to be written: its offsets, outcomes and chains are the
        write in flight's."""
        self.offsets.update(moved)
        self.in_flight_from = expected
        self.in_flight_outcomes = batch.decided
        self.in_flight_chains = {h[0] for h in batch.history}

    def committed(self, batch: Batch, deciding: Batch | None) -> None:
        """``batch``'s write committed: its rows are kept as the processor's row cache keeps
        them (``RowCache.remember``: every key the batch decided, newest last in its
        partition's order, and over capacity the oldest of the first partitions go), and the
        rows that cache lets go are read back when next needed, as the processor reads them.
        Those of ``deciding`` (decided, not written yet) stay until its own write committed:
        the processor has them from that decision meanwhile (``View.after``)."""
        if self.capacity <= 0:
            gone = list(batch.keys)
        else:
            for key, partition in batch.keys.items():
                part = self.kept.setdefault(partition, {})
                if key in part:
                    del part[key]  # re-inserted last
                else:
                    self.kept_size += 1
                part[key] = None
            gone = []
            for part in self.kept.values():
                while self.kept_size > self.capacity and part:
                    key = next(iter(part))
                    del part[key]
                    self.kept_size -= 1
                    gone.append(key)
        for key in gone:
            if deciding is None or key not in deciding.keys:
                self.rows.pop(key, None)
                self.general.pop(key, None)


async def write_poll(
    work: SameWork,
    conn: asyncpg.Connection[asyncpg.Record],
    batch: Batch,
    moved: dict[tuple[str, int], int],
    expected: dict[tuple[str, int], int],
) -> list[int]:
    """The processor's write of one poll of ``work`` (statement, and COPY above COPY_ABOVE
    rows), compare-and-set from ``expected``; the outbox ids in order."""
    offsets = sorted(moved.items())
    inline = len(batch.history) + len(batch.outbox) <= COPY_ABOVE
    outbox = batch.outbox if inline else []
    args = (
        [t for (t, _), _ in offsets], [p for (_, p), _ in offsets],
        [expected[tp] for tp, _ in offsets], [n for _, n in offsets],
        orjson.dumps(work.positions(batch), default=_hex).decode(),
        orjson.dumps([_history_position(h) for h in batch.history] if inline else [],
                     default=_hex).decode(),
        "[" + ",".join(o.decode() for o in batch.outcomes) + "]",
        [o[0] for o in outbox], [o[1] for o in outbox], [o[2] for o in outbox],
        [o[3] for o in outbox], 0 if inline else len(batch.outbox), CHANGES_CHANNEL,
        None,  # no pools channel: the workload has no pool members
        list[int](),  # no owner epochs: one writer, fenced by its offsets (one comparison)
    )  # fmt: skip
    if inline:
        ids: list[int] = list(await conn.fetchval(_WRITE_BATCH, *args))
    else:
        async with conn.transaction():
            ids = list(await conn.fetchval(_WRITE_BATCH, *args))
            await conn.copy_records_to_table(
                "history", records=batch.history, columns=HISTORY_COLUMNS
            )
            await conn.copy_records_to_table(
                "outbox",
                records=[(i, *o) for i, o in zip(ids, batch.outbox, strict=True)],
                columns=OUTBOX_COLUMNS,
            )
    return ids


def _plain(create: Any) -> bool:
    """A create (or row) the common path decides: no providers, time to live or policy."""
    return (
        not create.providers
        and getattr(create, "ttl_seconds", None) is None
        and create.on_expiry == "stop"
        and create.on_exit == "keep"
    )


def _deadline_json(deadline: Deadline | None) -> str | None:
    """The deadline the lifecycle computes, as the row's and the event's JSON."""
    return None if deadline is None else deadline.__pydantic_serializer__.to_json(deadline).decode()


def _seen(snapshot: Any) -> str:
    """A runtime snapshot's kind of observation, as the lifecycle names it."""
    if snapshot.state == "exited":
        return "exited_ok" if snapshot.exit_code == 0 else "exited_error"
    return "running" if snapshot.state == "running" else "created"


def _plain_row(s: Sandbox) -> Row | None:
    """The common path's row of a product row, if it is plain (None otherwise)."""
    if s.providers or s.hold or s.awaited or s.expires_at or not _plain(s):
        return None
    return Row(
        s.sandbox_id, s.identity, s.generation, s.version, s.phase.value,
        s.spec.model_dump_json(), s.spec, s.created_at, s.updated_at,
        s.exit_code, s.reason, s.deadline.model_dump_json() if s.deadline else None,
    )  # fmt: skip


def _history_position(h: tuple[Any, ...]) -> tuple[Any, ...]:
    """A history row (HISTORY_COLUMNS order) as the statement's ``recorded`` reads it."""
    return (*h[:11], ",".join(h[11]), h[13], h[14], h[15], h[16], h[12])


def _text(value: str | None) -> str:
    return orjson.dumps(value).decode()


def _hex(value: Any) -> str:
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    if isinstance(value, UUID):  # asyncpg's own UUID type
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
