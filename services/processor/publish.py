"""Publish: the outbox records of committed batches handed to the idempotent producer in commit
order, their acknowledgements awaited off the ordered path, and the per-partition publish
cursors moved only past records that are all acknowledged (ADR 0002) or set aside (too large
for any Kafka record the processor sends: recorded, never sent, never waited for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, KafkaTimeoutError

from events.topics import partition_for
from projections.outbox import mark_published, set_aside_outbox, unpublished_outbox
from projections.store import OutboxRecord
from services.common import metrics
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.processor.failures import PublishRefused, refused_by_kafka, release, terminate
from services.processor.intake import PLACED_KEYS, Owned

log = logging.getLogger("sandstream.processor")

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


# Takes a decided event the processor is about to send, with its partition of the events
# topic: an executor in the same process starts on it a Kafka hop sooner (services/up).
HandOver = Callable[[int, bytes], None]


def new_producer(settings: Settings) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        **kafka_client_args(settings, "processor"),
        enable_idempotence=True,
        acks="all",
        # No linger: a poll's outbox is handed over in one go (its records join the open
        # batches before the sender runs), and while a request is in flight the next polls'
        # records gather behind it anyway; a linger would only delay the commands the outbox
        # carries to another key (a claim's BindSandboxName waits for it).
        linger_ms=0,
        max_batch_size=256 * 1024,
        # Its own check (key, value and a record's overhead) never refuses what ``publish``
        # sends: records above kafka_max_record_bytes are set aside before.
        max_request_size=settings.kafka_max_record_bytes + 1024,
        request_timeout_ms=settings.kafka_request_timeout_ms,
    )


def _size(rec: OutboxRecord) -> int:
    return len(rec.value) + len(rec.key or b"")


@dataclass
class Publisher:
    """One processor's outbox publishing: its producer, the batches handed over and not yet
    acknowledged, and the partitions whose cursor stopped at a gap another owner left."""

    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    name: str
    owned: Owned  # gaps are published again only for partitions still owned
    producer: AIOKafkaProducer | None = None
    # Outbox batches handed to the producer, in commit order, until acknowledged.
    _unconfirmed: asyncio.Queue[tuple[list[asyncio.Future[Any]], dict[int, list[int]]]] = field(
        default_factory=asyncio.Queue
    )
    _confirmer: asyncio.Task[None] | None = None
    _cursor_written: float = 0.0  # the event loop's time of the last cursor write
    _flush: asyncio.Event = field(default_factory=asyncio.Event)  # set while a drain waits
    _draining: int = 0  # drains waiting
    failure: Exception | None = None
    cursor_conn: Any = None  # the confirmer's connection
    gaps: set[int] = field(default_factory=set)  # partitions whose cursor stopped at a gap
    # (output topic, its partition count) -> record key -> partition (the placer's memo)
    _out_placed: dict[tuple[str, int], dict[bytes, int]] = field(default_factory=dict)

    @property
    def drain_timeout(self) -> float:
        return self.settings.kafka_request_timeout_ms / 1000

    async def start(self) -> AIOKafkaProducer:
        self.producer = new_producer(self.settings)
        await self.producer.start()
        return self.producer

    async def restart(self) -> None:
        """A new idempotent producer: the old one's sequence state is unknown after errors."""
        old, self.producer = self.producer, None
        if old is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.stop(), timeout=5.0)
        producer = new_producer(self.settings)
        try:
            await producer.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await producer.stop()
            raise
        self.producer = producer

    async def publish(
        self, records: Sequence[tuple[int, OutboxRecord]], hand: HandOver | None = None
    ) -> None:
        """Hand outbox records to the producer in commit order; acks are awaited off the path.

        The producer keeps per-partition order, so the next batch may be applied while these
        are in flight. The confirmer awaits the handed-over batches in the same order and moves
        the publish cursors only past records that are all acknowledged. ``hand`` gets each
        decided event about to be sent, with its partition (an executor in this process).
        """
        if not records:
            return
        if self.producer is None:
            raise KafkaTimeoutError("no producer (being restarted)")
        sending, limit = records, self.settings.kafka_max_record_bytes
        if any(len(rec.value) + len(rec.key or b"") > limit for _, rec in records):
            sending = await self._set_aside(records)
        try:
            place = await self._placer({rec.topic for _, rec in sending})
            if hand is not None:
                self._hand_over(sending, place, hand)
            if len(sending) > _SEND_ONE_BY_ONE:
                futures = await self._send_batched([rec for _, rec in sending], place)
            else:  # appended to the producer's open batches, without waiting for one to drain
                send = self.producer.send
                futures = [
                    await send(rec.topic, value=rec.value, key=rec.key, partition=place(rec))
                    for _, rec in sending
                ]
        except KafkaError as exc:
            if refused_by_kafka(exc):
                raise _refused(exc) from exc
            raise
        sent: dict[int, list[int]] = defaultdict(list)  # set-aside records' ids too
        for outbox_id, rec in records:
            sent[rec.partition].append(outbox_id)
        self._unconfirmed.put_nowait((futures, sent))
        if self._confirmer is None or self._confirmer.done():
            self._confirmer = asyncio.create_task(self._confirm_in_order())

    def _hand_over(
        self,
        records: Sequence[tuple[int, OutboxRecord]],
        place: Callable[[OutboxRecord], int | None],
        hand: HandOver,
    ) -> None:
        events = self.settings.topic_events
        for _, rec in records:
            if rec.topic == events and (partition := place(rec)) is not None:
                hand(partition, rec.value)

    async def _set_aside(
        self, records: Sequence[tuple[int, OutboxRecord]]
    ) -> list[tuple[int, OutboxRecord]]:
        """Record the records too large to send in ``outbox_set_aside``; the others, to send.

        Kafka could never take them, and waiting for them would hold every later record of
        their partition; they stay in the outbox (docs/operations.md, "Dead letters")."""
        limit = self.settings.kafka_max_record_bytes
        big = [(i, rec) for i, rec in records if _size(rec) > limit]
        reason = f"larger than {limit} bytes (SANDSTREAM_KAFKA_MAX_RECORD_BYTES)"
        async with self.pool.acquire() as conn:
            await set_aside_outbox(conn, big, reason)
        for outbox_id, rec in big:
            metrics.OUTBOX_SET_ASIDE.labels(rec.topic).inc()
            log.error("%s: outbox record %d (%s, key %r, %d bytes) set aside, not sent: %s",
                      self.name, outbox_id, rec.topic, (rec.key or b"")[:100], _size(rec),
                      reason)  # fmt: skip
        return [(i, rec) for i, rec in records if _size(rec) <= limit]

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
            if len(placed) > PLACED_KEYS:
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
                if self.failure is None:  # after a failure no cursor may move again
                    acked: dict[int, list[int]] = defaultdict(list)
                    for futures, sent in batches:
                        await asyncio.gather(*futures)
                        for partition, ids in sent.items():
                            acked[partition] += ids
                    if self.cursor_conn is None:
                        self.cursor_conn = await self.pool.acquire()
                    gaps = await mark_published(self.cursor_conn, acked)
                    metrics.PUBLISHED.inc(sum(len(f) for f, _ in batches))
                    if gaps:
                        metrics.OUTBOX_GAPS.inc(len(gaps))
                        log.error("%s: outbox records %s (partition: first id) were committed "
                                  "by another owner and not published; publishing them again",
                                  self.name, gaps)  # fmt: skip
                        self.gaps.update(gaps)
            except Exception as exc:  # surfaced by the next batch: the processor must restart
                self.failure = exc
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

    def raise_failure(self) -> None:
        if self.failure is not None and refused_by_kafka(self.failure):
            raise _refused(self.failure) from self.failure
        if self.failure is not None:
            raise RuntimeError("publishing the outbox failed") from self.failure

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
        self.raise_failure()

    async def republish_gaps(self) -> None:
        """Publish again (from the cursor) the partitions whose cursor stopped at a gap."""
        while self.gaps:
            partition = self.gaps.pop()
            if self.owned.partitions is None or partition in self.owned.partitions:
                await self.publish_pending(partition)

    async def publish_pending(self, partition: int) -> int:
        """Publish what a previous owner of the partition committed but did not send."""
        async with self.pool.acquire() as conn:
            pending = await unpublished_outbox(conn, partition)
        await self.publish(pending)
        await self.drain()
        return len(pending)

    async def forget(self) -> None:
        """After a lost backend: drop the acknowledgements still awaited and the connection."""
        if self._confirmer is not None:
            self._confirmer.cancel()
            await asyncio.wait([self._confirmer])  # its end, without its CancelledError
        self._confirmer = None
        self._unconfirmed = asyncio.Queue()
        self.failure = None
        terminate(self.cursor_conn)
        self.cursor_conn = None

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
        if self._confirmer is not None:
            self._confirmer.cancel()
            await asyncio.wait([self._confirmer])
        await release(self.pool, self.cursor_conn)
        self.cursor_conn = None


def _refused(exc: BaseException) -> PublishRefused:
    return PublishRefused(
        f"Kafka refuses the outbox records the processor sends ({exc!r}); no retry can change "
        "that: check the processor principal's ACLs and the topics' max.message.bytes (at least "
        "SANDSTREAM_KAFKA_MAX_RECORD_BYTES and a batch's overhead; see docs/operations.md)"
    )
