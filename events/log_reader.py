"""Read a topic from its beginning up to its end as of the call: for audit, rebuild, tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition


async def read_to_end(
    bootstrap: str, topic: str, partitions: int, timeout: float = 120.0
) -> AsyncIterator[ConsumerRecord[bytes, bytes]]:
    """Yield every record now in ``topic``, partition by partition interleaved, each in order.

    Completion is decided by the offsets seen, not by the consumer's position, which can run
    ahead of what getmany has returned.
    """
    # "earliest": the fetcher's own reset of a freshly assigned partition must not race the
    # explicit seek below to the end of the log.
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        group_id=None,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        start = await consumer.beginning_offsets(tps)
        needed = {tp: start[tp] for tp in tps if end[tp] > start[tp]}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while needed:
            if loop.time() > deadline:
                raise TimeoutError(f"reading {topic}: still missing {needed} (end {end})")
            batch = await consumer.getmany(*needed, timeout_ms=500, max_records=10_000)
            for tp, records in batch.items():
                for record in records:
                    if record.offset >= end[tp]:
                        break
                    yield record
                    needed[tp] = record.offset + 1
                if needed[tp] >= end[tp]:
                    del needed[tp]
    finally:
        await consumer.stop()
