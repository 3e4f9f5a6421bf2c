"""Which work is this executor's: the partitions it owns with each one's unfinished intents
(the committable offset), a work item and where it came from, and whether it is closing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import murmur2

from events.topics import record_key
from services.common.settings import Settings
from services.executor.intents import Intent


@dataclass(eq=False)
class PartitionProgress:
    """One assigned partition: the committable offset is the oldest unfinished intent."""

    pending: set[int] = field(default_factory=set)  # enqueued intents not finished yet
    running: set[int] = field(default_factory=set)  # those a worker is executing
    highest_seen: int = -1
    committed: int = -1
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def committable(self) -> int:
        return min(self.pending) if self.pending else self.highest_seen + 1

    def finish(self, offset: int) -> None:
        self.pending.discard(offset)
        self.changed.set()


@dataclass(eq=False)
class WorkItem:
    """An intent queued for its sandbox's worker, and the partition offset it came from."""

    intent: Intent
    tp: TopicPartition | None = None  # None: picked up from a row, not from the log
    offset: int = -1  # below -1: handed over in-process, its offset not known (``Intake.hand``)
    progress: PartitionProgress | None = None
    # A handed-over item's copies read from the log since: finished with it.
    copies: list[int] = field(default_factory=list)
    finished: bool = False

    def finish(self) -> None:
        self.finished = True
        if self.progress is not None:
            self.progress.finish(self.offset)
            for offset in self.copies:
                self.progress.finish(offset)


@dataclass
class Ownership:
    """The partitions of the events topic assigned here (with their progress), and whether
    the executor is closing: only work of an owned partition, while not closing, is run."""

    settings: Settings
    owned: dict[TopicPartition, PartitionProgress] = field(default_factory=dict)
    closing: bool = False
    # Whose metadata says how many partitions the topic has (None: the settings say).
    consumer: AIOKafkaConsumer | None = None

    def partition_of(self, key: str) -> TopicPartition:
        """The partition of the events topic that ``key``'s events go to."""
        topic = self.settings.topic_events
        known = self.consumer.partitions_for_topic(topic) if self.consumer else None
        count = len(known) if known else self.settings.kafka_partitions
        partition = (murmur2(record_key(key)) & 0x7FFFFFFF) % count  # the default partitioner
        return TopicPartition(topic, partition)

    def owns(self, key: str) -> bool:
        """Whether ``key``'s partition of the events topic is assigned here: only its owner
        may act on a sandbox (another executor of the group serves the others)."""
        return self.partition_of(key) in self.owned

    def current(self, item: WorkItem) -> bool:
        """Whether ``item`` is still this executor's to run (not revoked, not shutting down)."""
        if self.closing:
            return False
        if item.tp is None:  # picked up from a row: ours while we own the sandbox's partition
            return self.owns(item.intent.key)
        return self.owned.get(item.tp) is item.progress


async def until_idle(progress: list[PartitionProgress], timeout: float) -> bool:
    """Wait until no intent of ``progress`` is running; False if ``timeout`` passed first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(p.running for p in progress):
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        for p in progress:
            p.changed.clear()
        waits = [asyncio.ensure_future(p.changed.wait()) for p in progress if p.running]
        try:
            await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    return True
