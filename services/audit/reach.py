"""How far back the input log still reaches: retention may have deleted its oldest records.

Every audit answer says whether the log still begins at offset 0 on every input partition; if
not, from which offsets on it is complete.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings


@dataclass(frozen=True, slots=True)
class Reach:
    beginnings: dict[tuple[str, int], int]  # first offset still in the log, per input partition

    @property
    def complete(self) -> bool:
        return all(offset == 0 for offset in self.beginnings.values())

    def begins_at(self, topic: str, partition: int) -> int:
        return self.beginnings.get((topic, partition), 0)

    def statement(self) -> str:
        """One plain sentence for the top of every answer."""
        if self.complete:
            return "log reach: the input log still begins at offset 0 on every partition"
        cut = ", ".join(
            f"{t}[{p}] from {o}" for (t, p), o in sorted(self.beginnings.items()) if o > 0
        )
        return (
            "log reach: retention has deleted the oldest input records; the answer is complete "
            f"only from these offsets on: {cut} (older inputs are known from the history only)"
        )


async def log_reach(settings: Settings, partitions: Iterable[int] | None = None) -> Reach:
    wanted = sorted(set(partitions)) if partitions is not None else None
    consumer = AIOKafkaConsumer(**kafka_client_args(settings, "audit"), group_id=None)
    await consumer.start()
    try:
        tps = [
            TopicPartition(topic, p)
            for topic in (settings.topic_commands, settings.topic_observations)
            for p in (wanted if wanted is not None else range(settings.kafka_partitions))
        ]
        begins = await consumer.beginning_offsets(tps)
    finally:
        await consumer.stop()
    return Reach({(tp.topic, tp.partition): offset for tp, offset in begins.items()})
