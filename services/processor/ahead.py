"""Ahead: the processor's polls, and what becomes of the next one while a write is in flight:
taken after a small poll, decided as of that write committed after a large one (the poll-ahead
policy), and dropped as soon as anything that decision assumed moves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from services.common import metrics
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.processor.failures import database_gone, release, terminate
from services.processor.fetch_wait import adapt_fetch_wait
from services.processor.intake import (
    Inputs,
    Intake,
    Item,
    Owned,
    Poll,
    Record,
    by_partition_of,
    inputs_of,
)
from services.processor.plan import SLICE, Decided
from services.processor.read import Reader, batch_connection

log = logging.getLogger("sandstream.processor")

# How long a poll made during a write waits for records (one that finds none ends the polling
# for that write). Dropped as soon as the write is done, so it only bounds a long write's polls.
_FETCH_WAIT_MS = 1000


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
    behind = count(batch) >= min(SLICE, max_records)
    return PollAhead.DECIDE if behind else PollAhead.FETCH


def added(held: Poll | None, batch: Poll) -> Poll:
    """``batch`` polled after ``held``: each partition's records stay in offset order."""
    out = {tp: list(records) for tp, records in (held or {}).items()}
    for tp, records in batch.items():
        out.setdefault(tp, []).extend(records)
    return out


def count(batch: Mapping[TopicPartition, Sequence[object]]) -> int:
    return sum(len(records) for records in batch.values())


def same_records(a: Sequence[Record], b: Sequence[Record]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True, slots=True)
class Ahead:
    """The next poll, decided while the previous write was in flight."""

    inputs: Inputs
    decided: Decided
    epoch: int  # the processor's epoch then: anything that moved it discards this


@dataclass
class Polls:
    """The consumer's polls: the next one, with what was taken or decided during the last write.

    Decided ahead: the poll fetched while the previous write was in flight (``held``, applied
    next), its decision (``ahead``, None once anything invalidated it), the connection it was
    read on, and the epoch a rebalance, seek, pause or failure moves to discard such decisions.
    """

    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    name: str
    max_records: int
    poll_timeout_ms: int
    intake: Intake
    reader: Reader
    owned: Owned
    consumer: AIOKafkaConsumer | None = None
    held: Poll | None = None
    ahead: Ahead | None = None
    conn: Any = None  # the connection polls are decided ahead on
    epoch: int = 0
    failure: Exception | None = None  # the poll made ahead failed: raised by the run loop
    _merged: tuple[Poll, dict[int, list[Record]]] | None = None  # the last poll merged

    async def start(self, listener: ConsumerRebalanceListener) -> None:
        """Join the processors' group on the input topics."""
        self.consumer = AIOKafkaConsumer(
            **kafka_client_args(self.settings, "processor", f"sandstream-{self.name}"),
            group_id=self.settings.processor_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            partition_assignment_strategy=(RangePartitionAssignor,),
            max_partition_fetch_bytes=4 * 1024 * 1024,
            fetch_max_wait_ms=self.settings.processor_fetch_max_wait_ms,
            fetch_max_bytes=16 * 1024 * 1024,
            request_timeout_ms=self.settings.kafka_request_timeout_ms,
            session_timeout_ms=self.settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=max(300, self.settings.kafka_session_timeout_ms // 4),
            # Fresh metadata often enough to notice a changed partition count soon.
            metadata_max_age_ms=5000,
        )
        self.consumer.subscribe(self.intake.topics, listener=listener)
        await self.consumer.start()
        adapt_fetch_wait(
            self.consumer,
            busy_ms=self.settings.processor_fetch_max_wait_ms,
            idle_ms=self.settings.processor_idle_fetch_max_wait_ms,
        )

    async def next(self) -> Poll:
        """The poll taken during the last write, if any, with what was fetched since (unless
        it was decided ahead: that decision holds for exactly its records)."""
        assert self.consumer is not None
        held = self.take_held()
        if held is None:
            polled: Poll = await self.consumer.getmany(
                timeout_ms=self.poll_timeout_ms, max_records=self.max_records
            )
            return polled
        room = self.max_records - count(held)
        if self.ahead is not None or room <= 0:
            return held
        return added(held, await self.consumer.getmany(timeout_ms=0, max_records=room))

    async def during(
        self, write: asyncio.Future[list[int]], inflight: Decided, poll: PollAhead
    ) -> Ahead | None:
        """While ``write`` (of ``inflight``) is in flight: take the next poll (FETCH), or
        decide it as of ``inflight`` committed (DECIDE; returned, to be kept once it did)."""
        if poll is PollAhead.DECIDE and self.settings.processor_decide_ahead:
            return await self.decide_ahead(inflight)
        if poll is not PollAhead.NONE:
            await self.fetch_during(write)
        return None

    async def fetch_during(self, write: asyncio.Future[list[int]]) -> None:
        """Take what the consumer fetches until ``write`` is done (held: applied next).

        The poll is never waited for on its own: during a rebalance it waits for the new
        assignment, which waits for this batch, so it is dropped when the write is done.
        """
        while self.consumer is not None and not write.done() and not self.reassigning():
            room = self.max_records - count(self.held or {})
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
                self.failure = failure
                return
            if failure is not None:
                raise failure
            if not (batch := fetch.result()):
                return
            self.held = added(self.held, batch)

    async def decide_ahead(self, inflight: Decided) -> Ahead | None:
        """Poll what the consumer holds and decide it as of ``inflight`` committed."""
        if self.consumer is None or self.held is not None or self.reassigning():
            return None
        epoch = self.epoch  # anything that moves it meanwhile discards this decision too
        try:
            batch = await self.consumer.getmany(timeout_ms=0, max_records=self.max_records)
        except Exception as exc:  # raised by the poll loop, as its own poll would have
            self.failure = exc
            return None
        if not batch:
            return None
        self.held = batch  # applied next whatever happens to the decision
        records = self.owned.applicable(self.merged(batch))
        if not records:
            return None
        try:
            if self.conn is None:
                self.conn = await batch_connection(self.pool)
            await asyncio.sleep(0)  # the write in flight sends its statement first
            items: list[Item] = []
            for start in range(0, len(records), SLICE):
                items += self.intake.parsed(records[start : start + SLICE])
                await asyncio.sleep(0)
            inputs = inputs_of(records, items, self.intake.topics)
            decided = await self.reader.decide(self.conn, inputs, after=inflight)
        except Exception as exc:  # decided again after the write, as without overlap
            log.info("%s: could not decide the next poll ahead (%r)", self.name, exc)
            if self.conn is not None and database_gone(exc):
                terminate(self.conn)
                self.conn = None
            return None
        if decided is None:
            return None
        metrics.DECIDED_AHEAD.labels("decided").inc()
        return Ahead(inputs, decided, epoch)

    def merged(self, batch: Poll) -> dict[int, list[Record]]:
        """``by_partition_of(batch)``, merged once for a poll decided ahead and then applied."""
        if self._merged is not None and self._merged[0] is batch:
            return self._merged[1]
        merged = by_partition_of(batch)
        self._merged = (batch, merged)
        return merged

    def reassigning(self) -> bool:
        """Whether the group is rebalancing. A poll then waits for the new assignment, which
        waits for this processor's rebalance callbacks, which wait for the batch in hand: the
        poll ahead must not be made (nothing yields between this check and that wait)."""
        subscription = getattr(self.consumer, "_subscription", None)
        return subscription is None or bool(subscription.reassignment_in_progress)

    def take_ahead(self, records: Sequence[Record]) -> Ahead | None:
        """The decision made ahead for exactly ``records``, if nothing invalidated it since."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        if ahead.epoch == self.epoch and same_records(ahead.inputs.records, records):
            metrics.DECIDED_AHEAD.labels("written").inc()
            return ahead
        return None

    def discard_ahead(self) -> None:
        """Whatever was decided ahead no longer holds (the state it assumed may not be)."""
        self.epoch += 1
        self.ahead = None

    def take_held(self) -> Poll | None:
        held, self.held = self.held, None
        return held

    def drop_held(self, partitions: set[int] | None = None) -> None:
        """Forget held records of ``partitions`` (all: None) once they are sought again."""
        self.discard_ahead()
        if self.held is not None:
            self.held = {
                tp: rs
                for tp, rs in self.held.items()
                if partitions is not None and tp.partition not in partitions
            } or None

    def raise_failure(self) -> None:
        if self.failure is not None:  # the poll made ahead failed
            failure, self.failure = self.failure, None
            raise failure

    def forget(self) -> None:
        """After a lost backend: every assigned partition is sought again (on assignment)."""
        self.failure = None
        self.drop_held()
        terminate(self.conn)
        self.conn = None

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
        await release(self.pool, self.conn)
        self.conn = None
