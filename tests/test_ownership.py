"""Partition ownership: decided events are never lost, reordered or published by two owners.

On real Kafka and PostgreSQL: a revoked partition gets nothing more from its old owner, the
publish cursor never moves past a record nobody sent, a failed assignment callback is not
swallowed, and two processor processes handing partitions over publish each event once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import threading
from collections import defaultdict

import factories as f
import pytest
import workload
from harness import Env, eventually, isolated_env
from test_exactly_once import (
    HeldProducer,
    _started_producer,
    assert_applied_exactly_once,
    publish,
    wait_outbox_drained,
)

from events.codec import EVENTS, decode
from services.processor.consumer import Processor
from services.processor.ownership import AssignmentFailed


async def test_a_publish_cursor_never_moves_past_an_outbox_record_nobody_sent() -> None:
    """An owner that committed a batch and never published it (its sends failed, then it
    lost the partition) leaves a gap below the next owner's records: the next owner's cursor
    must stop there and the gap be published, not skipped."""
    async with isolated_env(partitions=1) as env:
        await publish(env, [f.create("a", command_id="c1"), f.create("b", command_id="c2")])
        records = await env.read_topic(env.settings.topic_commands)
        gone = Processor(env.settings, env.pool, name="failed-owner")
        held = HeldProducer()
        gone.producer = held  # type: ignore[assignment]
        owner = Processor(env.settings, env.pool, name="next-owner")
        owner.producer = await _started_producer(env)
        try:
            assert await gone.process_partition(0, records[:1]) == 1  # committed, not sent
            for future in held.sent:
                future.set_exception(ConnectionResetError("broker went away"))
            assert await owner.process_partition(0, records[1:]) == 1
            await owner.drain()
            await owner.process_partition(0, [])  # the next poll
            await owner.drain()
        finally:
            await gone.stop()
            await owner.stop()
        events = await env.read_topic(env.settings.topic_events)
        assert {r.key for r in events} == {b"a", b"b"}
        assert await env.fetchval(
            "SELECT published_id FROM outbox_cursor WHERE partition = 0"
        ) == await env.fetchval("SELECT max(id) FROM outbox")


async def test_a_batch_polled_before_a_revoke_is_not_applied_for_the_partitions_that_moved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sandstream.processor")
    inputs = workload.commands(count=400, keys=40, seed=21)
    async with isolated_env(partitions=4) as env:
        await publish(env, inputs)
        first = Processor(env.settings, env.pool, name="first", max_records=400)
        second = Processor(env.settings, env.pool, name="second")
        await first.start()
        try:
            assert first.consumer is not None
            # The batch is in hand (polled, not applied) when the partitions move.
            batch = await eventually(
                lambda: first.consumer.getmany(timeout_ms=200, max_records=400),  # type: ignore[union-attr]
                lambda b: len({tp.partition for tp in b}) == 4,
                what="a batch from all four partitions",
            )
            await second.start()
            assert second.consumer is not None
            moved = await eventually(
                lambda: {tp.partition for tp in second.consumer.assignment()},  # type: ignore[union-attr]
                bool,
                what="the second processor to be assigned partitions",
            )
            kept = sorted({0, 1, 2, 3} - moved)
            await eventually(
                lambda: caplog.text, lambda text: f"first assigned partitions {kept}" in text,
                what="the first processor to resume the partitions it kept",
            )  # fmt: skip
            await first.process(batch)
            per_partition = {
                r["partition"]: r["n"]
                for r in await env.fetch(
                    "SELECT partition, count(*) AS n FROM history GROUP BY partition"
                )
            }
            assert not moved & per_partition.keys(), (moved, per_partition)
            assert (
                await env.fetchval(
                    "SELECT count(*) FROM outbox WHERE partition = ANY($1::int[])", sorted(moved)
                )
                == 0
            )
            assert per_partition == {
                p: sum(len(rs) for tp, rs in batch.items() if tp.partition == p) for p in kept
            }
        finally:
            await first.stop()
            await second.stop()
        await env.start_processor("finisher")
        await env.wait_applied(len(inputs))
        await wait_outbox_drained(env)
        await assert_applied_exactly_once(env, inputs)


async def test_a_failure_inside_the_assignment_callback_stops_the_processor_loudly() -> None:
    """aiokafka logs and swallows what the rebalance callback raises; the partitions would
    then be consumed from wherever Kafka left them, unsought and unrepublished."""
    async with isolated_env(partitions=2) as env:
        async with env.pool.acquire() as conn:
            await conn.execute("ALTER TABLE input_offsets RENAME TO input_offsets_hidden")
        processor = await env.start_processor("p1")
        [(_, _, task)] = env.processors
        await eventually(lambda: task.done(), bool, what="the processor to stop")
        with pytest.raises(AssignmentFailed):
            task.result()
        env.processors.clear()
        await processor.stop()


async def events_in_topic(env: Env) -> dict[str, list[int]]:
    """Versions of the decided events per sandbox, in log order."""
    versions: dict[str, list[int]] = defaultdict(list)
    for record in await env.read_topic(env.settings.topic_events):
        event = decode(EVENTS, record.value)
        versions[event.key].append(event.version)
    return dict(versions)


async def events_in_outbox(env: Env) -> dict[str, list[int]]:
    versions: dict[str, list[int]] = defaultdict(list)
    for r in await env.fetch(
        "SELECT value FROM outbox WHERE topic = $1 ORDER BY id", env.settings.topic_events
    ):
        event = decode(EVENTS, r["value"])
        versions[event.key].append(event.version)
    return dict(versions)


async def assert_history_versions_unique_and_increasing(env: Env) -> None:
    rows = await env.fetch(
        'SELECT key, version FROM history WHERE cardinality(event_types) > 0 ORDER BY "offset"'
    )
    per_key: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        per_key[r["key"]].append(r["version"])
    for key, versions in per_key.items():
        assert versions == sorted(set(versions)), (key, versions)


class Logged:
    """A spawned processor whose log lines are collected (so its pipe never fills up)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace"))

    def assignments(self) -> int:
        return sum("assigned partitions" in line for line in self.lines)

    async def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(self.proc.wait, 60)
        await asyncio.to_thread(self._reader.join, 10)
        return code


async def test_processor_processes_handing_partitions_over_publish_each_event_once_in_order() -> (
    None
):
    """Processors join and leave while inputs stream in, so the others hold polled and
    unacknowledged records beyond what PostgreSQL holds; afterwards every input is in the
    history once, and every decided event is on the topic exactly once, in decision order."""
    workload_inputs = workload.commands(count=100_000, keys=500, seed=17)
    async with isolated_env(partitions=4) as env:
        env_vars = {**env.env_vars(), "SANDSTREAM_PROCESSOR_MAX_RECORDS": "2000"}
        procs = [Logged(env.spawn_processor(env_vars))]
        done_streaming = asyncio.Event()
        published = 0

        async def stream() -> None:  # until the rebalances are over, the log keeps growing
            nonlocal published
            async with await env.publisher() as pub:
                while not done_streaming.is_set() and published < len(workload_inputs):
                    await pub.publish_many(workload_inputs[published : published + 200])
                    published += 200
                    await eventually(  # a backlog of at most 4000: big batches, never idle
                        lambda: env.fetchval(
                            "SELECT coalesce(sum(next_offset), 0) FROM input_offsets"
                        ),
                        lambda n, at=published: n >= at - 4000,
                        timeout=120,
                        interval=0.005,
                        what="the processors to keep up",
                    )

        streaming = asyncio.create_task(stream())
        try:
            await eventually(lambda: procs[0].assignments(), bool, what="the first assignment")
            for _ in range(5):
                joining = Logged(env.spawn_processor(env_vars))
                procs.append(joining)
                before = [p.assignments() for p in procs[:-1]]
                await eventually(joining.assignments, bool, timeout=60, what="a forced rebalance")
                await eventually(  # everyone went through it, holding records meanwhile
                    lambda b=before: [p.assignments() for p in procs[:-1]],
                    lambda now, b=before: all(n > m for n, m in zip(now, b, strict=True)),
                    timeout=60,
                    what="the others to be reassigned",
                )
                assert await procs.pop(0).stop() == 0  # and another as the older one leaves
            done_streaming.set()
            await streaming
            inputs = workload_inputs[:published]
            assert published < len(workload_inputs)  # the stream lasted through every handover
            await env.wait_applied(len(inputs), timeout=240)
            await wait_outbox_drained(env)
        finally:
            done_streaming.set()
            await asyncio.gather(streaming, return_exceptions=True)
            for proc in procs:
                await proc.stop()
        await assert_applied_exactly_once(env, inputs)
        await assert_history_versions_unique_and_increasing(env)
        assert await events_in_topic(env) == await events_in_outbox(env)
