"""A poll whose records of a partition start above the offset the processor has applied is
never written: the records between would be skipped for good. Found by the chaos checker under
`sandstream up` (an acknowledged stop with no outcome, its log record without a history entry,
after its partition was revoked and assigned again within a second while a poll was in hand).
On real Kafka and PostgreSQL: the batch is refused, nothing is written, and the run loop reads
the partition again from the stored offset and applies every record once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import factories as f
import pytest
from harness import eventually, isolated_env
from prometheus_client import REGISTRY

from services.processor.consumer import Processor
from services.processor.read import InputGap, gaps

GAPS_METRIC = "sandstream_processor_input_gaps_total"


def _item(topic: str, partition: int, offset: int) -> Any:
    return SimpleNamespace(record=SimpleNamespace(topic=topic, partition=partition, offset=offset))


def test_a_partition_whose_unapplied_records_do_not_follow_its_offset_is_named() -> None:
    offsets = {("c", 0): 5, ("c", 1): 3, ("o", 0): 0}
    items = [_item("c", 0, 3), _item("c", 0, 4), _item("c", 0, 5), _item("c", 0, 6)]  # no gap
    items += [_item("c", 1, 4), _item("c", 1, 5)]  # 3 never came: a gap
    items += [_item("o", 0, 1)]  # 0 never came
    assert gaps(items, offsets) == [
        "c[1] from offset 4, applied up to 3",
        "o[0] from offset 1, applied up to 0",
    ]
    assert gaps(items[:4], offsets) == []  # below the offset: applied already, not a gap
    assert gaps([], offsets) == []
    twice = [_item("c", 0, 5), _item("c", 0, 6), _item("c", 0, 5), _item("c", 0, 6)]
    assert gaps(twice, offsets) == ["c[0] out of sequence after offset 5"]


async def test_a_batch_starting_above_the_applied_offset_writes_nothing() -> None:
    async with isolated_env(partitions=1) as env:
        async with await env.publisher() as pub:
            await pub.publish_many([f.create(f"gap-{i}") for i in range(4)])
        records = await env.read_topic(env.settings.topic_commands)
        processor = Processor(env.settings, env.pool, name="gapped")
        await processor.start()  # its producer (the run loop is not started)
        try:
            with pytest.raises(InputGap, match=r"from offset 2, applied up to 0"):
                await processor.process_partition(0, records[2:])
            assert await env.fetchval("SELECT count(*) FROM history") == 0
            assert await processor.process_partition(0, records) == 4
        finally:
            await processor.stop()


async def test_the_run_loop_reads_a_gapped_partition_again_and_applies_every_record_once() -> None:
    async with isolated_env(partitions=1) as env:
        processor = Processor(env.settings, env.pool, name="gapped")
        await processor.start()
        polled = processor.polls.next
        dropped: list[int] = []

        async def first_record_lost() -> Any:
            """The first poll with records loses its first one, as a poll of an earlier
            assignment applied after a new one would have it."""
            batch = await polled()
            for tp, records in batch.items():
                if records and not dropped:
                    dropped.append(records[0].offset)
                    batch[tp] = records[1:]
            return batch

        processor.polls.next = first_record_lost  # type: ignore[method-assign]
        before = REGISTRY.get_sample_value(GAPS_METRIC) or 0.0
        stop = asyncio.Event()
        running = asyncio.create_task(processor.run(stop))
        try:
            async with await env.publisher() as pub:
                await pub.publish_many([f.create(f"gap-{i}") for i in range(5)])
            offsets = await eventually(
                lambda: env.fetch('SELECT "offset" FROM history ORDER BY "offset"'),
                lambda rows: len(rows) >= 5,
                what="every record applied",
            )
            assert [r["offset"] for r in offsets] == [0, 1, 2, 3, 4]
            assert dropped == [0]
            assert REGISTRY.get_sample_value(GAPS_METRIC) == before + 1
        finally:
            stop.set()
            await running
            await processor.stop()
