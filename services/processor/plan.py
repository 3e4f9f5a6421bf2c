"""Plan: a batch of parsed inputs decided (``fold``) from a view of the stored state and turned
into what to write: rows, hash-chained history, outcomes, outbox (events, dead letters, chain
checkpoints) and new offsets (pure).

The processor, the audit's verify and shadow, and the golden logs all decide through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field

from events.codec import encode, storable
from events.deadletter import REASON_CHARS, bounded, dead_letter, key_text, record_key
from events.outcomes import CommandOutcome
from projections.chain import ChainId, Chains, HistoryContent, chain_of
from projections.fold import BatchResult, OutcomeKey, Rules, fold
from projections.lifecycle import Sandbox, decide
from projections.records import maker
from projections.store import BatchRead, BatchWrite, HistoryRow, OutboxRecord
from services.common.settings import Settings
from services.processor.checkpoints import checkpoint_records
from services.processor.intake import Item, Parsed, Rejected, record_time

TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class View:
    """The state a batch is decided on besides its rows: as read, or as of another batch
    committed.

    The processor decides poll N+1 while poll N's write is in flight. What N+1 reads then may
    be from before or after N's commit; ``View.after`` makes it the state after N either way:
    N's new offsets (N+1's write compares and sets those, so it can only land after N
    committed), N's outcomes and history chain heads. A partition of N at an offset neither N
    read nor N writes means another writer moved it: no view (N's own write will find that out
    too).
    """

    offsets: Mapping[TopicPartition, int]  # the batch is decided at these, and its write CASes them
    cache_offsets: Mapping[TopicPartition, int]  # what kept rows are checked against
    outcomes: Mapping[tuple[str, str], CommandOutcome]
    heads: Mapping[ChainId, bytes | None]

    @classmethod
    def of(cls, read: BatchRead) -> View:
        return cls(read.offsets, read.offsets, read.outcomes, read.chain_heads)

    @classmethod
    def after(cls, read: BatchRead, inflight: BatchWrite) -> View | None:
        """The state once ``inflight`` commits, from a read made while it was being written.

        Kept rows were checked against the offsets ``inflight`` was read at (it has not been
        remembered yet): they are checked against those again.
        """
        offsets, cache_offsets = dict(read.offsets), dict(read.offsets)
        for tp, (at, new) in inflight.offsets.items():
            got = read.offsets.get(tp)
            if got is None:
                continue
            if got not in (at, new):
                return None
            offsets[tp], cache_offsets[tp] = new, at
        outcomes = {**read.outcomes, **{(o.key, o.command_id): o for o in inflight.outcomes}}
        heads = dict(read.chain_heads)
        for row in inflight.history:  # in write order: the last entry of a chain is its head
            heads[chain_of(row.key, row.partition)] = row.entry_hash
        return cls(offsets, cache_offsets, outcomes, heads)


# Deciding ahead hands the event loop back to the write in flight after each slice of this
# many records (a few milliseconds of work), so its next round trip is not held up long.
SLICE = 250


def plan_batch(
    items: Sequence[Item],
    result: BatchResult,
    read_offsets: Mapping[tuple[str, int], int],
    settings: Settings,
    decided_from: Mapping[str, Sandbox | None] | None = None,
    chain_heads: Mapping[ChainId, bytes | None] | None = None,
) -> BatchWrite:
    """Turn a folded batch into the rows to write (pure).

    ``items`` are the batch's records in fold order; ``result`` the fold of the parsed ones;
    ``read_offsets`` the offsets they were decided at, which the write compares and sets;
    ``decided_from`` the stored rows they were decided from, whose versions it compares too.
    With ``chain_heads`` the history rows are linked onto their chains from those heads (what
    ``chain_rows`` does afterwards, without copying every row again).
    """
    history: list[HistoryRow] = []
    outbox: list[OutboxRecord] = []
    next_offsets: dict[tuple[str, int], int] = {}
    steps = iter(result.steps)
    changed: dict[str, tuple[int, Sandbox]] = {}
    chains = Chains(chain_heads) if chain_heads is not None else None
    events_topic, commands_topic = settings.topic_events, settings.topic_commands
    for item in items:
        record = item.record
        p = record.partition
        tp = (record.topic, p)
        next_offsets[tp] = max(next_offsets.get(tp, 0), record.offset + 1)
        if isinstance(item, Rejected):
            history.append(_history_row(_dead_letter_content(item), chains))
            outbox.append(_dead_letter(item, settings.topic_deadletter))
            continue
        step = next(steps)
        d = step.decision
        state = d.state
        for event in d.events:
            outbox.append(_outbox_record(p, events_topic, event.key.encode(), encode(event)))
        for command in d.commands:  # a claim's next step, on the other key's partition
            outbox.append(_outbox_record(p, commands_topic, command.key.encode(), encode(command)))
        if d.events and state is not None:
            changed[state.key] = (p, state)
        message = step.message
        content: HistoryContent = (
            message.key, record.topic, p, record.offset, message.type, step.cause.command_id,
            d.disposition, d.reason, str(state.phase) if state else None,  # a StrEnum's value
            state.generation if state else None, state.version if state else None,
            [e.type for e in d.events],
            record.value.decode() if record.value is not None else None,
            message.occurred_at, state.sandbox_id if state else None,
        )  # fmt: skip
        history.append(_history_row(content, chains))
    offsets = {tp: (at, next_offsets.get(tp, at)) for tp, at in read_offsets.items()}
    if chains is not None:  # the chains' new heads, anchored on the log (checkpoints.py)
        outbox += checkpoint_records(history, offsets, settings.topic_checkpoints)
    return BatchWrite(
        sandboxes=list(changed.values()),
        history=history,
        outcomes=list(result.outcomes.values()),
        outbox=outbox,
        offsets=offsets,
        decided_from={
            key: row.version
            for key, row in (decided_from or {}).items()
            if row is not None and key in changed
        },
    )


# One history row per input and an outbox record per event: built through their slots.
_history_entry = maker(HistoryRow)
_outbox_record = maker(OutboxRecord)


def _history_row(content: HistoryContent, chains: Chains | None) -> HistoryRow:
    """A history row from its content (HistoryRow's first fields, in CONTENT_FIELDS order),
    linked onto its chain when ``chains`` is given."""
    if chains is None:
        return _history_entry(*content, None, None)
    return _history_entry(*content, *chains.linked(content))


def _dead_letter(item: Rejected, topic: str) -> OutboxRecord:
    """A refused record's dead letter: small whatever the record holds (events.deadletter)."""
    r = item.record
    letter = dead_letter(item.reason, r.topic, r.partition, r.offset, record_time(r), r.key,
                         r.value)  # fmt: skip
    return OutboxRecord(r.partition, topic, record_key(r.key), encode(letter))


def _dead_letter_content(item: Rejected) -> HistoryContent:
    """A refused record's history content (CONTENT_FIELDS order): its key and reason as its
    dead letter has them."""
    record = item.record
    key = key_text(record.key)
    return (
        None if key is None else storable(key), record.topic, record.partition, record.offset,
        None, None, "dead-lettered", storable(bounded(item.reason, REASON_CHARS)), None, None,
        None, [], None, record_time(record), None,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Decided:
    """A batch decided and planned: what to write."""

    items: list[Item]  # those not below the offsets it was decided at
    result: BatchResult
    plan: BatchWrite

    def states_for(self, where: Mapping[str, int]) -> dict[str, Sandbox | None]:
        """The rows of ``where``'s keys as this batch leaves them (those it knew)."""
        states = self.result.states
        return {key: states[key] for key in where if key in states}


def deciding(
    items: list[Item],
    states: dict[str, Sandbox | None],
    view: View,
    settings: Settings,
    slice_size: int,
    rules: Rules = decide,
) -> Generator[None, None, Decided]:
    """Fold the parsed items from ``states`` and plan the write (pure), pausing (``yield``)
    after each ``slice_size`` inputs folded: folding slices in turn, each from the states and
    outcomes the ones before left, is folding them all at once."""
    parsed = [(i.cause, i.message) for i in items if isinstance(i, Parsed)]
    result = BatchResult(states=dict(states))
    known = dict(view.outcomes)
    for start in range(0, len(parsed), slice_size):
        part = fold(result.states, known, parsed[start : start + slice_size], rules,
                    settings.lifecycle_limits)  # fmt: skip
        result.states = part.states
        result.outcomes.update(part.outcomes)
        known.update(part.outcomes)
        result.steps += part.steps
        yield
    plan = plan_batch(items, result, view.offsets, settings, states, view.heads)
    return Decided(items, result, plan)


def decide_batch(
    items: list[Item],
    states: dict[str, Sandbox | None],
    view: View,
    settings: Settings,
    rules: Rules = decide,
) -> Decided:
    steps = deciding(items, states, view, settings, max(len(items), 1), rules)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def decide_batch_yielding(
    items: list[Item],
    states: dict[str, Sandbox | None],
    view: View,
    settings: Settings,
    rules: Rules = decide,
) -> Decided:
    """``decide_batch`` handing the event loop back after every ``SLICE`` inputs."""
    steps = deciding(items, states, view, settings, SLICE, rules)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


@dataclass
class Replay:
    """Recorded inputs decided batch after batch from an empty state, each batch from what the
    ones before left (rows, outcomes, chain heads, offsets), as the processor would decide them
    with nothing stored yet: the audit's re-deciding path, through the same stages."""

    settings: Settings
    rules: Rules = decide
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    states: dict[str, Sandbox | None] = field(default_factory=dict)
    outcomes: dict[OutcomeKey, CommandOutcome] = field(default_factory=dict)
    heads: dict[ChainId, bytes | None] = field(default_factory=dict)

    def decide(self, items: list[Item]) -> Decided:
        at = {(i.record.topic, i.record.partition): 0 for i in items} | self.offsets
        view = View(at, at, self.outcomes, self.heads)
        decided = decide_batch(items, self.states, view, self.settings, self.rules)
        self.states = decided.result.states
        self.outcomes.update(decided.result.outcomes)
        plan = decided.plan
        self.heads.update({chain_of(h.key, h.partition): h.entry_hash for h in plan.history})
        self.offsets.update({tp: new for tp, (_, new) in plan.offsets.items()})
        return decided
