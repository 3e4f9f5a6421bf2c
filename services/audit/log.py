"""Read one partition of some topics from their beginning to their end as of the call."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"


async def read_partition(
    client: Mapping[str, Any],
    topics: list[str],
    partition: int,
    timeout: float = 120.0,
    start: Mapping[str, int] | None = None,
) -> dict[str, list[Record]]:
    """Every record now in partition ``partition`` of each of ``topics``, in offset order
    (from ``start[topic]`` on where given; ``client``: the connection's keyword arguments)."""
    consumer = AIOKafkaConsumer(
        **client,
        enable_auto_commit=False,
        group_id=None,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tps = [TopicPartition(t, partition) for t in topics]
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        begin = await consumer.beginning_offsets(tps)
        first = {tp: max(begin[tp], (start or {}).get(tp.topic, 0)) for tp in tps}
        for tp in tps:
            consumer.seek(tp, first[tp])
        found: dict[str, list[Record]] = {t: [] for t in topics}
        needed = {tp for tp in tps if end[tp] > first[tp]}
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
