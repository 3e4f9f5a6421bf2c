"""The lifecycle processor: Kafka in, PostgreSQL rows out, exactly once, then the outbox out.

For each poll (commands and observations are co-partitioned: partition p of both topics is
always assigned together), one transaction locks the offset rows of the polled partitions,
drops records below the stored offsets (redeliveries, or a zombie's stale batch), folds the
rest through the pure core, and writes rows, history, outcomes, outbox and the new offsets.
After commit the new outbox records are sent to Kafka and the per-partition publish cursors
move; a crash in between leaves them unpublished, and whoever is assigned the partition next
publishes them before anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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
from projections.fold import BatchResult, fold
from projections.lifecycle import Message, Sandbox
from projections.store import (
    BatchWrite,
    HistoryRow,
    OutboxRecord,
    load_outcomes,
    load_sandboxes,
    lock_and_load,
    mark_published,
    stored_offsets,
    unpublished_outbox,
    write_batch,
)
from services import metrics
from services.entrypoint import run_until_signalled
from services.settings import Settings

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
    items: Sequence[Parsed | Rejected], result: BatchResult, settings: Settings
) -> BatchWrite:
    """Turn a folded batch into the rows to write (pure).

    ``items`` are the batch's records in fold order; ``result`` the fold of the parsed ones.
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
            )
        )
    return BatchWrite(
        sandboxes=list(changed.values()),
        history=history,
        outcomes=list(result.outcomes.values()),
        outbox=outbox,
        next_offsets=next_offsets,
    )


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
    _in_flight: set[asyncio.Task[None]] = field(default_factory=set)
    _publish_failure: Exception | None = None
    _conn: Any = None
    # The offsets this processor last saw committed, per input partition: while they are
    # still what the lock returns, nobody else wrote those partitions in between.
    _committed: dict[tuple[str, int], int] = field(default_factory=dict)

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
        if self._conn is not None:
            await self.pool.release(self._conn)
            self._conn = None

    async def run(self, stop: asyncio.Event) -> None:
        assert self.consumer is not None
        while not stop.is_set():
            batch = await self.consumer.getmany(
                timeout_ms=self.poll_timeout_ms, max_records=self.max_records
            )
            if batch:
                await self.process(batch)

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
        conn = self._conn
        # Parse first, so the lock and the reads share one round trip.
        all_items = [parse(r, self.settings.topic_commands) for r in records]
        all_parsed = [i for i in all_items if isinstance(i, Parsed)]
        keys = {p.message.key for p in all_parsed}
        idents = {(p.message.key, p.cause.command_id) for p in all_parsed if p.cause.command_id}
        partitions = {(t, p) for p in by_partition for t in self.input_topics}
        async with conn.transaction():
            locked = await lock_and_load(conn, partitions, keys, idents)
            offsets = locked.offsets
            states: dict[str, Sandbox | None] = dict(locked.sandboxes)
            outcomes = locked.outcomes
            if any(self._committed.get(tp) != offset for tp, offset in offsets.items()):
                # Someone else wrote these partitions since our last batch (or this is our
                # first): the reads above may predate it, so read again under the lock.
                states = dict(await load_sandboxes(conn, keys))
                outcomes = await load_outcomes(conn, idents)
            items = [i for i in all_items if i.record.offset >= offsets[_tp(i.record)]]
            if len(items) < len(all_items):
                metrics.FENCED.inc(len(all_items) - len(items))
            if not items:
                self._committed.update(offsets)
                return 0, []
            parsed = [i for i in items if isinstance(i, Parsed)]
            result = fold(states, outcomes, ((p.cause, p.message) for p in parsed))
            plan = plan_batch(items, result, self.settings)
            ids = await write_batch(conn, plan)
        self._committed.update(offsets)
        self._committed.update(plan.next_offsets)
        for disposition, count in Counter(h.disposition for h in plan.history).items():
            metrics.INPUTS.labels(disposition).inc(count)
        metrics.BATCH_SECONDS.observe(asyncio.get_running_loop().time() - started)
        return len(items), list(zip(ids, plan.outbox, strict=True))

    async def _publish(self, records: Sequence[tuple[int, OutboxRecord]]) -> None:
        """Hand outbox records to the producer in commit order; acks are awaited off the path.

        The producer keeps per-partition order, so the next batch may be applied while these
        are in flight; the cursors move only once every record up to them is acknowledged.
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
        task = asyncio.create_task(self._confirm(futures, up_to))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _confirm(self, futures: list[asyncio.Future[Any]], up_to: dict[int, int]) -> None:
        try:
            await asyncio.gather(*futures)
            async with self.pool.acquire() as conn:
                await mark_published(conn, up_to)
            metrics.PUBLISHED.inc(len(futures))
        except Exception as exc:  # surfaced by the next batch: the processor must restart
            self._publish_failure = exc

    def _raise_publish_failure(self) -> None:
        if self._publish_failure is not None:
            raise RuntimeError("publishing the outbox failed") from self._publish_failure

    async def drain(self) -> None:
        """Wait until every handed-over outbox record is acknowledged and its cursor moved."""
        while self._in_flight:
            await asyncio.gather(*list(self._in_flight))
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
            self._committed.clear()  # read rows under the lock until we commit again
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


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        return None

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.processor.on_assigned(assigned)


async def connect_pool(settings: Settings, **kwargs: Any) -> asyncpg.Pool[asyncpg.Record]:
    kwargs.setdefault("server_settings", {"search_path": settings.pg_schema})
    pool = await asyncpg.create_pool(settings.pg_dsn, min_size=2, max_size=8, **kwargs)
    assert pool is not None
    return pool


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


if __name__ == "__main__":
    main()
