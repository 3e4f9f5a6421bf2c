"""The processor's hand-over in `sandstream up`: a decided event it commits reaches the executor
beside it at once, a Kafka hop before the log delivers it, and the log's copy is then finished
with it, never run again; its offset is committed only after the handed item's end.

On real Kafka and PostgreSQL with the fake driver (the executor's log reads paused, so only the
hand-over can start a launch), and the intake's bookkeeping on its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import factories as f
from aiokafka import AIOKafkaConsumer, TopicPartition
from harness import Env, eventually
from pipeline_support import command, wait_phase
from test_executor_fake import executor_of, pipeline

from drivers.fake import FakeDriver
from events.codec import encode
from events.decided import DecidedEvent
from events.publisher import CommandPublisher
from projections.lifecycle import decide
from services.common.settings import Settings
from services.executor.executor import Executor
from services.executor.progress import PartitionProgress, WorkItem
from services.up.control_plane import ControlPlane


async def _end(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int:
    ends: dict[TopicPartition, int] = await consumer.end_offsets([tp])
    return ends[tp]


@asynccontextmanager
async def paused(
    driver: FakeDriver,
) -> AsyncIterator[
    tuple[Env, CommandPublisher, ControlPlane, AIOKafkaConsumer, TopicPartition, int]
]:
    """A control plane whose executor reads nothing from the log, and where the log's copy
    of the next event of sandbox ``a`` will be (its partition, its offset)."""
    async with pipeline(driver) as (env, plane, pub):
        executor = executor_of(plane)
        consumer = executor.consumer
        assert consumer is not None
        tp = executor.ownership.partition_of("a")
        copy_at = await _end(consumer, tp)
        consumer.pause(*consumer.assignment())
        yield env, pub, plane, consumer, tp, copy_at


async def test_a_committed_create_launches_while_the_executors_log_reads_are_paused() -> None:
    """The launch starts from the hand-over (the log's copy cannot be read); the copy, read
    once the reads resume, is neither run nor checked against the row again, and its offset
    is committed."""
    driver = FakeDriver()
    async with paused(driver) as (env, pub, plane, consumer, tp, copy_at):
        executor = executor_of(plane)
        await command(env, pub, f.create("a"))
        await wait_phase(env, "a", "Ready")
        assert executor.ownership.owned[tp].highest_seen < copy_at  # nothing read from the log

        consumer.resume(*consumer.assignment())
        await eventually(lambda: executor.ownership.owned[tp].highest_seen,
                         lambda seen: seen >= copy_at, what="the log's copy read")  # fmt: skip

        async def committed() -> int:
            await executor.commit()
            return int(await consumer.committed(tp) or 0)

        await eventually(committed, lambda at: at > copy_at, what="the copy's offset committed")
        assert len(driver.calls_for("launch", "a")) == 1
        assert (executor.dropped, executor.queues.repeated) == (0, 0)


async def test_the_logs_copy_of_a_handed_launch_still_running_waits_for_it() -> None:
    """A's launch, handed over, is held in the driver while the log's copy is read: the copy's
    offset is not committed until the launch has reported, and the copy is not run after it."""
    driver = FakeDriver()
    async with paused(driver) as (env, pub, plane, consumer, tp, copy_at):
        executor = executor_of(plane)
        held = driver.block("launch", "a")

        await command(env, pub, f.create("a"))
        await held.entered()
        await eventually(lambda: _end(consumer, tp), lambda end: end > copy_at,
                         what="the created event on the log")  # fmt: skip
        consumer.resume(*consumer.assignment())
        progress = executor.ownership.owned[tp]
        await eventually(lambda: progress.highest_seen, lambda seen: seen >= copy_at,
                         what="the log's copy read")  # fmt: skip
        await executor.commit()
        assert progress.committable() == copy_at
        assert int(await consumer.committed(tp) or 0) <= copy_at

        held.release()
        await wait_phase(env, "a", "Ready")
        await eventually(lambda: progress.committable(), lambda at: at > copy_at,
                         what="the copy finished with the launch")  # fmt: skip
        assert len(driver.calls_for("launch", "a")) == 1
        assert (executor.dropped, executor.queues.repeated) == (0, 0)


async def test_a_handed_delete_that_overtakes_an_unread_launch_leaves_nothing_launched() -> None:
    """A handed event can run before an earlier event of its sandbox that the executor has not
    read (committed while nothing was handed: here the create, with the hand-over off). A's
    delete, handed, runs first; the launch, read from the log afterwards, is dropped by the
    row check: no launch call, the row Deleted."""
    driver = FakeDriver()
    async with paused(driver) as (env, pub, plane, consumer, tp, copy_at):
        executor = executor_of(plane)
        processor = plane.processor
        assert processor is not None and processor.handoff is not None
        handoff, processor.handoff = processor.handoff, None
        await command(env, pub, f.create("a"))
        await wait_phase(env, "a", "Provisioning")
        processor.handoff = handoff
        await command(env, pub, f.delete("a"))
        await wait_phase(env, "a", "Deleted")
        assert executor.ownership.owned[tp].highest_seen < copy_at  # the launch still unread

        consumer.resume(*consumer.assignment())
        await eventually(lambda: executor.dropped, lambda n: n >= 1, what="the launch dropped")
        assert driver.calls_for("launch", "a") == []
        assert len(driver.calls_for("delete", "a")) == 1


# -- the intake's bookkeeping -----------------------------------------------------------------


def _created(key: str) -> tuple[bytes, bytes]:
    """A SandboxCreated of ``key`` (asks for a launch) and the SandboxReady that follows it
    (asks nothing), encoded."""
    create = f.create(key)
    created = decide(None, create, f.cause(create))
    running = f.running(key, 1)
    ready = decide(created.state, running, f.cause(running))
    first: DecidedEvent = created.events[0]
    return encode(first), encode(ready.events[0])


def _record(offset: int, value: bytes) -> Any:
    return SimpleNamespace(offset=offset, value=value)  # what the intake reads of a record


def test_a_handed_events_copy_is_finished_with_it_and_read_again_only_under_a_new_assignment() -> (
    None
):
    settings = Settings().model_copy(update={"kafka_partitions": 4, "topic_events": "ev"})
    executor = Executor(settings, FakeDriver(), None)  # type: ignore[arg-type]
    queued: list[WorkItem] = []
    executor.queues.add = queued.append  # type: ignore[method-assign]
    intake = executor.intake
    tp = executor.ownership.partition_of("sb-1")
    first = PartitionProgress(highest_seen=6)
    executor.ownership.owned = {tp: first}
    launch, ready = _created("sb-1")

    assert intake.hand(tp.partition, launch) == "queued"
    assert [i.intent.operation for i in queued] == ["launch"] and queued[0].offset < -1
    assert first.committable() == 7  # the handed item holds no offset of the log's

    intake.enqueue(tp, _record(7, launch))  # its copy, while it runs: waits for it
    assert len(queued) == 1 and first.committable() == 7
    queued[0].finish()
    assert first.committable() == 8

    assert intake.hand(tp.partition, ready) == "asks_nothing"  # its copy is dropped unread
    intake.enqueue(tp, _record(8, ready))
    assert len(queued) == 1 and first.committable() == 9

    intake.hand(tp.partition, launch)  # finished before its copy came: the copy is dropped
    queued[1].finish()
    intake.enqueue(tp, _record(9, launch))
    assert len(queued) == 2 and first.committable() == 10

    intake.hand(tp.partition, launch)  # then the partition is revoked and assigned again
    second = PartitionProgress(highest_seen=9)
    executor.ownership.owned = {tp: second}
    intake.enqueue(tp, _record(10, launch))  # read again, as the new assignment's own
    assert len(queued) == 4 and queued[3].offset == 10 and second.committable() == 10

    other = next(TopicPartition("ev", p) for p in range(4) if p != tp.partition)
    # A partition not assigned here, or closing: left to the log.
    assert intake.hand(other.partition, launch) == "not_owned"
    executor.ownership.closing = True
    assert intake.hand(tp.partition, launch) == "not_owned"
    assert len(queued) == 4
