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
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError

from events.codec import COMMANDS, OBSERVATIONS, DecodeError, check_key, decode, encode, printable
from events.commands import CommandBase
from events.common import Cause
from events.deadletter import DeadLetter, SourceRecord
from projections.chain import chain_of, chain_rows
from projections.fold import BatchResult, fold
from projections.lifecycle import Message, Sandbox
from projections.store import (
    CONNECTION_ERRORS,
    BatchWrite,
    HistoryRow,
    OffsetsMoved,
    OutboxRecord,
    mark_published,
    read_batch,
    stored_offsets,
    unpublished_outbox,
    write_batch,
)
from services.common import metrics
from services.common.database import connect_pool
from services.common.entrypoint import run_until_signalled
from services.common.settings import Settings
from services.processor.row_cache import RowCache

log = logging.getLogger("sandstream.processor")


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


def parse(record: ConsumerRecord[bytes, bytes], commands_topic: str) -> Parsed | Rejected:
    adapter: Any = COMMANDS if record.topic == commands_topic else OBSERVATIONS
    try:
        message: Message = decode(adapter, record.value)
        check_key(record.key, message.key)
    except DecodeError as exc:
        return Rejected(record, exc.reason)
    cause = Cause(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        message_type=message.type,
        command_id=message.command_id if isinstance(message, CommandBase) else None,
    )
    return Parsed(record, cause, message)


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
) -> BatchWrite:
    """Turn a folded batch into the rows to write (pure).

    ``items`` are the batch's records in fold order; ``result`` the fold of the parsed ones;
    ``read_offsets`` the offsets they were decided at, which the write compares and sets.
    """
    history: list[HistoryRow] = []
    outbox: list[OutboxRecord] = []
    next_offsets: dict[tuple[str, int], int] = {}
    steps = iter(result.steps)
    changed: dict[str, tuple[int, Sandbox]] = {}
    for item in items:
        record = item.record
        p = record.partition
        tp = (record.topic, p)
        next_offsets[tp] = max(next_offsets.get(tp, 0), record.offset + 1)
        if isinstance(item, Rejected):
            history.append(_dead_letter_history(item))
            outbox.append(_dead_letter(item, settings.topic_deadletter))
            continue
        step = next(steps)
        d = step.decision
        state = d.state
        for event in d.events:
            outbox.append(OutboxRecord(p, settings.topic_events, event.key.encode(), encode(event)))
        if d.events and state is not None:
            changed[state.key] = (p, state)
        history.append(
            HistoryRow(
                key=step.message.key,
                topic=record.topic,
                partition=p,
                offset=record.offset,
                message_type=step.message.type,
                command_id=step.cause.command_id,
                disposition=d.disposition,
                reason=d.reason,
                phase=state.phase.value if state else None,
                generation=state.generation if state else None,
                version=state.version if state else None,
                event_types=[e.type for e in d.events],
                message=record.value.decode() if record.value is not None else None,
                occurred_at=step.message.occurred_at,
                sandbox_id=state.sandbox_id if state else None,
            )
        )
    return BatchWrite(
        sandboxes=list(changed.values()),
        history=history,
        outcomes=list(result.outcomes.values()),
        outbox=outbox,
        offsets={tp: (at, next_offsets.get(tp, at)) for tp, at in read_offsets.items()},
    )


def history_key(item: Parsed | Rejected) -> str | None:
    """The key an item's history entry is recorded under."""
    return item.message.key if isinstance(item, Parsed) else printable(item.record.key)[0]


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


def _dead_letter_history(item: Rejected) -> HistoryRow:
    record = item.record
    return HistoryRow(
        key=printable(record.key)[0], topic=record.topic, partition=record.partition,
        offset=record.offset, message_type=None, command_id=None, disposition="dead-lettered",
        reason=item.reason, phase=None, generation=None, version=None, event_types=[],
        message=None, occurred_at=record_time(record),
    )  # fmt: skip


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
    # Outbox batches handed to the producer, in commit order, until acknowledged.
    _unconfirmed: asyncio.Queue[tuple[list[asyncio.Future[Any]], dict[int, int]]] = field(
        default_factory=asyncio.Queue
    )
    _confirmer: asyncio.Task[None] | None = None
    _publish_failure: Exception | None = None
    _conn: Any = None  # the batches' connection
    _rows: RowCache = field(init=False)
    _cursor_conn: Any = None  # the confirmer's connection

    def __post_init__(self) -> None:
        self._rows = RowCache(self.settings.processor_row_cache)

    @property
    def input_topics(self) -> list[str]:
        return [self.settings.topic_commands, self.settings.topic_observations]

    async def start(self) -> None:
        self.producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            enable_idempotence=True,
            acks="all",
            linger_ms=2,
            max_batch_size=256 * 1024,
        )
        await self.producer.start()
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            group_id=self.settings.processor_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            partition_assignment_strategy=(RangePartitionAssignor,),
            max_partition_fetch_bytes=4 * 1024 * 1024,
            fetch_max_wait_ms=self.settings.processor_fetch_max_wait_ms,
            fetch_max_bytes=16 * 1024 * 1024,
            client_id=self.name,
            session_timeout_ms=self.settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=max(300, self.settings.kafka_session_timeout_ms // 4),
        )
        self.consumer.subscribe(self.input_topics, listener=_Rebalance(self))
        await self.consumer.start()

    async def stop(self) -> None:
        with contextlib.suppress(Exception):  # what is not acknowledged stays in the outbox
            await self.drain()
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()
        if self._confirmer is not None:
            self._confirmer.cancel()
            await asyncio.wait([self._confirmer])
        for conn in (self._conn, self._cursor_conn):
            if conn is not None:  # one whose session was lost is back in its pool already
                with contextlib.suppress(asyncpg.InterfaceError):
                    await self.pool.release(conn)
        self._conn = self._cursor_conn = None

    async def run(self, stop: asyncio.Event) -> None:
        assert self.consumer is not None
        while not stop.is_set():
            batch = await self.consumer.getmany(
                timeout_ms=self.poll_timeout_ms, max_records=self.max_records
            )
            if not batch:
                continue
            try:
                await self.process(batch)
            except Exception as exc:
                if not database_gone(exc):
                    raise
                log.warning("%s lost PostgreSQL (%s); resuming once it is back", self.name, exc)
                await self._resume_after_database_loss(stop)

    async def _resume_after_database_loss(self, stop: asyncio.Event) -> None:
        """Start over from what PostgreSQL holds, as after a rebalance.

        Whether the last write committed is unknown, so every assigned partition goes back to
        its stored offsets (what committed is then skipped as a redelivery), and everything
        above the publish cursors is published again (at least once, as after a crash).
        """
        assert self.consumer is not None
        await self._forget_connections()
        delay = 0.2
        while not stop.is_set():
            try:
                await self.on_assigned(set(self.consumer.assignment()))
            except Exception as exc:
                if not database_gone(exc):
                    raise
                log.info("%s: PostgreSQL still unavailable (%s); retrying in %.1fs",
                         self.name, exc, delay)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                delay = min(delay * 2, 5.0)
                continue
            log.info("%s resumed from the offsets stored in PostgreSQL", self.name)
            return

    async def _forget_connections(self) -> None:
        """Drop the dead connections and the acknowledgements still awaited on them."""
        if self._confirmer is not None:
            self._confirmer.cancel()
            await asyncio.wait([self._confirmer])  # its end, without its CancelledError
        self._confirmer = None
        self._unconfirmed = asyncio.Queue()
        self._publish_failure = None
        self._rows.clear()
        for conn in (self._conn, self._cursor_conn):
            # A closed connection goes back to its pool by itself (which then opens a new
            # one); terminating one that still looks alive does the same.
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()
        self._conn = self._cursor_conn = None

    async def process(self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> int:
        """Apply one poll's records exactly once; returns how many were applied."""
        by_partition: dict[int, list[list[ConsumerRecord[bytes, bytes]]]] = defaultdict(list)
        for tp, records in batch.items():
            if records:  # getmany can report a partition with nothing new
                by_partition[tp.partition].append(records)
        if not by_partition:
            return 0
        merged = {p: merge_topics(rs) for p, rs in by_partition.items()}
        applied = await self.process_records(merged)
        await self._commit_to_kafka(batch)
        return applied

    async def process_partition(
        self, partition: int, records: Sequence[ConsumerRecord[bytes, bytes]]
    ) -> int:
        return await self.process_records({partition: records})

    async def process_records(
        self, by_partition: Mapping[int, Sequence[ConsumerRecord[bytes, bytes]]]
    ) -> int:
        async with self._lock:
            self._raise_publish_failure()
            applied, outbox = await self._apply(by_partition)
            await self._publish(outbox)
            return applied

    async def _apply(
        self, by_partition: Mapping[int, Sequence[ConsumerRecord[bytes, bytes]]]
    ) -> tuple[int, list[tuple[int, OutboxRecord]]]:
        started = asyncio.get_running_loop().time()
        records = [r for p in sorted(by_partition) for r in by_partition[p]]
        if self._conn is None:  # a connection of its own: no pool round trips per batch
            self._conn = await self.pool.acquire()
        all_items = [parse(r, self.settings.topic_commands) for r in records]
        all_parsed = [i for i in all_items if isinstance(i, Parsed)]
        where = {p.message.key: p.record.partition for p in all_parsed}
        idents = {(p.message.key, p.cause.command_id) for p in all_parsed if p.cause.command_id}
        chains = {chain_of(history_key(i), i.record.partition) for i in all_items}
        partitions = {(t, p) for p in by_partition for t in self.input_topics}
        # Optimistic: read, decide, then write only if no other writer moved these partitions'
        # offsets in between (two round trips in all). Whoever loses the race reads again; its
        # records below the winner's offsets are then skipped.
        while True:
            cached = self._rows.lookup((p, key) for key, p in where.items())
            read = await read_batch(self._conn, partitions, where.keys() - cached, idents, chains)
            if self._rows.check(read.offsets) & {where[key] for key in cached}:
                continue  # cached rows of a partition someone else wrote: read them instead
            items = [i for i in all_items if i.record.offset >= read.offsets[_tp(i.record)]]
            if len(items) < len(all_items):
                metrics.FENCED.inc(len(all_items) - len(items))
            if not items:
                return 0, []
            parsed = [i for i in items if isinstance(i, Parsed)]
            states = {**read.sandboxes, **cached}
            result = fold(
                states,
                read.outcomes,
                ((p.cause, p.message) for p in parsed),
                limits=self.settings.lifecycle_limits,
            )
            plan = plan_batch(items, result, read.offsets, self.settings)
            plan = replace(plan, history=chain_rows(plan.history, read.chain_heads))
            try:
                ids = await write_batch(self._conn, plan)
            except OffsetsMoved as exc:
                metrics.WRITE_CONFLICTS.inc()
                log.info("%s: another writer moved the offsets, deciding again: %s", self.name, exc)
                self._rows.clear()
                continue
            break
        committed = {tp: new for tp, (_, new) in plan.offsets.items()}
        self._rows.remember(
            ((where[key], key, row) for key, row in result.states.items() if key in where),
            committed,
        )
        for disposition, count in Counter(h.disposition for h in plan.history).items():
            metrics.INPUTS.labels(disposition).inc(count)
        metrics.BATCH_SECONDS.observe(asyncio.get_running_loop().time() - started)
        return len(items), list(zip(ids, plan.outbox, strict=True))

    async def _publish(self, records: Sequence[tuple[int, OutboxRecord]]) -> None:
        """Hand outbox records to the producer in commit order; acks are awaited off the path.

        The producer keeps per-partition order, so the next batch may be applied while these
        are in flight. The confirmer awaits the handed-over batches in the same order and moves
        the publish cursors only past records that are all acknowledged.
        """
        if not records:
            return
        assert self.producer is not None
        futures = [
            await self.producer.send(rec.topic, value=rec.value, key=rec.key) for _, rec in records
        ]
        up_to: dict[int, int] = {}
        for outbox_id, rec in records:
            up_to[rec.partition] = max(up_to.get(rec.partition, 0), outbox_id)
        self._unconfirmed.put_nowait((futures, up_to))
        if self._confirmer is None or self._confirmer.done():
            self._confirmer = asyncio.create_task(self._confirm_in_order())

    async def _confirm_in_order(self) -> None:
        """Await handed-over batches in order; one cursor write for all that are ready."""
        while True:
            futures, up_to = await self._unconfirmed.get()
            batches = [(futures, up_to)]
            while not self._unconfirmed.empty():
                batches.append(self._unconfirmed.get_nowait())
            try:
                if self._publish_failure is None:  # after a failure no cursor may move again
                    cursors: dict[int, int] = {}
                    for futures, up_to in batches:
                        await asyncio.gather(*futures)
                        for partition, outbox_id in up_to.items():
                            cursors[partition] = max(cursors.get(partition, 0), outbox_id)
                    if self._cursor_conn is None:
                        self._cursor_conn = await self.pool.acquire()
                    await mark_published(self._cursor_conn, cursors)
                    metrics.PUBLISHED.inc(sum(len(f) for f, _ in batches))
            except Exception as exc:  # surfaced by the next batch: the processor must restart
                self._publish_failure = exc
            finally:
                for _ in batches:
                    self._unconfirmed.task_done()

    def _raise_publish_failure(self) -> None:
        if self._publish_failure is not None:
            raise RuntimeError("publishing the outbox failed") from self._publish_failure

    async def drain(self) -> None:
        """Wait until every handed-over outbox record is acknowledged and its cursor moved."""
        await self._unconfirmed.join()
        self._raise_publish_failure()

    async def publish_pending(self, partition: int) -> int:
        """Publish what a previous owner of the partition committed but did not send."""
        async with self.pool.acquire() as conn:
            pending = await unpublished_outbox(conn, partition)
        await self._publish(pending)
        await self.drain()
        return len(pending)

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Resume each assigned partition from the offsets stored with the rows."""
        assert self.consumer is not None
        async with self._lock:
            await self.drain()  # our own in-flight records are not "left behind"
            self._rows.clear()  # rows are read again until this processor writes them
            async with self.pool.acquire() as conn:
                stored = await stored_offsets(conn, self.input_topics)
            for tp in assigned:
                self.consumer.seek(tp, stored.get((tp.topic, tp.partition), 0))
            for p in sorted({tp.partition for tp in assigned}):
                await self.publish_pending(p)
        log.info("%s assigned partitions %s", self.name, sorted({tp.partition for tp in assigned}))

    async def _commit_to_kafka(
        self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> None:
        # PostgreSQL holds the authoritative offsets; this commit only lets Kafka tooling
        # show the group's lag.
        assert self.consumer is not None
        now = asyncio.get_running_loop().time()
        if now - self._last_lag_commit < 1.0:
            return
        self._last_lag_commit = now
        offsets = {tp: records[-1].offset + 1 for tp, records in batch.items() if records}
        try:
            await self.consumer.commit(offsets)
        except (KafkaError, AssertionError) as exc:
            log.debug("lag commit skipped: %s", exc)


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

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        return None

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.processor.on_assigned(assigned)


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
