"""The lifecycle processor: Kafka in, PostgreSQL rows out, exactly once, then the outbox out.

For each poll (commands and observations are co-partitioned: partition p of both topics is
always assigned together), one statement reads the stored offsets of the polled partitions with
the rows and outcomes the records need; records below the stored offsets are dropped
(redeliveries, or a zombie's stale batch), the rest fold through the pure core, and one more
statement writes rows, history, outcomes, outbox and the new offsets, atomically and only if
the offsets are still those it read (else the poll is decided again). After commit the new
outbox records are sent to Kafka and the per-partition publish cursors move; a crash in
between leaves them unpublished, and whoever is assigned the partition next publishes them
before anything else.

Ownership: when a partition is revoked the processor first finishes the batch it is applying
and waits for its outbox records to be acknowledged, then forgets the partition; a batch polled
before the revoke is applied only for partitions still owned. The publish cursors move only
over outbox ids that were acknowledged, and never past one of the partition that was not (a
gap another owner left is published again). A failure inside the assignment callback (which
aiokafka would log and swallow) is raised by the poll loop. Losing PostgreSQL or Kafka is ridden
out in place: back off, then resume from the offsets and cursors stored in PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError, KafkaTimeoutError

from events.codec import (
    COMMANDS,
    OBSERVATIONS,
    DecodeError,
    check_key,
    decode,
    encode,
    printable,
    storable,
)
from events.commands import CommandBase
from events.common import Cause
from events.deadletter import DeadLetter, SourceRecord
from events.topics import partition_for
from events.trusted import builder
from projections.chain import ChainId, Chains, HistoryContent, chain_of
from projections.fold import BatchResult, fold
from projections.lifecycle import Message, Sandbox
from projections.records import maker
from projections.stopped import record_stop, stopped_partitions
from projections.store import (
    BATCH_SESSION,
    CONNECTION_ERRORS,
    BatchWrite,
    HistoryRow,
    OffsetsMoved,
    OutboxRecord,
    RowVersionMoved,
    mark_published,
    read_batch,
    stored_offsets,
    unpublished_outbox,
    write_batch,
)
from services.common import metrics
from services.common.database import connect_pool
from services.common.entrypoint import run_until_signalled
from services.common.kafka_clients import kafka_client_args
from services.common.log_identity import check_log_identity, log_identity_of, read_log_identity
from services.common.settings import Settings
from services.processor.ahead import View
from services.processor.checkpoints import checkpoint_records
from services.processor.gc_thresholds import collect_less_often
from services.processor.row_cache import RowCache

log = logging.getLogger("sandstream.processor")

Poll = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]  # what the consumer returns


@dataclass(frozen=True, slots=True)
class Parsed:
    record: ConsumerRecord[bytes, bytes]
    cause: Cause
    message: Message


@dataclass(frozen=True, slots=True)
class Rejected:
    record: ConsumerRecord[bytes, bytes]
    reason: str


def _tp(record: ConsumerRecord[bytes, bytes]) -> tuple[str, int]:
    return (record.topic, record.partition)


def record_time(record: ConsumerRecord[bytes, bytes]) -> datetime:
    return datetime.fromtimestamp(record.timestamp / 1000, tz=UTC)


def parse(
    record: ConsumerRecord[bytes, bytes],
    commands_topic: str,
    partitions: int,
    placed: dict[str, int] | None = None,
) -> Parsed | Rejected:
    """Decode and check one record; ``placed`` memoizes each key's partition."""
    adapter: Any = COMMANDS if record.topic == commands_topic else OBSERVATIONS
    try:
        message: Message = decode(adapter, record.value)
        check_key(record.key, message.key)
    except DecodeError as exc:
        return Rejected(record, exc.reason)
    # Per-sandbox order rests on every record of a sandbox being in one partition; a producer
    # with another partitioner would split it (and its updates would race).
    placed = {} if placed is None else placed
    expected = placed.get(message.key)
    if expected is None:
        expected = placed[message.key] = partition_for(message.key.encode(), partitions)
    if record.partition != expected:
        return Rejected(
            record,
            f"record is on partition {record.partition} but key {message.key!r} belongs on "
            f"partition {expected} of {partitions} (Kafka's default partitioner: "
            "murmur2(key) & 0x7fffffff % partitions; see docs/architecture.md)",
        )
    command_id = message.command_id if isinstance(message, CommandBase) else None
    cause = _cause(record.topic, record.partition, record.offset, message.type, command_id)
    return Parsed(record, cause, message)


# A record's coordinates and its message's type and command id (validated with the message),
# as Cause(...) would build them.
_cause = builder(Cause, "topic", "partition", "offset", "message_type", "command_id")


def merge_topics(
    per_topic: Iterable[Sequence[ConsumerRecord[bytes, bytes]]],
) -> list[ConsumerRecord[bytes, bytes]]:
    """Interleave the topics of one partition by record time, keeping each topic's order."""
    return list(heapq.merge(*per_topic, key=lambda r: r.timestamp))


def plan_batch(
    items: Sequence[Parsed | Rejected],
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
    events_topic = settings.topic_events
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


def history_key(item: Parsed | Rejected) -> str | None:
    """The key an item's history entry is recorded under."""
    if isinstance(item, Parsed):
        return item.message.key
    key = printable(item.record.key)[0]
    return None if key is None else storable(key)  # as _dead_letter_content stores it


def _dead_letter(item: Rejected, topic: str) -> OutboxRecord:
    record = item.record
    key_text, _ = printable(record.key)
    value_text, encoding = printable(record.value)
    letter = DeadLetter(
        reason=item.reason,
        source=SourceRecord(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            timestamp=record_time(record),
        ),
        key=key_text,
        value=value_text,
        value_encoding=encoding,
    )
    return OutboxRecord(record.partition, topic, record.key, encode(letter))


def _dead_letter_content(item: Rejected) -> HistoryContent:
    """A refused record's history content (CONTENT_FIELDS order)."""
    record = item.record
    key = printable(record.key)[0]
    return (
        None if key is None else storable(key), record.topic, record.partition, record.offset,
        None, None, "dead-lettered", storable(item.reason), None, None, None, [], None,
        record_time(record), None,
    )  # fmt: skip


def by_partition_of(
    batch: Mapping[TopicPartition, Sequence[ConsumerRecord[bytes, bytes]]],
) -> dict[int, list[ConsumerRecord[bytes, bytes]]]:
    """A poll's records by partition, each partition's two topics merged by record time."""
    per_topic: dict[int, list[Sequence[ConsumerRecord[bytes, bytes]]]] = defaultdict(list)
    for tp, records in batch.items():
        if records:  # getmany can report a partition with nothing new
            per_topic[tp.partition].append(records)
    return {p: merge_topics(rs) for p, rs in per_topic.items()}


@dataclass(frozen=True, slots=True)
class Inputs:
    """A batch's records parsed, with what its read needs."""

    records: list[ConsumerRecord[bytes, bytes]]
    items: list[Parsed | Rejected]
    where: dict[str, int]  # key -> partition
    idents: set[tuple[str, str]]
    chains: set[ChainId]
    partitions: set[tuple[str, int]]


def inputs_of(
    records: list[ConsumerRecord[bytes, bytes]], items: list[Parsed | Rejected], topics: list[str]
) -> Inputs:
    parsed = [i for i in items if isinstance(i, Parsed)]
    return Inputs(
        records,
        items,
        {p.message.key: p.record.partition for p in parsed},
        {(p.message.key, p.cause.command_id) for p in parsed if p.cause.command_id},
        {chain_of(history_key(i), i.record.partition) for i in items},
        {(t, r.partition) for r in records for t in topics},
    )


@dataclass(frozen=True, slots=True)
class Decided:
    """A batch decided and planned: what to write."""

    items: list[Parsed | Rejected]  # those not below the offsets it was decided at
    result: BatchResult
    plan: BatchWrite

    def states_for(self, where: Mapping[str, int]) -> dict[str, Sandbox | None]:
        """The rows of ``where``'s keys as this batch leaves them (those it knew)."""
        states = self.result.states
        return {key: states[key] for key in where if key in states}


@dataclass(frozen=True, slots=True)
class Ahead:
    """The next poll, decided while the previous write was in flight."""

    inputs: Inputs
    decided: Decided
    epoch: int  # the processor's epoch then: anything that moved it discards this


# Deciding ahead hands the event loop back to the write in flight after each slice of this
# many records (a few milliseconds of work), so its next round trip is not held up long.
_SLICE = 250


def deciding(
    items: list[Parsed | Rejected],
    states: dict[str, Sandbox | None],
    view: View,
    settings: Settings,
    slice_size: int,
) -> Generator[None, None, Decided]:
    """Fold the parsed items from ``states`` and plan the write (pure), pausing (``yield``)
    after each ``slice_size`` inputs folded: folding slices in turn, each from the states and
    outcomes the ones before left, is folding them all at once."""
    parsed = [(i.cause, i.message) for i in items if isinstance(i, Parsed)]
    result = BatchResult(states=dict(states))
    known = dict(view.outcomes)
    for start in range(0, len(parsed), slice_size):
        part = fold(result.states, known, parsed[start : start + slice_size],
                    limits=settings.lifecycle_limits)  # fmt: skip
        result.states = part.states
        result.outcomes.update(part.outcomes)
        known.update(part.outcomes)
        result.steps += part.steps
        yield
    plan = plan_batch(items, result, view.offsets, settings, states, view.heads)
    return Decided(items, result, plan)


def decide_batch(
    items: list[Parsed | Rejected],
    states: dict[str, Sandbox | None],
    view: View,
    settings: Settings,
) -> Decided:
    steps = deciding(items, states, view, settings, max(len(items), 1))
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def decide_batch_yielding(
    items: list[Parsed | Rejected],
    states: dict[str, Sandbox | None],
    view: View,
    settings: Settings,
) -> Decided:
    steps = deciding(items, states, view, settings, _SLICE)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


class PollAhead(Enum):
    """What a batch does with the next poll while its write is in flight."""

    NONE = "none"  # nothing (a batch not from the poll loop: a partition, half a refused one)
    # Take what the consumer fetches meanwhile; it is applied next, decided after the write.
    # aiokafka sends its next fetch only once the last one's records are taken: left alone
    # for the write, the fetcher would idle after its first response, and what arrives
    # meanwhile would wait for one more write.
    FETCH = "fetch"
    # Decide what the consumer has already fetched, as of this write committed. Only when
    # the processor is behind: otherwise that is a sliver of what arrives during the write,
    # and the rest waits for the sliver's write as well (docs/benchmarks.md). Behind, the
    # overlap pays, on a busy machine too (PostgreSQL and Python each get a share of it).
    DECIDE = "decide"


def poll_ahead(batch: Mapping[TopicPartition, Sequence[object]], max_records: int) -> PollAhead:
    """DECIDE after a poll of a slice or more, or a full one (the processor is behind), FETCH
    after a smaller one."""
    behind = count(batch) >= min(_SLICE, max_records)
    return PollAhead.DECIDE if behind else PollAhead.FETCH


def added(held: Poll | None, batch: Poll) -> Poll:
    """``batch`` polled after ``held``: each partition's records stay in offset order."""
    out = {tp: list(records) for tp, records in (held or {}).items()}
    for tp, records in batch.items():
        out.setdefault(tp, []).extend(records)
    return out


def count(batch: Mapping[TopicPartition, Sequence[object]]) -> int:
    return sum(len(records) for records in batch.values())


def same_records(
    a: Sequence[ConsumerRecord[bytes, bytes]], b: Sequence[ConsumerRecord[bytes, bytes]]
) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


# SQLSTATE classes of a write refused for what the records hold (data exceptions, integrity
# constraints, a trigger's RAISE, program limits), as opposed to the server's state.
_REFUSED_CLASSES = ("22", "23", "P0", "54")


class WriteRefused(Exception):
    """PostgreSQL refused a batch for what one of its records holds."""


def refused_for_content(exc: BaseException) -> bool:
    return isinstance(exc, asyncpg.PostgresError) and str(exc.sqlstate)[:2] in _REFUSED_CLASSES


# Keys whose partition parse remembers across batches (murmur2 in Python costs microseconds).
_PLACED_KEYS = 100_000
# Up to this many outbox records a poll sends record by record; more go as one batch per
# topic partition. A batch waits until the partition's previous one is acknowledged (the
# producer keeps one request in flight per partition), a broker round trip on the ordered
# path that only a poll this large amortizes.
_SEND_ONE_BY_ONE = 500


# The confirmer writes the publish cursors at most this often (seconds) unless a drain (a
# revoke, an assignment, a stop) waits for them: at a steady rate every poll's
# acknowledgements cost a statement of their own otherwise. A crash leaves what was
# acknowledged since the last write above the cursor, published again by the next owner: at
# least once, as for anything in flight at a crash (docs/architecture.md).
_CURSOR_EVERY = 0.1


# How long a poll made during a write waits for records (one that finds none ends the polling
# for that write). Dropped as soon as the write is done, so it only bounds a long write's polls.
_FETCH_WAIT_MS = 1000


class InputsLost(RuntimeError):
    """An input partition no longer starts where the processor left it: records it never
    applied were deleted (retention), so going on would silently skip decided inputs."""


class PartitionCountChanged(RuntimeError):
    """An input topic's partition count is not the one the log was partitioned with."""


@dataclass
class Processor:
    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    max_records: int = 5000
    poll_timeout_ms: int = 20
    name: str = "processor"
    consumer: AIOKafkaConsumer | None = None
    producer: AIOKafkaProducer | None = None
    # Serializes applying and publishing with the sweep a rebalance triggers.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _last_lag_commit: float = 0.0
    _lag_commit: asyncio.Task[None] | None = None  # the commit to Kafka in flight, if any
    # Outbox batches handed to the producer, in commit order, until acknowledged.
    _unconfirmed: asyncio.Queue[tuple[list[asyncio.Future[Any]], dict[int, list[int]]]] = field(
        default_factory=asyncio.Queue
    )
    _confirmer: asyncio.Task[None] | None = None
    _cursor_written: float = 0.0  # the event loop's time of the last cursor write
    _flush: asyncio.Event = field(default_factory=asyncio.Event)  # set while a drain waits
    _draining: int = 0  # drains waiting
    _publish_failure: Exception | None = None
    _conn: Any = None  # the batches' connection
    _rows: RowCache = field(init=False)
    _cursor_conn: Any = None  # the confirmer's connection
    # Partitions stopped at a record PostgreSQL refused even as a dead letter: partition ->
    # (topic, offset). Paused until an operator skips or retries the record.
    _stopped: dict[int, tuple[str, int]] = field(default_factory=dict)
    _last_stop_check: float = 0.0
    _inputs_lost: InputsLost | None = None  # found on assignment, raised by run()
    # Partitions this processor owns (assigned and resumed); None when driven directly
    # (process_partition without a consumer), which owns whatever it is given.
    _owned: set[int] | None = None
    _assign_failure: BaseException | None = None  # raised from the poll loop
    _gaps: set[int] = field(default_factory=set)  # partitions whose cursor stopped at a gap
    _joined: bool = False  # an assignment was applied since start (readiness)
    _resuming: str | None = None  # the backend being waited for after losing it (readiness)
    _placed: dict[str, int] = field(default_factory=dict)  # key -> its partition (parse's memo)
    # (output topic, its partition count) -> record key -> partition (the publisher's memo)
    _out_placed: dict[tuple[str, int], dict[bytes, int]] = field(default_factory=dict)
    # Decided ahead: the poll fetched while the previous write was in flight (applied next),
    # its decision (None once anything invalidated it), the connection it was read on, and
    # the epoch a rebalance, seek, pause or failure moves to discard such decisions.
    _held: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] | None = None
    _ahead: Ahead | None = None
    _ahead_conn: Any = None
    _epoch: int = 0
    _poll_failure: Exception | None = None  # the poll made ahead failed: raised by run()

    def __post_init__(self) -> None:
        self._rows = RowCache(self.settings.processor_row_cache)

    @property
    def _drain_timeout(self) -> float:
        return self.settings.kafka_request_timeout_ms / 1000

    @property
    def input_topics(self) -> list[str]:
        return [self.settings.topic_commands, self.settings.topic_observations]

    def _new_producer(self) -> AIOKafkaProducer:
        return AIOKafkaProducer(
            **kafka_client_args(self.settings, "processor"),
            enable_idempotence=True,
            acks="all",
            linger_ms=2,
            max_batch_size=256 * 1024,
            request_timeout_ms=self.settings.kafka_request_timeout_ms,
        )

    async def start(self) -> None:
        collect_less_often()
        self._owned = set()
        # Refuse another log than the stored offsets belong to before joining the group.
        identity = await read_log_identity(
            kafka_client_args(self.settings, "processor"), self.input_topics
        )
        await check_log_identity(self.pool, identity)
        self.producer = self._new_producer()
        await self.producer.start()
        for topic in self.input_topics:  # waits for the topic's metadata
            self._check_partition_count(topic, len(await self.producer.partitions_for(topic)))
        async with self.pool.acquire() as conn:
            await self._check_stored_partitioning(conn)
        self.consumer = AIOKafkaConsumer(
            **kafka_client_args(self.settings, "processor"),
            group_id=self.settings.processor_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            partition_assignment_strategy=(RangePartitionAssignor,),
            max_partition_fetch_bytes=4 * 1024 * 1024,
            fetch_max_wait_ms=self.settings.processor_fetch_max_wait_ms,
            fetch_max_bytes=16 * 1024 * 1024,
            client_id=self.name,
            request_timeout_ms=self.settings.kafka_request_timeout_ms,
            session_timeout_ms=self.settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=max(300, self.settings.kafka_session_timeout_ms // 4),
            # Fresh metadata often enough to notice a changed partition count soon.
            metadata_max_age_ms=5000,
        )
        self.consumer.subscribe(self.input_topics, listener=_Rebalance(self))
        await self.consumer.start()

    async def stop(self) -> None:
        # What is not acknowledged stays in the outbox (sends to an unreachable broker would
        # otherwise be awaited for as long as it is gone).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.drain(), timeout=self._drain_timeout)
        if self._lag_commit is not None:
            self._lag_commit.cancel()
            await asyncio.wait([self._lag_commit])
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()
        if self._confirmer is not None:
            self._confirmer.cancel()
            await asyncio.wait([self._confirmer])
        for conn in (self._conn, self._cursor_conn, self._ahead_conn):
            if conn is not None:  # one whose session was lost is back in its pool already
                with contextlib.suppress(*CONNECTION_ERRORS):
                    await self.pool.release(conn)
        self._conn = self._cursor_conn = self._ahead_conn = None

    async def run(self, stop: asyncio.Event) -> None:
        assert self.consumer is not None
        while not stop.is_set():
            try:
                self._raise_assign_failure()
                self._raise_publish_failure()  # noticed when idle too, not only by a batch
                for topic in self.input_topics:
                    found = self.consumer.partitions_for_topic(topic)
                    if found is not None:
                        self._check_partition_count(topic, len(found))
                if self._poll_failure is not None:  # the poll made ahead failed
                    failure, self._poll_failure = self._poll_failure, None
                    raise failure
                batch = await self._next_poll()
                if self._inputs_lost is not None:  # found by the assignment inside getmany
                    raise self._inputs_lost
                if self._stopped:
                    await self._resume_released()
                if batch:
                    self._raise_assign_failure()  # a failed callback ran during the poll
                    await self.process(batch)
                elif self._gaps:
                    await self.republish_gaps()
            except Exception as exc:
                lost = backend_lost(exc)
                if lost is None:
                    raise
                log.warning("%s lost %s (%r); resuming once it is back", self.name, lost, exc)
                self._resuming = lost
                try:
                    await self._resume(stop, restart_producer=lost == "Kafka")
                finally:
                    self._resuming = None

    async def _next_poll(self) -> Poll:
        """The poll taken during the last write, if any, with what was fetched since (unless
        it was decided ahead: that decision holds for exactly its records)."""
        assert self.consumer is not None
        held = self._take_held()
        if held is None:
            polled: Poll = await self.consumer.getmany(
                timeout_ms=self.poll_timeout_ms, max_records=self.max_records
            )
            return polled
        room = self.max_records - count(held)
        if self._ahead is not None or room <= 0:
            return held
        return added(held, await self.consumer.getmany(timeout_ms=0, max_records=room))

    def health(self) -> tuple[str | None, dict[str, Any]]:
        """Why this processor is not doing its work now (None: it is), and its partitions."""
        owned = sorted(self._owned or ())
        detail = {"partitions": owned, "stopped_partitions": sorted(self._stopped)}
        if not self._joined:
            return "not assigned partitions yet", detail
        if self._inputs_lost is not None:
            return str(self._inputs_lost), detail
        if self._resuming is not None:
            return f"waiting for {self._resuming} to come back", detail
        if self._stopped:
            return (
                f"partitions {sorted(self._stopped)} stopped at a record PostgreSQL refuses "
                "(`sandstream processor skip`)",
                detail,
            )
        return None, detail

    def _check_partition_count(self, topic: str, found: int) -> None:
        expected = self.settings.kafka_partitions
        if found != expected:
            raise PartitionCountChanged(
                f"input topic {topic} has {found} partitions but the log is partitioned into "
                f"{expected} (SANDSTREAM_KAFKA_PARTITIONS): every sandbox lives in partition "
                f"murmur2(key) % {expected}, and another count would move sandboxes between "
                "partitions and break their order. Refusing to run; restore the partition "
                "count (see docs/operations.md)"
            )

    async def _check_stored_partitioning(self, conn: Any) -> None:
        """The stored rows were written from the partitions the configured count implies."""
        rows = await conn.fetch("SELECT key, partition FROM sandboxes LIMIT 100")
        n = self.settings.kafka_partitions
        for r in rows:
            if r["partition"] != partition_for(r["key"].encode(), n):
                raise PartitionCountChanged(
                    f"sandbox {r['key']!r} was written from partition {r['partition']}, but "
                    f"with {n} partitions (SANDSTREAM_KAFKA_PARTITIONS) it belongs on "
                    f"{partition_for(r['key'].encode(), n)}: the input topics' partition count "
                    "changed since the rows were written. Refusing to run (see "
                    "docs/operations.md)"
                )

    async def _resume(self, stop: asyncio.Event, *, restart_producer: bool) -> None:
        """Start over from what PostgreSQL holds, as after a rebalance.

        Whether the last write committed (or the last records were sent) is unknown, so every
        assigned partition goes back to its stored offsets (what committed is then skipped as
        a redelivery), and everything above the publish cursors is published again (at least
        once, as after a crash). Retries with a bounded back-off, one log line per attempt.
        """
        assert self.consumer is not None
        await self._forget_connections()
        producer_ok = not restart_producer
        delay = 0.2
        while not stop.is_set():
            try:
                if not producer_ok:
                    await self._restart_producer()
                    producer_ok = True
                await self.on_assigned(set(self.consumer.assignment()))
            except Exception as exc:
                lost = backend_lost(exc)
                if lost is None:
                    raise
                if lost == "Kafka":
                    producer_ok = False
                log.info("%s: %s still unavailable (%r); retrying in %.1fs",
                         self.name, lost, exc, delay)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                delay = min(delay * 2, 5.0)
                continue
            log.info("%s resumed from the offsets stored in PostgreSQL", self.name)
            return

    async def _restart_producer(self) -> None:
        """A new idempotent producer: the old one's sequence state is unknown after errors."""
        old, self.producer = self.producer, None
        if old is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.stop(), timeout=5.0)
        producer = self._new_producer()
        try:
            await producer.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await producer.stop()
            raise
        self.producer = producer

    async def _forget_connections(self) -> None:
        """Drop the dead connections and the acknowledgements still awaited on them."""
        if self._confirmer is not None:
            self._confirmer.cancel()
            await asyncio.wait([self._confirmer])  # its end, without its CancelledError
        self._confirmer = None
        self._unconfirmed = asyncio.Queue()
        self._publish_failure = None
        self._assign_failure = None
        self._poll_failure = None
        self._rows.clear()
        self._drop_held()  # every assigned partition is sought again (on_assigned)
        for conn in (self._conn, self._cursor_conn, self._ahead_conn):
            # A closed connection goes back to its pool by itself (which then opens a new
            # one); terminating one that still looks alive does the same.
            with contextlib.suppress(*CONNECTION_ERRORS):
                if conn is not None:
                    conn.terminate()
        self._conn = self._cursor_conn = self._ahead_conn = None

    async def process(self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> int:
        """Apply one poll's records exactly once; returns how many were applied."""
        merged = by_partition_of(batch)
        if not merged:
            return 0
        applied = await self.process_records(merged, poll_ahead(batch, self.max_records))
        self._commit_to_kafka(batch)
        return applied

    async def process_partition(
        self, partition: int, records: Sequence[ConsumerRecord[bytes, bytes]]
    ) -> int:
        return await self.process_records({partition: records})

    async def process_records(
        self,
        by_partition: Mapping[int, Sequence[ConsumerRecord[bytes, bytes]]],
        ahead: PollAhead = PollAhead.NONE,
    ) -> int:
        """Apply the records; ``ahead`` says what becomes of the next poll while this one's
        write is in flight (see ``_write``)."""
        async with self._lock:
            self._raise_publish_failure()
            await self._republish_gaps()
            if self._inputs_lost is not None:  # a batch fetched while it was found
                raise self._inputs_lost
            if self._owned is not None:  # revoked while this batch waited for the lock
                dropped = [p for p in by_partition if p not in self._owned]
                if dropped:
                    log.info("%s: dropping polled records of partitions %s it no longer owns",
                             self.name, dropped)  # fmt: skip
            applied, outbox = await self._apply(self._to_apply(by_partition), ahead)
            await self._publish(outbox)
            return applied

    def _to_apply(
        self, by_partition: Mapping[int, Sequence[ConsumerRecord[bytes, bytes]]]
    ) -> list[ConsumerRecord[bytes, bytes]]:
        """The records to apply, partition by partition: those of partitions owned and not
        stopped."""
        return [
            r
            for p in sorted(by_partition)
            if (self._owned is None or p in self._owned) and p not in self._stopped
            for r in by_partition[p]
        ]

    async def _apply(
        self, records: Sequence[ConsumerRecord[bytes, bytes]], ahead: PollAhead = PollAhead.NONE
    ) -> tuple[int, list[tuple[int, OutboxRecord]]]:
        """Apply ``records`` (partition by partition, each in order) exactly once.

        A write PostgreSQL refuses for what a record holds is split in two, each half applied
        in order, until the record(s) causing it are found: each is dead-lettered with the
        database's message. A record whose dead letter is refused too stops its partition.
        """
        records = [r for r in records if r.partition not in self._stopped]
        if not records:
            return 0, []
        try:
            return await self._apply_once(records, poll=ahead)
        except WriteRefused as exc:
            if len(records) > 1:
                half = len(records) // 2
                first = await self._apply(records[:half])
                second = await self._apply(records[half:])
                return first[0] + second[0], first[1] + second[1]
            refusal = str(exc)
        reason = f"PostgreSQL refused to store it: {refusal}"
        log.warning("%s: dead-lettering %s[%d]@%d: %s", self.name, records[0].topic,
                    records[0].partition, records[0].offset, reason)  # fmt: skip
        try:
            return await self._apply_once(records, dead_letter=reason)
        except WriteRefused as exc:
            await self._stop_partition(records[0], f"{reason}; its dead letter too: {exc}")
            return 0, []

    async def _apply_once(
        self,
        records: Sequence[ConsumerRecord[bytes, bytes]],
        dead_letter: str | None = None,
        poll: PollAhead = PollAhead.NONE,
    ) -> tuple[int, list[tuple[int, OutboxRecord]]]:
        started = asyncio.get_running_loop().time()
        if self._conn is None:  # a connection of its own: no pool round trips per batch
            self._conn = await self._batch_connection()
        ahead = self._take_ahead(records) if poll is not PollAhead.NONE else None
        inputs = ahead.inputs if ahead is not None else self._inputs(records, dead_letter)
        decided = ahead.decided if ahead is not None else None
        # Optimistic: read, decide, then write only if no other writer moved these partitions'
        # offsets in between (two round trips in all). Whoever loses the race reads again; its
        # records below the winner's offsets are then skipped.
        while True:
            if decided is None:
                decided = await self._decide(self._conn, inputs)
                if decided is None:
                    return 0, []
            try:
                ids = await self._write(decided, poll)
            except OffsetsMoved as exc:
                metrics.WRITE_CONFLICTS.inc()
                log.info("%s: another writer moved the offsets, deciding again: %s", self.name, exc)
                self._rows.clear()
                decided = None
                continue
            except RowVersionMoved as exc:
                # Only a sandbox written from two partitions gets here: loud, and decided
                # again from the stored row, so no update is lost.
                metrics.ROW_VERSION_CONFLICTS.inc()
                log.error("%s: %s; deciding the batch again from the stored rows", self.name, exc)
                self._rows.clear()
                decided = None
                continue
            except Exception as exc:
                if database_gone(exc) or not refused_for_content(exc):
                    raise
                raise WriteRefused(str(exc)) from exc
            break
        plan, where = decided.plan, inputs.where
        committed = {tp: new for tp, (_, new) in plan.offsets.items()}
        self._rows.remember(
            ((where[key], key, row) for key, row in decided.result.states.items() if key in where),
            committed,
        )
        for disposition, count in Counter(h.disposition for h in plan.history).items():
            metrics.INPUTS.labels(disposition).inc(count)
        metrics.BATCH_SECONDS.observe(asyncio.get_running_loop().time() - started)
        return len(decided.items), list(zip(ids, plan.outbox, strict=True))

    async def _batch_connection(self) -> Any:
        conn = await self.pool.acquire()
        await conn.execute(BATCH_SESSION)
        return conn

    def _inputs(
        self, records: Sequence[ConsumerRecord[bytes, bytes]], dead_letter: str | None = None
    ) -> Inputs:
        items: list[Parsed | Rejected] = (
            self._parsed(records)
            if dead_letter is None
            else [Rejected(r, dead_letter) for r in records]
        )
        return inputs_of(list(records), items, self.input_topics)

    def _parsed(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[Parsed | Rejected]:
        n, placed = self.settings.kafka_partitions, self._placed
        if len(placed) > _PLACED_KEYS:
            placed.clear()
        return [parse(r, self.settings.topic_commands, n, placed) for r in records]

    async def _decide(
        self, conn: Any, inputs: Inputs, after: Decided | None = None
    ) -> Decided | None:
        """Read what ``inputs`` need and decide them (None: nothing of them is left to write).

        With ``after``, as of that batch committed (it is being written meanwhile): its rows,
        outcomes and history heads replace those read, and its new offsets those it read. Then
        None also means that view cannot be had (someone else moved its partitions, or kept
        rows went stale); the inputs are decided again once it committed.
        """
        where = inputs.where
        while True:
            overlaid = {} if after is None else after.states_for(where)
            cached = self._rows.lookup((p, key) for key, p in where.items() if key not in overlaid)
            wanted = where.keys() - cached.keys() - overlaid.keys()
            read = await read_batch(conn, inputs.partitions, wanted, inputs.idents, inputs.chains)
            view = View.of(read) if after is None else View.after(read, after.plan)
            if view is None:
                return None
            if self._rows.check(view.cache_offsets) & {where[key] for key in cached}:
                if after is not None:
                    return None
                continue  # cached rows of a partition someone else wrote: read them instead
            items = [i for i in inputs.items if i.record.offset >= view.offsets[_tp(i.record)]]
            if after is None and len(items) < len(inputs.items):
                metrics.FENCED.inc(len(inputs.items) - len(items))
            if not items:
                return None
            args = (items, {**read.sandboxes, **cached, **overlaid}, view, self.settings)
            if after is None:
                return decide_batch(*args)
            # In slices, so the event loop keeps driving the write in flight (a statement and
            # two COPYs: a round trip each) instead of waiting for the whole decision.
            return await decide_batch_yielding(*args)

    async def _write(self, decided: Decided, poll: PollAhead) -> list[int]:
        """Write a decided batch; meanwhile take the next poll (FETCH) and decide it (DECIDE).

        The next poll (only what the consumer has already fetched) is decided as of this batch
        committed, and kept only if it did: any failure here, and any rebalance, seek, pause
        or lost connection before the next batch is applied, discards it (``_take_ahead``), and
        its records are decided again from what PostgreSQL then holds. Its write also compares
        and sets the offsets this one moves them to, so it never lands on another state.
        """
        write = asyncio.ensure_future(write_batch(self._conn, decided.plan))
        ahead = None
        try:
            if poll is PollAhead.DECIDE and self.settings.processor_decide_ahead:
                ahead = await self._decide_ahead(decided)
            elif poll is not PollAhead.NONE:
                await self._fetch_during(write)
            ids = await write
        except BaseException:
            if not write.done():
                write.cancel()
                await asyncio.wait([write])
            self._discard_ahead()
            raise
        self._ahead = ahead
        return ids

    async def _fetch_during(self, write: asyncio.Future[list[int]]) -> None:
        """Take what the consumer fetches until ``write`` is done (held: applied next).

        The poll is never waited for on its own: during a rebalance it waits for the new
        assignment, which waits for this batch, so it is dropped when the write is done.
        """
        while self.consumer is not None and not write.done() and not self._reassigning():
            room = self.max_records - count(self._held or {})
            if room <= 0:
                return
            fetch = asyncio.ensure_future(
                self.consumer.getmany(timeout_ms=_FETCH_WAIT_MS, max_records=room)
            )
            try:
                await asyncio.wait([write, fetch], return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not fetch.done():  # records are only ever taken by a poll that returns
                    fetch.cancel()
                    await asyncio.wait([fetch])
            if fetch.cancelled():
                return
            failure = fetch.exception()
            if isinstance(failure, Exception):  # raised by the poll loop
                self._poll_failure = failure
                return
            if failure is not None:
                raise failure
            if not (batch := fetch.result()):
                return
            self._held = added(self._held, batch)

    async def _decide_ahead(self, inflight: Decided) -> Ahead | None:
        """Poll what the consumer holds and decide it as of ``inflight`` committed."""
        if self.consumer is None or self._held is not None or self._reassigning():
            return None
        epoch = self._epoch  # anything that moves it meanwhile discards this decision too
        try:
            batch = await self.consumer.getmany(timeout_ms=0, max_records=self.max_records)
        except Exception as exc:  # raised by the poll loop, as its own poll would have
            self._poll_failure = exc
            return None
        if not batch:
            return None
        self._held = batch  # applied next whatever happens to the decision
        records = self._to_apply(by_partition_of(batch))
        if not records:
            return None
        try:
            if self._ahead_conn is None:
                self._ahead_conn = await self._batch_connection()
            await asyncio.sleep(0)  # the write in flight sends its statement first
            items: list[Parsed | Rejected] = []
            for start in range(0, len(records), _SLICE):
                items += self._parsed(records[start : start + _SLICE])
                await asyncio.sleep(0)
            inputs = inputs_of(records, items, self.input_topics)
            decided = await self._decide(self._ahead_conn, inputs, after=inflight)
        except Exception as exc:  # decided again after the write, as without overlap
            log.info("%s: could not decide the next poll ahead (%r)", self.name, exc)
            if self._ahead_conn is not None and database_gone(exc):
                with contextlib.suppress(*CONNECTION_ERRORS):
                    self._ahead_conn.terminate()
                self._ahead_conn = None
            return None
        if decided is None:
            return None
        metrics.DECIDED_AHEAD.labels("decided").inc()
        return Ahead(inputs, decided, epoch)

    def _reassigning(self) -> bool:
        """Whether the group is rebalancing. A poll then waits for the new assignment, which
        waits for this processor's rebalance callbacks, which wait for the batch in hand: the
        poll ahead must not be made (nothing yields between this check and that wait)."""
        subscription = getattr(self.consumer, "_subscription", None)
        return subscription is None or bool(subscription.reassignment_in_progress)

    def _take_ahead(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> Ahead | None:
        """The decision made ahead for exactly ``records``, if nothing invalidated it since."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.epoch == self._epoch and same_records(ahead.inputs.records, records):
            metrics.DECIDED_AHEAD.labels("written").inc()
            return ahead
        return None

    def _discard_ahead(self) -> None:
        """Whatever was decided ahead no longer holds (the state it assumed may not be)."""
        self._epoch += 1
        self._ahead = None

    def _take_held(self) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] | None:
        held, self._held = self._held, None
        return held

    def _drop_held(self, partitions: set[int] | None = None) -> None:
        """Forget held records of ``partitions`` (all: None) once they are sought again."""
        self._discard_ahead()
        if self._held is not None:
            self._held = {
                tp: rs
                for tp, rs in self._held.items()
                if partitions is not None and tp.partition not in partitions
            } or None

    async def _publish(self, records: Sequence[tuple[int, OutboxRecord]]) -> None:
        """Hand outbox records to the producer in commit order; acks are awaited off the path.

        The producer keeps per-partition order, so the next batch may be applied while these
        are in flight. The confirmer awaits the handed-over batches in the same order and moves
        the publish cursors only past records that are all acknowledged.
        """
        if not records:
            return
        if self.producer is None:
            raise KafkaTimeoutError("no producer (being restarted)")
        place = await self._placer({rec.topic for _, rec in records})
        if len(records) > _SEND_ONE_BY_ONE:
            futures = await self._send_batched([rec for _, rec in records], place)
        else:  # appended to the producer's open batches, without waiting for one to drain
            send = self.producer.send
            futures = [
                await send(rec.topic, value=rec.value, key=rec.key, partition=place(rec))
                for _, rec in records
            ]
        sent: dict[int, list[int]] = defaultdict(list)
        for outbox_id, rec in records:
            sent[rec.partition].append(outbox_id)
        self._unconfirmed.put_nowait((futures, sent))
        if self._confirmer is None or self._confirmer.done():
            self._confirmer = asyncio.create_task(self._confirm_in_order())

    async def _send_batched(
        self, records: Sequence[OutboxRecord], place: Callable[[OutboxRecord], int | None]
    ) -> list[asyncio.Future[Any]]:
        """Hand records to the producer one batch per topic partition (in order within each),
        each placed where ``send`` would place it: a fraction of ``send``'s cost per record."""
        producer = self.producer
        assert producer is not None
        by_tp: dict[tuple[str, int], list[OutboxRecord]] = defaultdict(list)
        for rec in records:
            found = place(rec)
            if found is None:  # unkeyed: aiokafka's own choice, as send would make it
                found = producer._partition(rec.topic, None, None, None, None, rec.value)
            by_tp[(rec.topic, int(found))].append(rec)
        futures = []
        for (topic, partition), recs in by_tp.items():
            batch = producer.create_batch()
            for rec in recs:
                if batch.append(key=rec.key, value=rec.value, timestamp=None) is None:
                    # Full: send it and start the next (an empty batch takes any one record).
                    futures.append(await producer.send_batch(batch, topic, partition=partition))
                    batch = producer.create_batch()
                    batch.append(key=rec.key, value=rec.value, timestamp=None)
            futures.append(await producer.send_batch(batch, topic, partition=partition))
        return futures

    async def _placer(self, topics: Iterable[str]) -> Callable[[OutboxRecord], int | None]:
        """Where ``send`` would place a record of ``topics``: Kafka's default partitioner for a
        keyed one, remembered per key and partition count (aiokafka's own partitioner runs
        murmur2 in Python for every record); None for an unkeyed one (aiokafka chooses).

        A decided event is keyed by its sandbox, whose input records parse checked are on the
        input partition the event was decided from (``rec.partition``): with as many
        partitions, that is the event's partition too, without hashing its key again."""
        assert self.producer is not None
        memo: dict[str, tuple[int, dict[bytes, int]]] = {}
        for topic in topics:  # each topic's partition count, once per publish
            count = len(await self.producer.partitions_for(topic))
            placed = self._out_placed.setdefault((topic, count), {})
            if len(placed) > _PLACED_KEYS:
                placed.clear()
            memo[topic] = (count, placed)
        events = self.settings.topic_events
        co_partitioned = events in memo and memo[events][0] == self.settings.kafka_partitions

        def place(rec: OutboxRecord) -> int | None:
            if rec.key is None:
                return None
            if co_partitioned and rec.topic == events:
                return rec.partition
            count, placed = memo[rec.topic]
            found = placed.get(rec.key)
            if found is None:
                found = placed[rec.key] = partition_for(rec.key, count)
            return found

        return place

    async def _confirm_in_order(self) -> None:
        """Await handed-over batches in order; one cursor write for all that are ready, at
        most one per ``_CURSOR_EVERY`` unless a drain waits for it."""
        while True:
            futures, sent = await self._unconfirmed.get()
            batches = [(futures, sent)]
            await self._cursor_due()
            while not self._unconfirmed.empty():
                batches.append(self._unconfirmed.get_nowait())
            try:
                if self._publish_failure is None:  # after a failure no cursor may move again
                    acked: dict[int, list[int]] = defaultdict(list)
                    for futures, sent in batches:
                        await asyncio.gather(*futures)
                        for partition, ids in sent.items():
                            acked[partition] += ids
                    if self._cursor_conn is None:
                        self._cursor_conn = await self.pool.acquire()
                    gaps = await mark_published(self._cursor_conn, acked)
                    metrics.PUBLISHED.inc(sum(len(f) for f, _ in batches))
                    if gaps:
                        metrics.OUTBOX_GAPS.inc(len(gaps))
                        log.error("%s: outbox records %s (partition: first id) were committed "
                                  "by another owner and not published; publishing them again",
                                  self.name, gaps)  # fmt: skip
                        self._gaps.update(gaps)
            except Exception as exc:  # surfaced by the next batch: the processor must restart
                self._publish_failure = exc
            finally:
                self._cursor_written = asyncio.get_running_loop().time()
                for _ in batches:
                    self._unconfirmed.task_done()

    async def _cursor_due(self) -> None:
        """Until ``_CURSOR_EVERY`` has passed since the last cursor write, or a drain waits."""
        wait = self._cursor_written + _CURSOR_EVERY - asyncio.get_running_loop().time()
        if wait > 0 and not self._flush.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flush.wait(), wait)

    def _raise_publish_failure(self) -> None:
        if self._publish_failure is not None:
            raise RuntimeError("publishing the outbox failed") from self._publish_failure

    async def drain(self) -> None:
        """Wait until every handed-over outbox record is acknowledged and its cursor moved
        (written at once, not after ``_CURSOR_EVERY``)."""
        self._draining += 1
        self._flush.set()
        try:
            await self._unconfirmed.join()
        finally:
            self._draining -= 1
            if not self._draining:
                self._flush.clear()
        self._raise_publish_failure()

    async def republish_gaps(self) -> None:
        """Publish again (from the cursor) the partitions whose cursor stopped at a gap."""
        async with self._lock:
            await self._republish_gaps()

    async def _republish_gaps(self) -> None:
        while self._gaps:
            partition = self._gaps.pop()
            if self._owned is None or partition in self._owned:
                await self.publish_pending(partition)

    async def publish_pending(self, partition: int) -> int:
        """Publish what a previous owner of the partition committed but did not send."""
        async with self.pool.acquire() as conn:
            pending = await unpublished_outbox(conn, partition)
        await self._publish(pending)
        await self.drain()
        return len(pending)

    async def _stop_partition(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        """Stop one partition at ``record``, visibly; the others and the process go on."""
        p, key = record.partition, printable(record.key)[0]
        async with self.pool.acquire() as conn:
            await record_stop(conn, record.topic, p, record.offset,
                              None if key is None else storable(key), storable(reason))  # fmt: skip
        self._pause(p, record.topic, record.offset)
        log.error("%s: partition %d stopped at %s offset %d, which PostgreSQL refuses to store "
                  "even as a dead letter (%s); skip it with `sandstream processor skip --topic "
                  "%s --partition %d --offset %d`", self.name, p, record.topic, record.offset,
                  reason, record.topic, p, record.offset)  # fmt: skip

    def _pause(self, partition: int, topic: str, offset: int) -> None:
        self._stopped[partition] = (topic, offset)
        self._drop_held({partition})  # fetched past the stop: sought again on release
        metrics.STOPPED_PARTITIONS.labels(topic, str(partition)).set(offset)
        if self.consumer is not None:
            tps = [tp for tp in self.consumer.assignment() if tp.partition == partition]
            self.consumer.pause(*tps)

    def _unpause(self, partition: int) -> None:
        topic, _ = self._stopped.pop(partition)
        with contextlib.suppress(KeyError):
            metrics.STOPPED_PARTITIONS.remove(topic, str(partition))

    async def _resume_released(self) -> None:
        """Resume the stopped partitions an operator skipped or released (checked each second)."""
        assert self.consumer is not None
        now = asyncio.get_running_loop().time()
        if now - self._last_stop_check < 1.0:
            return
        self._last_stop_check = now
        async with self._lock:
            async with self.pool.acquire() as conn:
                still = {s.partition for s in await stopped_partitions(conn, self.input_topics)}
                stored = await stored_offsets(conn, self.input_topics)
            released = [p for p in self._stopped if p not in still]
            for p in released:
                self._unpause(p)
                tps = [tp for tp in self.consumer.assignment() if tp.partition == p]
                for tp in tps:
                    self.consumer.seek(tp, stored.get((tp.topic, p), 0))
                self.consumer.resume(*tps)
                log.info("%s: partition %d resumed", self.name, p)
            if released:
                self._rows.clear()
                self._drop_held(set(released))

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Resume each assigned partition from the offsets stored with the rows."""
        assert self.consumer is not None
        partitions = {tp.partition for tp in assigned}
        async with self._lock:
            self._owned = set()  # owned again only once sought and republished
            # The broker may have been replaced since the last assignment.
            await check_log_identity(
                self.pool, await log_identity_of(self.consumer._client, self.input_topics)
            )
            await self.drain()  # our own in-flight records are not "left behind"
            self._rows.clear()  # rows are read again until this processor writes them
            self._drop_held()  # every assigned partition is sought below
            async with self.pool.acquire() as conn:
                stored = await stored_offsets(conn, self.input_topics)
                stopped = await stopped_partitions(conn, self.input_topics)
            starts = await self.consumer.beginning_offsets(list(assigned)) if assigned else {}
            for tp in assigned:
                self.consumer.seek(tp, stored.get((tp.topic, tp.partition), 0))
            lost = sorted(
                f"{tp.topic} partition {tp.partition} starts at offset {start} but the "
                f"processor has applied it up to {stored.get((tp.topic, tp.partition), 0)}"
                for tp, start in starts.items()
                if start > stored.get((tp.topic, tp.partition), 0)
            )
            if lost:
                self._inputs_lost = InputsLost(
                    f"input records were deleted before they were applied ({'; '.join(lost)}): "
                    "the topics' retention is shorter than the processor's lag. Refusing to "
                    "skip them silently; see docs/operations.md"
                )
                log.error("%s: %s", self.name, self._inputs_lost)
                self.consumer.pause(*assigned)  # nothing more until it stops
            mine = {tp.partition for tp in assigned}
            for p in list(self._stopped):
                self._unpause(p)
            for s in stopped:  # a stopped partition stays stopped across owners and restarts
                if s.partition in mine:
                    self._pause(s.partition, s.topic, s.offset)
            for p in sorted(partitions):
                await self.publish_pending(p)
            self._owned = partitions
            self._assign_failure = None
            self._joined = True
            metrics.ASSIGNED_PARTITIONS.labels("processor").set(len(partitions))
        log.info("%s assigned partitions %s", self.name, sorted(partitions))

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Finish the batch in hand and see its outbox acknowledged, then let the partitions go:
        the next owner finds their cursors past everything this processor published."""
        partitions = {tp.partition for tp in revoked}
        async with self._lock:
            try:
                await asyncio.wait_for(self.drain(), timeout=self._drain_timeout)
            except Exception as exc:  # what is not acknowledged stays for the next owner
                log.warning("%s: outbox not all acknowledged at revoke (%r)", self.name, exc)
            finally:
                if self._owned is not None:
                    self._owned -= partitions
                    metrics.ASSIGNED_PARTITIONS.labels("processor").set(len(self._owned))
                self._rows.clear()
                self._discard_ahead()  # held records of revoked partitions are not applied
        log.info("%s released partitions %s", self.name, sorted(partitions))

    def _raise_assign_failure(self) -> None:
        if self._assign_failure is not None:
            failure, self._assign_failure = self._assign_failure, None
            raise AssignmentFailed("resuming the assigned partitions failed") from failure

    def _commit_to_kafka(
        self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> None:
        """At most once a second, commit the poll's offsets to Kafka in the background.

        PostgreSQL holds the authoritative offsets; this commit only lets Kafka tooling show
        the group's lag, so the next poll does not wait for its round trip to the broker.
        """
        now = asyncio.get_running_loop().time()
        busy = self._lag_commit is not None and not self._lag_commit.done()
        if busy or now - self._last_lag_commit < 1.0:
            return
        self._last_lag_commit = now
        offsets = {tp: records[-1].offset + 1 for tp, records in batch.items() if records}
        self._lag_commit = asyncio.create_task(self._commit_offsets(offsets))

    async def _commit_offsets(self, offsets: dict[TopicPartition, int]) -> None:
        assert self.consumer is not None
        try:
            await self.consumer.commit(offsets)
        except (KafkaError, AssertionError) as exc:
            log.debug("lag commit skipped: %s", exc)


class AssignmentFailed(RuntimeError):
    """The rebalance callback could not seek or republish the assigned partitions."""


def kafka_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a Kafka client error: broker down or restarting,
    a send not acknowledged in time."""
    while exc is not None:
        if isinstance(exc, KafkaError):
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def backend_lost(exc: BaseException) -> str | None:
    """Which backend ``exc`` says was lost ("PostgreSQL" or "Kafka"), or None for a bug."""
    if database_gone(exc):
        return "PostgreSQL"
    if kafka_gone(exc):
        return "Kafka"
    return None


def database_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a lost or refused PostgreSQL connection."""
    while exc is not None:
        if isinstance(exc, CONNECTION_ERRORS):
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    # aiokafka logs and swallows an exception raised here: keep it for the poll loop.
    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        try:
            await self.processor.on_revoked(revoked)
        except Exception as exc:
            self.processor._assign_failure = exc

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        try:
            await self.processor.on_assigned(assigned)
        except Exception as exc:
            log.error("%s: resuming partitions failed: %r", self.processor.name, exc)
            self.processor._assign_failure = exc


async def serve(settings: Settings, stop: asyncio.Event, name: str = "processor") -> None:
    pool = await connect_pool(settings)
    processor = Processor(settings, pool, name=name, max_records=settings.processor_max_records)
    try:
        await processor.start()
        await processor.run(stop)
    finally:
        await processor.stop()
        await pool.close()


def main() -> None:
    """Run one processor until SIGINT/SIGTERM (``python -m services.processor``)."""
    run_until_signalled(serve)
