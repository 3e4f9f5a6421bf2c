"""A poll whose records of a partition start above the offset the processor has applied is
never written: the records between would be skipped for good. Found by the chaos checker under
`sandstream up` (an acknowledged stop with no outcome, its log record without a history entry,
after its partition was revoked and assigned again within a second while a poll was in hand).
On real Kafka and PostgreSQL: the batch is refused, nothing is written, and the run loop reads
the partition again from the stored offset and applies every record once.

The path that brought such a poll: the poll dropped for its revoked partition was still
committed to Kafka (the lag commit), so Kafka's offset passed PostgreSQL's; a consumer newly
assigned the partition starts fetching at Kafka's offset until it is sought, and the run loop
took a poll from there while the assignment callback was still reading the stored offsets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import factories as f
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from harness import Env, eventually, isolated_env
from prometheus_client import REGISTRY

from projections.stopped import retry_record
from services.common.kafka_clients import kafka_client_args
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


async def test_a_poll_dropped_for_a_revoked_partition_is_not_committed_to_kafka() -> None:
    async with isolated_env(partitions=1) as env:
        async with await env.publisher() as pub:
            await pub.publish_many([f.create(f"revoked-{i}") for i in range(4)])
        records = await env.read_topic(env.settings.topic_commands)
        tp = TopicPartition(env.settings.topic_commands, 0)
        processor = Processor(env.settings, env.pool, name="revoked")
        await processor.start()  # joins the group (the run loop is not started)
        try:
            await eventually(lambda: processor.ownership.joined, bool, what="assigned")
            await processor.on_revoked({tp})  # a poll in hand when its partition went
            assert await processor.process({tp: records}) == 0
            await _lag_committed(processor)
            assert await processor.consumer.committed(tp) is None  # type: ignore[union-attr]
            await processor.ownership.on_assigned({tp})  # owned again: applied and committed
            assert await processor.process({tp: records}) == 4
            await _lag_committed(processor)
            assert await processor.consumer.committed(tp) == 4  # type: ignore[union-attr]
        finally:
            await processor.stop()


async def _lag_committed(processor: Processor) -> None:
    if processor._lag_commit is not None:
        await processor._lag_commit


async def test_a_partition_assigned_while_kafkas_offset_is_ahead_is_read_from_postgresqls() -> None:
    """Kafka's committed offset 6, PostgreSQL's 3: the new owner applies 3, 4, 5 and on, even
    when its run loop polls while the assignment callback waits for the batch in hand."""
    async with isolated_env(partitions=1) as env:
        tp = TopicPartition(env.settings.topic_commands, 0)
        await _applied_then_stopped(env, [f"ahead-{i}" for i in range(3)])
        await _commit_kafka_offset(env, tp, 6)
        async with await env.publisher() as pub:
            await pub.publish_many([f.create(f"behind-{i}") for i in range(6)])
        before = REGISTRY.get_sample_value(GAPS_METRIC) or 0.0
        processor = Processor(env.settings, env.pool, name="new-owner")
        revoked = processor.ownership.on_revoked
        in_hand = asyncio.Event()

        async def then_a_batch_in_hand(partitions: set[TopicPartition]) -> None:
            """After the join's revoke: the assignment callback waits for this batch."""
            await revoked(partitions)
            await processor._lock.acquire()
            in_hand.set()

        processor.ownership.on_revoked = then_a_batch_in_hand  # type: ignore[method-assign]
        polled = processor.polls.next
        offsets_polled: list[int] = []

        async def noted() -> Any:
            batch = await polled()
            offsets_polled.extend(r.offset for rs in batch.values() for r in rs)
            return batch

        processor.polls.next = noted  # type: ignore[method-assign]
        await processor.start()
        stop = asyncio.Event()
        running = asyncio.create_task(processor.run(stop))
        try:
            consumer = processor.consumer
            assert consumer is not None
            # Either the partition is paused until it is sought, or a poll came from Kafka's
            # offset meanwhile (what the old code did).
            await eventually(lambda: tp in consumer.paused() or offsets_polled, bool,
                             what="the assigned partition paused or polled")  # fmt: skip
            in_hand.clear()
            processor._lock.release()
            await env.wait_applied(9)
            offsets = await env.fetch('SELECT "offset" FROM history ORDER BY "offset"')
            assert [r["offset"] for r in offsets] == list(range(9))
            assert offsets_polled[:1] == [3]  # the first poll from PostgreSQL's offset
            assert REGISTRY.get_sample_value(GAPS_METRIC) == before  # none refused
            assert tp not in consumer.paused()
        finally:
            if in_hand.is_set():
                processor._lock.release()
            stop.set()
            await running
            await processor.stop()


async def _applied_then_stopped(env: Env, names: list[str]) -> None:
    async with await env.publisher() as pub:
        await pub.publish_many([f.create(n) for n in names])
    await env.start_processor("first-owner")
    await env.wait_applied(len(names))
    processor, stop, task = env.processors.pop()
    stop.set()
    await task
    await processor.stop()


async def _commit_kafka_offset(env: Env, tp: TopicPartition, offset: int) -> None:
    """Kafka's offset for the processors' group, above PostgreSQL's (as the lag commit of a
    dropped poll left it)."""
    s = env.settings
    consumer = AIOKafkaConsumer(**kafka_client_args(s, "processor"), group_id=s.processor_group,
                                enable_auto_commit=False)  # fmt: skip
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: offset})
    finally:
        await consumer.stop()


async def test_a_partition_released_while_the_processor_resumes_is_not_left_paused() -> None:
    """An operator's retry that lands while the processor starts over from PostgreSQL (after a
    lost backend or a refused poll): the partition is fetched again, not left paused with no
    stop on record for `resume_released` to find."""
    async with isolated_env(partitions=1) as env:
        async with await env.publisher() as pub:
            await pub.publish_many([f.create("released-0")])
        records = await env.read_topic(env.settings.topic_commands)
        processor = Processor(env.settings, env.pool, name="released")
        await processor.start()
        try:
            await eventually(lambda: processor.ownership.joined, bool, what="assigned")
            consumer = processor.consumer
            assert consumer is not None
            tp = TopicPartition(env.settings.topic_commands, 0)
            await processor.ownership.stop_partition(records[0], "refused for the test")
            assert tp in consumer.paused()
            async with env.pool.acquire() as conn:
                await retry_record(conn, tp.topic, 0, records[0].offset)
            await processor.ownership.on_assigned(set(consumer.assignment()))  # as `_resume`
            assert processor.owned.stopped == {}
            assert tp not in consumer.paused()
        finally:
            await processor.stop()
