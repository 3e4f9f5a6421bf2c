"""Read one partition of some topics from their beginning to their end as of the call."""

from __future__ import annotations

import asyncio
from typing import TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"


async def read_partition(
    bootstrap: str, topics: list[str], partition: int, timeout: float = 120.0
) -> dict[str, list[Record]]:
    """Every record now in partition ``partition`` of each of ``topics``, in offset order."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        group_id=None,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tps = [TopicPartition(t, partition) for t in topics]
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        start = await consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, start[tp])
        found: dict[str, list[Record]] = {t: [] for t in topics}
        needed = {tp for tp in tps if end[tp] > start[tp]}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while needed:
            if loop.time() > deadline:
                raise TimeoutError(f"reading partition {partition} of {topics}: timed out")
            batch = await consumer.getmany(*needed, timeout_ms=500, max_records=10_000)
            for tp, records in batch.items():
                for record in records:
                    if record.offset < end[tp]:
                        found[tp.topic].append(record)
                if records and records[-1].offset + 1 >= end[tp]:
                    needed.discard(tp)
        return found
    finally:
        await consumer.stop()
