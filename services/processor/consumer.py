"""The run loop: pull a poll, process it through the stages, record it with its tracking
position; a lost PostgreSQL or Kafka is ridden out in place. It only wires the stages.

For each poll (commands and observations are co-partitioned: partition p of both topics is
always assigned together): ``intake`` parses and checks the records, ``read`` reads the stored
offsets with the rows and outcomes they need and drops the records below those offsets
(redeliveries, or a zombie's stale batch), ``plan`` folds the rest through the pure core,
``write`` writes rows, history, outcomes, outbox and the new offsets in one statement, only if
the offsets are still those it read (else the poll is decided again), and ``publish`` sends
the new outbox records after commit, moving the per-partition publish cursors; a crash in
between leaves them unpublished, and whoever is assigned the partition next publishes them
before anything else (``ownership``). While a write is in flight, ``ahead`` takes or decides
the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from services.common import metrics
from services.common.database import connect_pool
from services.common.entrypoint import run_until_signalled
from services.common.kafka_clients import kafka_client_args
from services.common.log_identity import check_log_identity, read_log_identity
from services.common.settings import Settings
from services.processor.ahead import PollAhead, Polls, poll_ahead
from services.processor.failures import backend_lost
from services.processor.gc_thresholds import collect_less_often
from services.processor.intake import (
    Intake,
    Owned,
    Poll,
    Record,
    check_partition_count,
    check_stored_partitioning,
    input_topics,
)
from services.processor.ownership import Ownership, Rebalance
from services.processor.publish import HandOver, Publisher
from services.processor.read import InputGap, Reader
from services.processor.row_cache import RowCache
from services.processor.write import Writer

log = logging.getLogger("sandstream.processor")

# What the processor logs when it refuses a poll that does not follow its applied offsets
# (the chaos checker counts these lines).
INPUT_GAP_LOGGED = "reading its partitions again from the offsets stored in PostgreSQL"


@dataclass
class Processor:
    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    max_records: int = 5000
    poll_timeout_ms: int = 20
    name: str = "processor"
    # Serializes applying and publishing with the sweep a rebalance triggers.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _last_lag_commit: float = 0.0
    _lag_commit: asyncio.Task[None] | None = None  # the commit to Kafka in flight, if any
    _resuming: str | None = None  # the backend being waited for after losing it (readiness)
    # Gets each committed decided event as it is sent (``Publisher.publish``): an executor in
    # the same process (``sandstream up``); None: the log alone carries them.
    handoff: HandOver | None = None

    def __post_init__(self) -> None:
        s, pool, name = self.settings, self.pool, self.name
        self.rows = RowCache(s.processor_row_cache)
        self.owned = Owned()
        self.intake = Intake(s)
        self.reader = Reader(s, self.rows)
        self.publisher = Publisher(s, pool, name, self.owned)
        self.polls = Polls(s, pool, name, self.max_records, self.poll_timeout_ms, self.intake,
                           self.reader, self.owned)  # fmt: skip
        self.ownership = Ownership(pool, name, self.input_topics, self._lock, self.owned,
                                   self.rows, self.polls, self.publisher)  # fmt: skip
        self.writer = Writer(pool, name, self.intake, self.reader, self.rows, self.polls,
                             self.ownership)  # fmt: skip

    @property
    def input_topics(self) -> list[str]:
        return input_topics(self.settings)

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        return self.polls.consumer

    @consumer.setter
    def consumer(self, consumer: AIOKafkaConsumer | None) -> None:
        self.polls.consumer = consumer

    @property
    def producer(self) -> AIOKafkaProducer | None:
        return self.publisher.producer

    @producer.setter
    def producer(self, producer: AIOKafkaProducer | None) -> None:
        self.publisher.producer = producer

    def connections(self) -> list[Any]:
        """The PostgreSQL connections the processor holds now (batches, cursors, ahead)."""
        held = (self.writer.conn, self.publisher.cursor_conn, self.polls.conn)
        return [conn for conn in held if conn is not None]

    async def start(self) -> None:
        collect_less_often()
        self.owned.partitions = set()
        # Refuse another log than the stored offsets belong to before joining the group.
        identity = await read_log_identity(
            kafka_client_args(self.settings, "processor"), self.input_topics
        )
        await check_log_identity(self.pool, identity)
        producer = await self.publisher.start()
        for topic in self.input_topics:  # waits for the topic's metadata
            check_partition_count(self.settings, topic, len(await producer.partitions_for(topic)))
        async with self.pool.acquire() as conn:
            await check_stored_partitioning(self.settings, conn)
        await self.polls.start(Rebalance(self.ownership))

    async def stop(self) -> None:
        # What is not acknowledged stays in the outbox (sends to an unreachable broker would
        # otherwise be awaited for as long as it is gone).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.drain(), timeout=self.publisher.drain_timeout)
        if self._lag_commit is not None:
            self._lag_commit.cancel()
            await asyncio.wait([self._lag_commit])
        await self.polls.stop()
        await self.publisher.stop()
        await self.writer.stop()

    async def run(self, stop: asyncio.Event) -> None:
        """Pull, process, record with the tracking position; until ``stop`` is set."""
        assert self.consumer is not None
        while not stop.is_set():
            try:
                self.ownership.raise_assign_failure()
                self.publisher.raise_failure()  # noticed when idle too, not only by a batch
                for topic in self.input_topics:
                    found = self.consumer.partitions_for_topic(topic)
                    if found is not None:
                        check_partition_count(self.settings, topic, len(found))
                self.polls.raise_failure()  # the poll made ahead failed
                batch = await self.polls.next()
                if self.ownership.inputs_lost is not None:  # found by the assignment in getmany
                    raise self.ownership.inputs_lost
                if self.owned.stopped:
                    await self.ownership.resume_released()
                if batch:
                    self.ownership.raise_assign_failure()  # a failed callback ran during the poll
                    await self.process(batch)
                elif self.publisher.gaps:
                    await self.republish_gaps()
            except InputGap as exc:  # records not following the applied offset: none written
                log.warning("%s: %s; %s", self.name, exc, INPUT_GAP_LOGGED)
                metrics.INPUT_GAPS.inc()
                await self._resume(stop, restart_producer=False)  # retried while a backend is away
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

    def health(self) -> tuple[str | None, dict[str, Any]]:
        """Why this processor is not doing its work now (None: it is), and its partitions."""
        stopped = self.owned.stopped
        detail = {"partitions": sorted(self.owned.partitions or ()),
                  "stopped_partitions": sorted(stopped)}  # fmt: skip
        if not self.ownership.joined:
            return "not assigned partitions yet", detail
        if self.ownership.inputs_lost is not None:
            return str(self.ownership.inputs_lost), detail
        if self._resuming is not None:
            return f"waiting for {self._resuming} to come back", detail
        if stopped:
            return (
                f"partitions {sorted(stopped)} stopped at a record PostgreSQL refuses "
                "(`sandstream processor skip`)",
                detail,
            )
        return None, detail

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
                    await self.publisher.restart()
                    producer_ok = True
                await self.ownership.on_assigned(set(self.consumer.assignment()))
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

    async def _forget_connections(self) -> None:
        """Drop the dead connections and the acknowledgements still awaited on them."""
        await self.publisher.forget()
        self.ownership.assign_failure = None
        self.polls.forget()  # every assigned partition is sought again (on_assigned)
        self.rows.clear()
        self.writer.forget()

    async def process(self, batch: Poll) -> int:
        """Apply one poll's records exactly once; returns how many were applied."""
        merged = self.polls.merged(batch)
        if not merged:
            return 0
        applied = await self.process_records(merged, poll_ahead(batch, self.max_records))
        self._commit_to_kafka(batch)
        return applied

    async def process_partition(self, partition: int, records: Sequence[Record]) -> int:
        return await self.process_records({partition: records})

    async def process_records(
        self, by_partition: Mapping[int, Sequence[Record]], ahead: PollAhead = PollAhead.NONE
    ) -> int:
        """Apply the records, then hand their outbox to the producer; ``ahead`` says what
        becomes of the next poll while this one's write is in flight (``Polls.during``)."""
        async with self._lock:
            self.publisher.raise_failure()
            await self.publisher.republish_gaps()
            if self.ownership.inputs_lost is not None:  # a batch fetched while it was found
                raise self.ownership.inputs_lost
            owned = self.owned.partitions
            if owned is not None:  # revoked while this batch waited for the lock
                dropped = [p for p in by_partition if p not in owned]
                if dropped:
                    log.info("%s: dropping polled records of partitions %s it no longer owns",
                             self.name, dropped)  # fmt: skip
            applied, outbox = await self.writer.apply(self.owned.applicable(by_partition), ahead)
            await self.publisher.publish(outbox, self.handoff)
            return applied

    async def drain(self) -> None:
        """Wait until every outbox record handed over is acknowledged and its cursor moved."""
        await self.publisher.drain()

    async def republish_gaps(self) -> None:
        """Publish again (from the cursor) the partitions whose cursor stopped at a gap."""
        async with self._lock:
            await self.publisher.republish_gaps()

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """What a rebalance does before the partitions go (``Ownership.on_revoked``)."""
        await self.ownership.on_revoked(revoked)

    def _commit_to_kafka(self, batch: Poll) -> None:
        """At most once a second, commit the poll's offsets to Kafka in the background.

        PostgreSQL holds the authoritative offsets; this commit only lets Kafka tooling show
        the group's lag, so the next poll does not wait for its round trip to the broker. Only
        the partitions whose records were applied: the poll's records of a partition revoked
        or stopped meanwhile were not, and Kafka's offset must never pass PostgreSQL's (a
        consumer assigned the partition starts fetching at Kafka's before it is sought).
        """
        now = asyncio.get_running_loop().time()
        busy = self._lag_commit is not None and not self._lag_commit.done()
        if busy or now - self._last_lag_commit < 1.0:
            return
        offsets = {
            tp: records[-1].offset + 1
            for tp, records in batch.items()
            if records and self.owned.applies(tp.partition)
        }
        if not offsets:
            return
        self._last_lag_commit = now
        self._lag_commit = asyncio.create_task(self._commit_offsets(offsets))

    async def _commit_offsets(self, offsets: dict[TopicPartition, int]) -> None:
        assert self.consumer is not None
        try:
            await self.consumer.commit(offsets)
        except (KafkaError, AssertionError) as exc:
            log.debug("lag commit skipped: %s", exc)


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
