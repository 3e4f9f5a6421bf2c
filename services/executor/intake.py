"""The executor's consumer of the events topic: records decoded into work items for the
sandboxes' queues, the offsets committed per partition, and the rebalances.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from datetime import timedelta
from typing import Literal

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from events.codec import EVENTS, DecodeError, decode
from events.decided import (
    DecidedEvent,
    SandboxDeleteRetried,
    SandboxStopEscalated,
    SandboxStopRetried,
)
from projections.store import DATABASE_ERRORS
from services.common import metrics
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.executor.calls import DriverCalls
from services.executor.intents import Intent, intent_of
from services.executor.progress import Ownership, PartitionProgress, WorkItem, until_idle
from services.executor.queues import SandboxQueues
from services.executor.rows import Pool, progressing_rows

log = logging.getLogger("sandstream.executor")

# How much earlier than its oldest waiting row's decision a new group starts reading: the
# events' record times are the publisher's clock, the rows' the decision's, so allow for skew
# between machines (reading earlier is harmless: the row check drops what is done).
CLOCK_MARGIN = timedelta(minutes=5)

# How many handed-over events wait for their copy from the log at most: one pushed out (its
# copy never came: a send that failed, a partition revoked) is read like any other event
# when its copy comes, and the row check or the reported results drop it.
HANDED_KEPT = 10_000


# What became of an event handed over (``Intake.hand``): queued; not this executor's partition;
# left to the log's copy (a forced kill, an undecodable event); nothing for the driver; already
# asked for by a later event.
Handed = Literal["queued", "not_owned", "left_to_the_log", "asks_nothing", "redundant"]
# Logged once a run of `up` has queued a handed event (the chaos checker counts these lines).
FIRST_QUEUED_LOGGED = "hand-over: the first decided event queued at once"


class Intake:
    """Consumes ``settings.topic_events`` in the executor group (auto-commit off)."""

    def __init__(
        self,
        settings: Settings,
        ownership: Ownership,
        queues: SandboxQueues,
        calls: DriverCalls,
        *,
        revoke_grace: float,
        pool: Pool | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool  # the rows, for a new group's starting position (None: the end)
        self.ownership = ownership
        self.queues = queues
        self.calls = calls
        self.revoke_grace = revoke_grace
        self.consumer: AIOKafkaConsumer | None = None
        self.assigned = asyncio.Event()
        self._kills: set[asyncio.Task[None]] = set()
        # Events handed over in-process, by their bytes, until their copy comes from the log
        # (None: one that asks nothing); each item gets an offset of its own below -1 (never
        # one of the log's).
        self._handed: dict[bytes, WorkItem | None] = {}
        self._handed_offsets = itertools.count(-2, -1)

    async def start(self, assign_timeout: float) -> None:
        """Join the group; returns once partitions are assigned (or after ``assign_timeout``),
        so a new group's starting position is fixed before anything is decided after it."""
        self.consumer = AIOKafkaConsumer(
            **kafka_client_args(self.settings, "executor"),
            group_id=self.settings.executor_group,
            enable_auto_commit=False,
            # A new group's position is set on assignment (``starts``); should a committed
            # offset ever be out of range, the end (never a replay of the whole log).
            auto_offset_reset="latest",
            session_timeout_ms=self.settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=max(300, self.settings.kafka_session_timeout_ms // 4),
        )
        self.ownership.consumer = self.consumer
        self.consumer.subscribe([self.settings.topic_events], listener=_Rebalance(self))
        await self.consumer.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.assigned.wait(), assign_timeout)

    async def poll(self) -> None:
        """Fetch what is there (up to 0.1 s) and queue it: never waits for a driver call."""
        assert self.consumer is not None
        batch = await self.consumer.getmany(timeout_ms=100, max_records=1000)
        for tp, records in batch.items():
            for record in records:
                self.enqueue(tp, record)

    async def stop(self) -> None:
        for task in self._kills:
            task.cancel()
        await asyncio.gather(*self._kills, return_exceptions=True)
        if self.consumer is not None:
            await self.consumer.stop()

    def enqueue(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        progress = self.ownership.owned.get(tp)
        if progress is None or self.ownership.closing:
            return  # not (or no longer) ours: whoever owns the partition gets it
        progress.highest_seen = max(progress.highest_seen, record.offset)
        if self._copy_of_handed(progress, record):
            return
        try:
            event = decode(EVENTS, record.value)
        except (DecodeError, ValidationError) as exc:
            log.error("skipping undecodable event at %s:%d: %s", tp, record.offset, exc)
            return
        if isinstance(event, SandboxStopEscalated):
            progress.pending.add(record.offset)
            kill = asyncio.create_task(self._kill(event, record.offset, progress))
            self._kills.add(kill)
            kill.add_done_callback(self._kills.discard)
            return
        intent = intent_of(event)
        if intent is not None and self._not_redundant(event, intent):
            progress.pending.add(record.offset)
            self.queues.add(WorkItem(intent, tp, record.offset, progress))

    def hand(self, partition: int, value: bytes) -> Handed:
        """An event the processor in this process just committed, before it is sent: queued
        now, a Kafka hop sooner than the log delivers it (``sandstream up``). Its copy from
        the log is then finished with it, not run again (``_copy_of_handed``); a forced kill
        waits for the log (it runs beside the queue, where no copy could find it)."""
        tp = TopicPartition(self.settings.topic_events, partition)
        progress = self.ownership.owned.get(tp)
        if progress is None or self.ownership.closing:
            return "not_owned"  # another executor's (or none's yet): the log delivers it there
        try:
            event = decode(EVENTS, value)
        except (DecodeError, ValidationError):
            return "left_to_the_log"  # the log's copy is logged and skipped
        if isinstance(event, SandboxStopEscalated):
            return "left_to_the_log"
        intent = intent_of(event)
        if intent is None:  # its copy is dropped unread: it asks nothing either
            self._keep_handed(value, None)
            return "asks_nothing"
        if not self._not_redundant(event, intent):  # its copy is asked again
            return "redundant"
        item = WorkItem(intent, tp, next(self._handed_offsets), progress)
        self._keep_handed(value, item)
        self.queues.add(item)
        return "queued"

    def _keep_handed(self, value: bytes, item: WorkItem | None) -> None:
        self._handed[value] = item
        while len(self._handed) > HANDED_KEPT:
            del self._handed[next(iter(self._handed))]

    def _copy_of_handed(
        self, progress: PartitionProgress, record: ConsumerRecord[bytes, bytes]
    ) -> bool:
        """Whether ``record`` is the log's copy of an event handed over here: finished
        with it (at once if it is finished already), so its offset is committed only after
        the handed item's end, as if it had been read from the log."""
        if record.value not in self._handed:
            return False
        twin = self._handed.pop(record.value)
        if twin is None:
            return True  # an event that asks nothing of the driver
        if twin.progress is not progress:
            return False  # handed under an assignment since revoked: read it again
        if not twin.finished:
            progress.pending.add(record.offset)
            twin.copies.append(record.offset)
        return True

    def _not_redundant(self, event: DecidedEvent, intent: Intent) -> bool:
        """False for a retried delete or stop while the operation it retries is queued or
        running here (it could only cut that one's retries short)."""
        if isinstance(event, SandboxDeleteRetried | SandboxStopRetried) and self.queues.doing(
            intent
        ):
            log.info("%s retry %d of %s skipped: its %s is still queued or running",
                     intent.operation, event.deadline.attempt, event.key,
                     intent.operation)  # fmt: skip
            return False
        return True

    async def _kill(
        self, event: SandboxStopEscalated, offset: int, progress: PartitionProgress
    ) -> None:
        """Kill the runtime of the event's generation now, outside the key's queue."""
        progress.running.add(offset)
        try:
            await self.calls.kill(event)
        finally:
            progress.running.discard(offset)
            progress.finish(offset)

    # -- offsets and rebalances --------------------------------------------------------------

    async def commit(self, progress: dict[TopicPartition, PartitionProgress] | None = None) -> None:
        assert self.consumer is not None
        # A copy: a rebalance may revoke partitions while the commit is in flight, and the
        # progress it marks is the one whose offsets were sent.
        chosen = dict(self.ownership.owned if progress is None else progress)
        offsets = {tp: p.committable() for tp, p in chosen.items()}
        offsets = {tp: o for tp, o in offsets.items() if o > max(0, chosen[tp].committed)}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:
            log.warning("offset commit failed (will retry): %s", exc)
            return
        for tp, offset in offsets.items():
            chosen[tp].committed = offset

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        assert self.consumer is not None
        owned = self.ownership.owned
        fresh = []
        for tp in assigned:
            owned.setdefault(tp, PartitionProgress())
            if await self.consumer.committed(tp) is None:
                fresh.append(tp)
        if fresh:
            # Fix a new group's position now (not at its first fetch, which may come after
            # more was decided) and commit it, so a restart resumes from there.
            starts = await self.starts(fresh)
            for tp in fresh:
                self.consumer.seek(tp, starts[tp])
                owned[tp].highest_seen = starts[tp] - 1
            try:
                await self.consumer.commit(starts)
                for tp in fresh:
                    owned[tp].committed = starts[tp]
            except KafkaError as exc:
                log.warning("committing the starting offsets failed (will retry): %s", exc)
        log.info("executor assigned %s", sorted(tp.partition for tp in assigned))
        metrics.ASSIGNED_PARTITIONS.labels("executor").set(len(owned))
        self.assigned.set()

    async def starts(self, fresh: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Where a new group reads each of ``fresh``: from the decision of the oldest row of
        that partition still waiting for a driver call (less ``CLOCK_MARGIN``), else from the
        end. The ends are read before the rows: an intent published after them is read from
        the end anyway, and one published before belongs to a row the read sees."""
        assert self.consumer is not None
        ends: dict[TopicPartition, int] = await self.consumer.end_offsets(fresh)
        if self.pool is None:
            return ends
        try:
            rows = await progressing_rows(self.pool)
        except DATABASE_ERRORS as exc:  # the reconcile loop hands the rows over later
            log.warning("new group: cannot read the waiting rows (%r); starting at the end", exc)
            return ends
        oldest: dict[TopicPartition, int] = {}
        for row in rows:
            tp = self.ownership.partition_of(row.key)
            if tp in ends:
                at = int((row.updated_at - CLOCK_MARGIN).timestamp() * 1000)
                oldest[tp] = min(oldest.get(tp, at), at)
        try:
            found = await self.consumer.offsets_for_times(oldest) if oldest else {}
        except KafkaError as exc:
            log.warning("new group: cannot look up offsets by time (%r); starting at the end", exc)
            return ends
        starts = {tp: min(end, found[tp].offset if found.get(tp) else end)
                  for tp, end in ends.items()}  # fmt: skip
        for tp in sorted(oldest, key=lambda t: t.partition):
            log.info("new group: partition %d starts at offset %d (end %d), at its oldest "
                     "waiting row's intents", tp.partition, starts[tp], ends[tp])  # fmt: skip
        return starts

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Drop the queued intents of ``revoked``, let running ones finish, commit."""
        owned = self.ownership.owned
        gone = {tp: p for tp in revoked if (p := owned.pop(tp, None)) is not None}
        metrics.ASSIGNED_PARTITIONS.labels("executor").set(len(owned))
        if not gone:
            return
        self.queues.wake(set(gone))  # the retry back-off of a revoked intent gives up
        if not await until_idle(list(gone.values()), self.revoke_grace):
            log.warning("revoke: driver calls of %s still running; their results will follow",
                        sorted(tp.partition for tp in gone))  # fmt: skip
        await self.commit(gone)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.intake.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.intake.on_assigned(assigned)
