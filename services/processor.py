"""The lifecycle processor: Kafka in, PostgreSQL rows out, exactly once, then the outbox out.

For each partition number of a polled batch (commands and observations are co-partitioned),
one transaction locks the partition's offset rows, drops records below the stored offsets
(redeliveries, or a zombie's stale batch), folds the rest through the pure core, and writes
rows, history, outcomes, outbox and the new offsets. After commit the partition's unpublished
outbox records are sent to Kafka and the publish cursor moves; a crash in between republishes.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import signal
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError

from events.codec import COMMANDS, OBSERVATIONS, DecodeError, check_key, decode, encode, printable
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
    lock_offsets,
    mark_published,
    stored_offsets,
    unpublished_outbox,
    write_batch,
)
from services import metrics
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
        command_id=getattr(message, "command_id", None),
    )
    return Parsed(record, cause, message)


def merge_topics(
    per_topic: Iterable[Sequence[ConsumerRecord[bytes, bytes]]],
) -> list[ConsumerRecord[bytes, bytes]]:
    """Interleave the topics of one partition by record time, keeping each topic's order."""
    return list(heapq.merge(*per_topic, key=lambda r: r.timestamp))


def plan_batch(
    partition: int,
    items: Sequence[Parsed | Rejected],
    result: BatchResult,
    settings: Settings,
) -> BatchWrite:
    """Turn a folded batch into the rows to write (pure)."""
    history: list[HistoryRow] = []
    outbox: list[OutboxRecord] = []
    next_offsets: dict[str, int] = {}
    steps = iter(result.steps)
    changed: dict[str, Sandbox] = {}
    for item in items:
        record = item.record
        next_offsets[record.topic] = max(next_offsets.get(record.topic, 0), record.offset + 1)
        if isinstance(item, Rejected):
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
            outbox.append(OutboxRecord(settings.topic_deadletter, record.key, encode(letter)))
            history.append(
                HistoryRow(
                    key=key_text,
                    topic=record.topic,
                    partition=record.partition,
                    offset=record.offset,
                    message_type=None,
                    command_id=None,
                    disposition="dead-lettered",
                    reason=item.reason,
                    phase=None,
                    generation=None,
                    version=None,
                    event_types=[],
                    message=None,
                    occurred_at=record_time(record),
                )
            )
            continue
        step = next(steps)
        d = step.decision
        state = d.state
        for event in d.events:
            outbox.append(OutboxRecord(settings.topic_events, event.key.encode(), encode(event)))
        if d.events and state is not None:
            changed[state.key] = state
        history.append(
            HistoryRow(
                key=step.message.key,
                topic=record.topic,
                partition=record.partition,
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
    first_outcomes = [o for o in result.outcomes.values()]
    return BatchWrite(
        partition=partition,
        sandboxes=list(changed.values()),
        history=history,
        outcomes=first_outcomes,
        outbox=outbox,
        next_offsets=next_offsets,
    )


@dataclass
class Processor:
    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    max_records: int = 5000
    poll_timeout_ms: int = 20
    name: str = "processor"
    consumer: AIOKafkaConsumer | None = None
    producer: AIOKafkaProducer | None = None
    _locks: dict[int, asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))

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
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()

    async def run(self, stop: asyncio.Event) -> None:
        assert self.consumer is not None
        while not stop.is_set():
            batch = await self.consumer.getmany(
                timeout_ms=self.poll_timeout_ms, max_records=self.max_records
            )
            if batch:
                await self.process(batch)

    async def process(
        self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> None:
        by_partition: dict[int, list[list[ConsumerRecord[bytes, bytes]]]] = defaultdict(list)
        for tp, records in batch.items():
            by_partition[tp.partition].append(records)
        await asyncio.gather(
            *(self.process_partition(p, merge_topics(rs)) for p, rs in by_partition.items())
        )
        await self._commit_to_kafka(batch)

    async def process_partition(
        self, partition: int, records: Sequence[ConsumerRecord[bytes, bytes]]
    ) -> int:
        """Apply one partition's records exactly once; returns how many were applied."""
        async with self._locks[partition]:
            applied = await self._apply(partition, records)
            await self.publish_pending(partition)
            return applied

    async def _apply(self, partition: int, records: Sequence[ConsumerRecord[bytes, bytes]]) -> int:
        started = asyncio.get_running_loop().time()
        async with self.pool.acquire() as conn, conn.transaction():
            offsets = await lock_offsets(conn, partition, self.input_topics)
            fresh = [r for r in records if r.offset >= offsets.get(r.topic, 0)]
            if len(fresh) < len(records):
                metrics.FENCED.inc(len(records) - len(fresh))
            if not fresh:
                return 0
            items = [parse(r, self.settings.topic_commands) for r in fresh]
            parsed = [i for i in items if isinstance(i, Parsed)]
            keys = {p.message.key for p in parsed}
            command_ids = {
                (p.message.key, p.cause.command_id) for p in parsed if p.cause.command_id
            }
            states: dict[str, Sandbox | None] = dict(await load_sandboxes(conn, keys))
            outcomes = await load_outcomes(conn, command_ids)
            result = fold(states, outcomes, ((p.cause, p.message) for p in parsed))
            plan = plan_batch(partition, items, result, self.settings)
            await write_batch(conn, plan)
        for h in plan.history:
            metrics.INPUTS.labels(h.disposition).inc()
        metrics.BATCH_SECONDS.observe(asyncio.get_running_loop().time() - started)
        return len(fresh)

    async def publish_pending(self, partition: int) -> int:
        """Send the partition's unpublished outbox records in order, then move the cursor."""
        assert self.producer is not None
        async with self.pool.acquire() as conn:
            pending = await unpublished_outbox(conn, partition)
            if not pending:
                return 0
            futures = [
                await self.producer.send(rec.topic, value=rec.value, key=rec.key)
                for _, rec in pending
            ]
            await asyncio.gather(*futures)
            await mark_published(conn, partition, pending[-1][0])
        metrics.PUBLISHED.inc(len(pending))
        return len(pending)

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Resume each assigned partition from the offsets stored with the rows."""
        assert self.consumer is not None
        async with self.pool.acquire() as conn:
            stored = await stored_offsets(conn, self.input_topics)
        for tp in assigned:
            self.consumer.seek(tp, stored.get((tp.topic, tp.partition), 0))
        for p in sorted({tp.partition for tp in assigned}):
            async with self._locks[p]:
                await self.publish_pending(p)
        log.info("%s assigned partitions %s", self.name, sorted({tp.partition for tp in assigned}))

    async def _commit_to_kafka(
        self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> None:
        # PostgreSQL holds the authoritative offsets; this commit only lets Kafka tooling
        # show the group's lag.
        assert self.consumer is not None
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
    processor = Processor(settings, pool, name=name)
    try:
        await processor.start()
        await processor.run(stop)
    finally:
        await processor.stop()
        await pool.close()


def main() -> None:
    """Run one processor until SIGINT/SIGTERM (``python -m services.processor``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings()

    async def _run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    asyncio.run(_run())


if __name__ == "__main__":
    main()
