"""Read a topic from its beginning up to its end as of the call: for audit, rebuild, tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition


class LogTruncated(RuntimeError):
    """The topic no longer starts at offset 0: its oldest records were deleted (retention or
    an explicit delete), so it cannot be replayed from the beginning."""

    def __init__(self, topic: str, starts: dict[int, int]) -> None:
        where = ", ".join(f"partition {p} starts at offset {o}" for p, o in sorted(starts.items()))
        super().__init__(
            f"{topic} no longer starts at offset 0 ({where}): its oldest records were deleted "
            "(retention or a delete), so it cannot be replayed from the beginning. Keep the "
            "topic forever (retention.ms=-1) or use tiered storage; see docs/operations.md"
        )
        self.topic = topic
        self.starts = starts


async def read_to_end(
    client: Mapping[str, Any],
    topic: str,
    partitions: int,
    timeout: float = 120.0,
    from_zero: bool = True,
) -> AsyncIterator[ConsumerRecord[bytes, bytes]]:
    """Yield every record now in ``topic``, partition by partition interleaved, each in order
    (``client``: the connection's keyword arguments, bootstrap servers and security).

    With ``from_zero`` (a replay) a partition whose log no longer starts at offset 0 raises
    LogTruncated before anything is yielded. Completion is decided by the offsets seen, not by
    the consumer's position, which can run ahead of what getmany has returned. ``timeout``
    bounds a stall (no record for that long), not the whole read: a large log on a busy
    machine takes as long as it takes.
    """
    # "earliest": the fetcher's own reset of a freshly assigned partition must not race the
    # explicit seek below to the end of the log.
    consumer = AIOKafkaConsumer(
        **client,
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
        truncated = {tp.partition: o for tp, o in start.items() if o > 0}
        if from_zero and truncated:
            raise LogTruncated(topic, truncated)
        needed = {tp: start[tp] for tp in tps if end[tp] > start[tp]}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while needed:
            if loop.time() > deadline:
                raise TimeoutError(f"reading {topic}: still missing {needed} (end {end})")
            batch = await consumer.getmany(*needed, timeout_ms=500, max_records=10_000)
            if batch:
                deadline = loop.time() + timeout
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
