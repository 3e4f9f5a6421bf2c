"""The readiness probe of Kafka: the input topics' end offsets and the log's identity, from a
group-less consumer."""

from __future__ import annotations

import asyncio
import contextlib

from aiokafka import AIOKafkaConsumer, TopicPartition

from events.publisher import CommandPublisher
from services.common.kafka_clients import kafka_client_args
from services.common.log_identity import LogIdentity, log_identity_of
from services.common.settings import Settings


class KafkaProbe:
    """End offsets of the input topics, from a group-less consumer started on first use."""

    def __init__(self, settings: Settings, publisher: CommandPublisher) -> None:
        self.settings = settings
        self.publisher = publisher
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    async def log_identity(self, topics: list[str]) -> LogIdentity:
        consumer = await self._started()
        try:
            return await log_identity_of(consumer._client, topics)
        except BaseException:
            await self.close()
            raise

    async def _started(self) -> AIOKafkaConsumer:
        async with self._lock:
            if self._consumer is None:
                consumer = AIOKafkaConsumer(
                    **kafka_client_args(self.settings, "api", "sandstream-api-readiness"),
                    enable_auto_commit=False,
                    request_timeout_ms=5000,
                )
                try:
                    await consumer.start()
                except BaseException:
                    await consumer.stop()
                    raise
                self._consumer = consumer
            return self._consumer

    async def end_offsets(self, topics: list[str]) -> dict[tuple[str, int], int]:
        consumer = await self._started()
        try:
            partitions = []
            for topic in topics:
                # The producer waits for the topic's metadata (the consumer's cache may lack it).
                found = await self.publisher.producer.current.partitions_for(topic)
                partitions += [TopicPartition(topic, p) for p in sorted(found)]
            ends = await consumer.end_offsets(partitions)
        except BaseException:
            await self.close()  # start over next time (the broker may have restarted)
            raise
        return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def close(self) -> None:
        async with self._lock:
            consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await consumer.stop()
