"""Ownership: the input partitions this processor applies (``Owned``), resumed on assignment
from what PostgreSQL holds, let go on revoke once their outbox is acknowledged, and stopped at a
record PostgreSQL refuses even as a dead letter until an operator skips or retries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import asyncpg
from aiokafka import TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from events.codec import storable
from events.deadletter import key_text
from projections.offsets import claim_partitions, stored_offsets
from projections.stopped import record_stop, stopped_partitions
from services.common import metrics
from services.common.log_identity import check_log_identity, log_identity_of
from services.processor.ahead import Polls
from services.processor.intake import Owned, Record
from services.processor.publish import Publisher
from services.processor.row_cache import RowCache

log = logging.getLogger("sandstream.processor")


class InputsLost(RuntimeError):
    """An input partition no longer starts where the processor left it: records it never
    applied were deleted (retention), so going on would silently skip decided inputs."""


class AssignmentFailed(RuntimeError):
    """The rebalance callback could not seek or republish the assigned partitions."""


@dataclass
class Ownership:
    """Assignment, revoke and stopped partitions (the rebalance callbacks run here)."""

    pool: asyncpg.Pool[asyncpg.Record]
    name: str
    topics: list[str]
    lock: asyncio.Lock  # serializes applying and publishing with the sweep a rebalance triggers
    owned: Owned
    rows: RowCache
    polls: Polls
    publisher: Publisher
    inputs_lost: InputsLost | None = None  # found on assignment, raised by the run loop
    assign_failure: BaseException | None = None  # raised from the poll loop
    joined: bool = False  # an assignment was applied since start (readiness)
    _last_stop_check: float = 0.0

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Resume each assigned partition from the offsets stored with the rows.

        Paused until sought, before anything yields: a newly assigned partition has no position,
        so the consumer takes Kafka's committed offset meanwhile and fetches from there, and the
        run loop would hand a poll from there on (held until this callback is done) to the
        write. Where that is above PostgreSQL's, the records between would be skipped.
        """
        consumer = self.polls.consumer
        assert consumer is not None
        consumer.pause(*assigned)
        partitions = {tp.partition for tp in assigned}
        async with self.lock:
            self.owned.partitions = set()  # owned again only once sought and republished
            # The broker may have been replaced since the last assignment.
            identity = await log_identity_of(consumer._client, self.topics)
            await check_log_identity(self.pool, identity)
            await self.publisher.drain()  # our own in-flight records are not "left behind"
            self.rows.clear()  # rows are read again until this processor writes them
            self.polls.drop_held()  # every assigned partition is sought below
            async with self.pool.acquire() as conn:
                # First: a previous owner still writing (it learns of the rebalance late)
                # commits nothing from here on, so the offsets and the outbox read below hold
                # everything it committed, published before anything this processor decides.
                self.owned.epochs = await claim_partitions(
                    conn, [(tp.topic, tp.partition) for tp in assigned]
                )
                stored = await stored_offsets(conn, self.topics)
                stopped = await stopped_partitions(conn, self.topics)
            starts = await consumer.beginning_offsets(list(assigned)) if assigned else {}
            for tp in assigned:
                consumer.seek(tp, stored.get((tp.topic, tp.partition), 0))
            lost = sorted(
                f"{tp.topic} partition {tp.partition} starts at offset {start} but the "
                f"processor has applied it up to {stored.get((tp.topic, tp.partition), 0)}"
                for tp, start in starts.items()
                if start > stored.get((tp.topic, tp.partition), 0)
            )
            if lost:
                self.inputs_lost = InputsLost(
                    f"input records were deleted before they were applied ({'; '.join(lost)}): "
                    "the topics' retention is shorter than the processor's lag. Refusing to "
                    "skip them silently; see docs/operations.md"
                )
                log.error("%s: %s", self.name, self.inputs_lost)
                # Left paused: nothing more until it stops.
            mine = {tp.partition for tp in assigned}
            for p in list(self.owned.stopped):
                self._unpause(p)
            for s in stopped:  # a stopped partition stays stopped across owners and restarts
                if s.partition in mine:
                    self._pause(s.partition, s.topic, s.offset)
            if not lost:  # fetched from the stored offsets while the outbox is republished
                consumer.resume(*(tp for tp in assigned if tp.partition not in self.owned.stopped))
            for p in sorted(partitions):
                await self.publisher.publish_pending(p)
            self.owned.partitions = partitions
            self.assign_failure = None
            self.joined = True
            metrics.ASSIGNED_PARTITIONS.labels("processor").set(len(partitions))
        log.info("%s assigned partitions %s", self.name, sorted(partitions))

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Finish the batch in hand and see its outbox acknowledged, then let the partitions go:
        the next owner finds their cursors past everything this processor published."""
        partitions = {tp.partition for tp in revoked}
        async with self.lock:
            try:
                await asyncio.wait_for(self.publisher.drain(), timeout=self.publisher.drain_timeout)
            except Exception as exc:  # what is not acknowledged stays for the next owner
                log.warning("%s: outbox not all acknowledged at revoke (%r)", self.name, exc)
            finally:
                if self.owned.partitions is not None:
                    self.owned.partitions -= partitions
                    metrics.ASSIGNED_PARTITIONS.labels("processor").set(len(self.owned.partitions))
                self.owned.epochs = {
                    tp: e for tp, e in self.owned.epochs.items() if tp[1] not in partitions
                }
                self.rows.clear()
                self.polls.discard_ahead()  # held records of revoked partitions are not applied
        log.info("%s released partitions %s", self.name, sorted(partitions))

    def taken_over(self, epochs: dict[tuple[str, int], int]) -> set[int]:
        """The partitions another assignment took since this one's (``epochs``: the stored
        ones of those it wrote), let go at once: this processor has not heard of the rebalance
        yet, and any batch of them it writes would be fenced. Their records are dropped until
        an assignment gives them back."""
        moved = {tp[1] for tp, e in epochs.items() if self.owned.epochs.get(tp, e) != e}
        if moved:
            self.owned.epochs = {tp: e for tp, e in self.owned.epochs.items() if tp[1] not in moved}
            if self.owned.partitions is not None:
                self.owned.partitions -= moved
            self.rows.clear()
            self.polls.discard_ahead()
            log.warning("%s: partitions %s were assigned to another processor since this one's "
                        "assignment; letting them go before the rebalance reaches it",
                        self.name, sorted(moved))  # fmt: skip
        return moved

    def raise_assign_failure(self) -> None:
        if self.assign_failure is not None:
            failure, self.assign_failure = self.assign_failure, None
            raise AssignmentFailed("resuming the assigned partitions failed") from failure

    async def stop_partition(self, record: Record, reason: str) -> None:
        """Stop one partition at ``record``, visibly; the others and the process go on."""
        p, key = record.partition, key_text(record.key)
        async with self.pool.acquire() as conn:
            await record_stop(conn, record.topic, p, record.offset,
                              None if key is None else storable(key), storable(reason))  # fmt: skip
        self._pause(p, record.topic, record.offset)
        log.error("%s: partition %d stopped at %s offset %d, which PostgreSQL refuses to store "
                  "even as a dead letter (%s); skip it with `sandstream processor skip --topic "
                  "%s --partition %d --offset %d`", self.name, p, record.topic, record.offset,
                  reason, record.topic, p, record.offset)  # fmt: skip

    def _pause(self, partition: int, topic: str, offset: int) -> None:
        self.owned.stopped[partition] = (topic, offset)
        self.polls.drop_held({partition})  # fetched past the stop: sought again on release
        metrics.STOPPED_PARTITIONS.labels(topic, str(partition)).set(offset)
        consumer = self.polls.consumer
        if consumer is not None:
            tps = [tp for tp in consumer.assignment() if tp.partition == partition]
            consumer.pause(*tps)

    def _unpause(self, partition: int) -> None:
        topic, _ = self.owned.stopped.pop(partition)
        with contextlib.suppress(KeyError):
            metrics.STOPPED_PARTITIONS.remove(topic, str(partition))

    async def resume_released(self) -> None:
        """Resume the stopped partitions an operator skipped or released (checked each second)."""
        consumer = self.polls.consumer
        assert consumer is not None
        now = asyncio.get_running_loop().time()
        if now - self._last_stop_check < 1.0:
            return
        self._last_stop_check = now
        async with self.lock:
            async with self.pool.acquire() as conn:
                still = {s.partition for s in await stopped_partitions(conn, self.topics)}
                stored = await stored_offsets(conn, self.topics)
            released = [p for p in self.owned.stopped if p not in still]
            for p in released:
                self._unpause(p)
                tps = [tp for tp in consumer.assignment() if tp.partition == p]
                for tp in tps:
                    consumer.seek(tp, stored.get((tp.topic, p), 0))
                consumer.resume(*tps)
                log.info("%s: partition %d resumed", self.name, p)
            if released:
                self.rows.clear()
                self.polls.drop_held(set(released))


class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, ownership: Ownership) -> None:
        self.ownership = ownership

    # aiokafka logs and swallows an exception raised here: keep it for the poll loop.
    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        try:
            await self.ownership.on_revoked(revoked)
        except Exception as exc:
            self.ownership.assign_failure = exc

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        try:
            await self.ownership.on_assigned(assigned)
        except Exception as exc:
            log.error("%s: resuming partitions failed: %r", self.ownership.name, exc)
            self.ownership.assign_failure = exc
