"""Re-decide every recorded input from the log and compare it with what was recorded.

Per input partition: read both input topics and the events topic from the log, and the
recorded history, rows and outcomes from PostgreSQL (one snapshot). Replay the inputs, in the
order they were decided (the history's), from an empty state through the processor's own
parser, fold and batch planner, with today's rules or pinned ones, into a scratch schema made
by the migrations; then compare entry by entry (disposition, reason, resulting phase,
generation and version, event types), event by event (the bytes on the events topic), and the
resulting rows and command outcomes. The first divergence of each sandbox is reported.

It also proves completeness: a log record below the stored offsets without a history entry,
or a history entry whose record is not in the log (nor deleted by retention), is a divergence.
A sandbox with inputs older than the log's beginning cannot be re-decided from an empty state;
it is reported as not verifiable rather than guessed at, and the report is not ok unless the
caller accepts that (``Options.accept_unverifiable``). The history's chains are checked
against the log's checkpoints, read first (``anchors``).
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import asyncpg

from events.codec import encode
from projections.chain import ChainId, chain_of
from projections.fold import Rules
from projections.lifecycle import decide
from projections.store import SANDBOX_COLUMNS, sandbox_from_record, write_batch
from services.audit.anchors import read_anchors
from services.audit.chains import ChainReport, check_chains
from services.audit.entries import ENTRY_COLUMNS, Entry, entry_from_record
from services.audit.log import Record, read_partition
from services.audit.reach import Reach, log_reach
from services.common.kafka_clients import kafka_client_args
from services.common.migrations import apply_migrations
from services.common.settings import Settings
from services.processor.intake import Parsed, parse
from services.processor.plan import Replay

CHUNK = 1000  # inputs replayed per scratch write

if TYPE_CHECKING:
    from projections.store import Connection


@dataclass(frozen=True, slots=True)
class Options:
    key: str | None = None  # one sandbox
    since: datetime | None = None  # report divergences of inputs that occurred in [since, until)
    until: datetime | None = None
    from_offset: int | None = None  # ... and whose offset is in [from_offset, to_offset]
    to_offset: int | None = None
    rules: Rules = decide
    rules_name: str = "projections.lifecycle.decide (this checkout)"
    keep_scratch: bool = False
    # A sandbox whose oldest inputs retention deleted cannot be re-decided: without this, the
    # report is not ok while there is one (the caller accepts that it was not verified).
    accept_unverifiable: bool = False

    def reports(self, entry: Entry) -> bool:
        at = entry.occurred_at
        return not (
            (self.since is not None and (at is None or at < self.since))
            or (self.until is not None and (at is None or at >= self.until))
            or (self.from_offset is not None and entry.offset < self.from_offset)
            or (self.to_offset is not None and entry.offset > self.to_offset)
        )


def load_rules(spec: str) -> Rules:
    """``module`` or ``module:function``: a ``decide(state, message, cause, limits)`` of other
    rules, e.g. a release's projections/lifecycle package copied under another name."""
    module_name, _, attribute = spec.partition(":")
    rules: Rules = getattr(importlib.import_module(module_name), attribute or "decide")
    return rules


@dataclass(frozen=True, slots=True)
class Divergence:
    key: str | None
    topic: str
    partition: int
    offset: int
    input: str
    what: str
    recorded: str
    redecided: str
    against: str = "re-decided"  # what ``redecided`` is: the new decision, or the log's copy

    def describe(self) -> str:
        return (
            f"{self.key or '(unkeyed)'} at {self.topic}[{self.partition}]@{self.offset} "
            f"({self.input}): {self.what}\n    {'recorded:':<{len(self.against) + 1}} "
            f"{self.recorded}\n    {self.against}: {self.redecided}"
        )


@dataclass(slots=True)
class Report:
    reach: Reach
    rules: str
    scratch: str
    partitions: list[int] = field(default_factory=list)
    inputs: int = 0
    sandboxes: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    pending: int = 0  # log records not decided yet (at or above the stored offsets)
    not_verifiable: set[str] = field(default_factory=set)  # inputs older than the log
    chains: ChainReport | None = None
    accept_unverifiable: bool = False

    @property
    def ok(self) -> bool:
        verified = not self.not_verifiable or self.accept_unverifiable
        return not self.divergences and verified and (self.chains is None or self.chains.intact)


async def verify(settings: Settings, options: Options = Options()) -> Report:
    scratch = f"audit_{uuid.uuid4().hex[:12]}"
    anchors = await read_anchors(settings)  # before the history: see read_anchors
    live = await asyncpg.connect(
        settings.pg_dsn, server_settings={"search_path": settings.pg_schema}
    )
    try:
        partitions: Sequence[int] = range(settings.kafka_partitions)
        if options.key is not None:
            found = await live.fetch(
                "SELECT DISTINCT partition FROM history WHERE key = $1", options.key
            )
            partitions = sorted(r["partition"] for r in found)
        report = Report(await log_reach(settings), options.rules_name, scratch)
        report.accept_unverifiable = options.accept_unverifiable
        await apply_migrations(settings.pg_dsn, schema=scratch)
        out = await asyncpg.connect(settings.pg_dsn, server_settings={"search_path": scratch})
        try:
            for p in partitions:
                await _partition(settings, options, live, out, p, report)
                report.partitions.append(p)
        finally:
            if not options.keep_scratch:
                await out.execute(f'DROP SCHEMA "{scratch}" CASCADE')
            await out.close()
        report.chains = await check_chains(live, options.key, anchors)
        return report
    finally:
        await live.close()


@dataclass(slots=True)
class _Recorded:
    offsets: dict[str, int]
    entries: list[Entry]
    rows: dict[str, Any]
    outcomes: dict[tuple[str, str], Any]
    # Events committed but not yet published as of the snapshot (the topic may lack them).
    unpublished: set[str]


async def _read_recorded(settings: Settings, live: Connection, p: int) -> _Recorded:
    topics = [settings.topic_commands, settings.topic_observations]
    async with live.transaction(isolation="repeatable_read", readonly=True):
        offsets = await live.fetch(
            "SELECT topic, next_offset FROM input_offsets WHERE partition = $1 "
            "AND topic = ANY($2::text[])",
            p,
            topics,
        )
        entries = await live.fetch(
            f"SELECT {ENTRY_COLUMNS} FROM history WHERE partition = $1 AND topic = ANY($2::text[]) "
            "ORDER BY id",
            p,
            topics,
        )
        rows = await live.fetch(f"SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE partition = $1", p)
        keys = sorted({e["key"] for e in entries if e["key"] is not None})
        outcomes = await live.fetch(
            "SELECT key, command_id, outcome::text AS outcome FROM command_outcomes "
            "WHERE key = ANY($1::text[])",
            keys,
        )
        unpublished = await live.fetch(
            "SELECT convert_from(o.value, 'UTF8')::json->>'event_id' AS event_id FROM outbox o "
            "LEFT JOIN outbox_cursor c USING (partition) WHERE o.partition = $1 "
            "AND o.topic = $2 AND o.id > coalesce(c.published_id, 0)",
            p,
            settings.topic_events,
        )
    return _Recorded(
        {r["topic"]: r["next_offset"] for r in offsets},
        [entry_from_record(e) for e in entries],
        {r["key"]: sandbox_from_record(r) for r in rows},
        {(r["key"], r["command_id"]): json.loads(r["outcome"]) for r in outcomes},
        {r["event_id"] for r in unpublished},
    )


async def _partition(
    settings: Settings,
    options: Options,
    live: Connection,
    out: Connection,
    p: int,
    report: Report,
) -> None:
    commands, observations = settings.topic_commands, settings.topic_observations
    recorded = await _read_recorded(settings, live, p)
    log = await read_partition(
        kafka_client_args(settings, "audit"), [commands, observations, settings.topic_events], p
    )
    by_position: dict[tuple[str, int], Record] = {
        (r.topic, r.offset): r for t in (commands, observations) for r in log[t]
    }
    wanted = [e for e in recorded.entries if options.key is None or e.key == options.key]
    first: dict[ChainId, Divergence] = {}

    def diverge(entry: Entry, what: str, was: str, now: str, against: str = "re-decided") -> None:
        chain = chain_of(entry.key, entry.partition)
        if chain not in first and options.reports(entry):
            first[chain] = Divergence(
                entry.key, entry.topic, p, entry.offset, entry.message_type or "dead letter",
                what, was, now, against,
            )  # fmt: skip

    # Completeness: every record below the stored offsets was recorded, and every recorded
    # input is in the log (unless retention deleted it).
    seen = {(e.topic, e.offset) for e in recorded.entries}
    for (topic, offset), record in sorted(by_position.items()):
        if (topic, offset) in seen:
            continue
        if offset >= recorded.offsets.get(topic, 0):
            report.pending += 1
        elif options.key is None or record.key == options.key.encode():
            missing = Divergence(
                record.key.decode(errors="replace") if record.key else None, topic, p, offset,
                "?", "this log record has no history entry (an input was lost or removed)",
                "(nothing)", "an input to decide",
            )  # fmt: skip
            report.divergences.append(missing)
    gone: set[str | None] = set()
    for entry in wanted:
        if (entry.topic, entry.offset) in by_position:
            continue
        gone.add(entry.key)
        if entry.offset >= report.reach.begins_at(entry.topic, p):
            diverge(entry, "the recorded input is not in the log", "an input", "(nothing)")
    report.not_verifiable |= {k for k in gone if k is not None}
    replayable = [e for e in wanted if e.key not in gone]

    # Replay into the scratch schema, CHUNK inputs per write, exactly as the processor would.
    decider = Replay(settings, options.rules, offsets={(commands, p): 0, (observations, p): 0})
    redecided_events: dict[tuple[str, int], list[tuple[str, bytes]]] = defaultdict(list)
    for start in range(0, len(replayable), CHUNK):
        chunk = replayable[start : start + CHUNK]
        items = [
            parse(
                by_position[(e.topic, e.offset)],
                commands,
                settings.kafka_partitions,
                max_bytes=settings.processor_max_input_bytes,
            )
            for e in chunk
        ]
        for entry, item in zip(chunk, items, strict=True):
            if isinstance(item, Parsed) and entry.message != item.record.value.decode():
                diverge(entry, "the recorded input body differs from the log", entry.message
                        or "", item.record.value.decode(), "in the log")  # fmt: skip
        decided = decider.decide(items)
        await write_batch(out, decided.plan)
        for step in decided.result.steps:
            for event in step.decision.events:
                cause = (step.cause.topic, step.cause.offset)
                redecided_events[cause].append((str(event.event_id), encode(event)))
    report.inputs += len(replayable)

    await _compare(out, recorded, replayable, redecided_events, log[settings.topic_events], diverge)
    last: dict[str, Entry] = {e.key: e for e in replayable if e.key is not None}
    keys = set(last)
    report.sandboxes += len(keys)
    fresh_rows = await out.fetch(f"SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE partition = $1", p)
    fresh = {r["key"]: sandbox_from_record(r) for r in fresh_rows}
    fresh_outcomes = {
        (r["key"], r["command_id"]): json.loads(r["outcome"])
        for r in await out.fetch(
            "SELECT key, command_id, outcome::text AS outcome FROM command_outcomes "
            "WHERE key = ANY($1::text[])",
            sorted(keys),
        )
    }
    for key in sorted(keys):
        if recorded.rows.get(key) != fresh.get(key):
            diverge(last[key], "the resulting row differs", repr(recorded.rows.get(key)),
                    repr(fresh.get(key)))  # fmt: skip
        mine = {i: o for (k, i), o in recorded.outcomes.items() if k == key}
        theirs = {i: o for (k, i), o in fresh_outcomes.items() if k == key}
        if mine != theirs:
            differ = sorted(i for i in mine.keys() | theirs.keys() if mine.get(i) != theirs.get(i))
            diverge(last[key], f"command outcomes differ ({', '.join(differ)})",
                    json.dumps([mine.get(i) for i in differ]),
                    json.dumps([theirs.get(i) for i in differ]))  # fmt: skip
    report.divergences.extend(first.values())


async def _compare(
    out: Connection,
    recorded: _Recorded,
    replayable: list[Entry],
    redecided_events: dict[tuple[str, int], list[tuple[str, bytes]]],
    live_events: list[Record],
    diverge: Any,
) -> None:
    """Entry by entry in decision order: the decision, then the events it published."""
    if not replayable:
        return
    fresh = {
        (r["topic"], r["offset"]): entry_from_record(r)
        for r in await out.fetch(
            f"SELECT {ENTRY_COLUMNS} FROM history WHERE partition = $1", replayable[0].partition
        )
    }
    published: dict[str, bytes] = {}
    for record in live_events:
        event_id = json.loads(record.value).get("event_id")
        published.setdefault(str(event_id), record.value)
    for entry in replayable:
        again = fresh.get((entry.topic, entry.offset))
        if again is None:
            diverge(entry, "re-deciding recorded nothing", _decision(entry), "(nothing)")
            continue
        if _decision(entry) != _decision(again):
            diverge(entry, "the decision differs", _decision(entry), _decision(again))
            continue
        for event_id, value in redecided_events.get((entry.topic, entry.offset), []):
            on_topic = published.get(event_id)
            if on_topic is None and event_id in recorded.unpublished:
                continue  # committed, not yet published when the snapshot was taken
            if on_topic is None:
                diverge(entry, f"event {event_id} is not on the events topic", "(absent)",
                        value.decode())  # fmt: skip
            elif on_topic != value:
                diverge(entry, f"event {event_id} differs", on_topic.decode(), value.decode())


def _decision(e: Entry) -> str:
    state = f"{e.phase} g{e.generation} v{e.version}" if e.phase else "no row"
    events = ",".join(e.event_types) or "no events"
    return f"{e.disposition}: {state} [{events}] - {e.reason}"
