"""Exactly-once under crashes, rebalances and zombies, on real Kafka and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
from typing import Any

import factories as f
import pytest
import workload
from harness import Env, eventually, isolated_env
from pg_goodbye import behind_holding_proxy, say_goodbye

from projections.outbox import mark_published
from projections.store import SANDBOX_COLUMNS, sandbox_from_record
from services.common import metrics
from services.common.database import connect_pool
from services.common.kafka_clients import kafka_client_args
from services.processor import publish as publish_stage
from services.processor.consumer import Processor
from services.processor.rebuild import rebuild_and_compare


async def publish(env: Env, inputs: list[workload.Command]) -> None:
    async with await env.publisher() as pub:
        await pub.publish_many(inputs)


async def assert_applied_exactly_once(env: Env, inputs: list[workload.Command]) -> None:
    """Every input offset is in the history once, rows match the pure fold and the log."""
    per_partition = await env.fetch(
        'SELECT partition, count(*) AS n, count(DISTINCT "offset") AS distinct_offsets, '
        'min("offset") AS lo, max("offset") AS hi FROM history GROUP BY partition'
    )
    assert sum(r["n"] for r in per_partition) == len(inputs)
    for r in per_partition:
        assert r["n"] == r["distinct_offsets"] == r["hi"] - r["lo"] + 1, dict(r)  # no gap, no dup
        assert r["lo"] == 0
    live = {
        r["key"]: sandbox_from_record(r)
        for r in await env.fetch(f"SELECT {SANDBOX_COLUMNS} FROM sandboxes")
    }
    logged = workload.as_logged(inputs, await env.read_topic(env.settings.topic_commands))
    assert live == workload.expected_rows(logged)
    distinct_ids = {c.command_id for c in inputs}
    assert await env.fetchval("SELECT count(*) FROM command_outcomes") == len(distinct_ids)
    report = await rebuild_and_compare(env.settings)
    assert report.equal, report.differences[:5]
    assert report.rebuilt == len(live)


async def run_with_kills(env: Env, inputs: list[workload.Command], kills: int, seed: int) -> None:
    """Publish while processors are SIGKILLed at random points, then let one finish."""
    rng = random.Random(seed)
    size = -(-len(inputs) // (kills + 1))
    chunks = [inputs[i : i + size] for i in range(0, len(inputs), size)]  # log order = input order
    # Small polls make every run span many batches, so kills land between and inside them.
    env_vars = {**env.env_vars(), "SANDSTREAM_PROCESSOR_MAX_RECORDS": "50"}
    progress_at_kill = []
    published = 0
    for chunk in chunks[:-1]:
        await publish(env, chunk)
        published += len(chunk)
        proc = env.spawn_processor(env_vars)
        try:
            # Kill at a random point of progress: once it has applied up to a random record
            # of what is pending (it keeps working while that is being observed).
            before = await env.fetchval("SELECT count(*) FROM history")
            target = rng.randint(before + 1, published)
            await eventually(
                lambda: env.fetchval("SELECT count(*) FROM history"),
                lambda n, t=target: n >= t,
                timeout=60,
                what=f"the processor to apply {target} inputs",
            )
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        progress_at_kill.append((await env.fetchval("SELECT count(*) FROM history"), published))
    await publish(env, chunks[-1])
    # Some kills must have hit before the processor caught up for the test to mean anything.
    assert any(n < pending for n, pending in progress_at_kill), progress_at_kill
    proc = env.spawn_processor(env_vars)
    try:
        await env.wait_applied(len(inputs), timeout=240)
        await wait_outbox_drained(env)  # including what a killed processor left unpublished
    finally:
        proc.terminate()
        proc.wait(30)


async def wait_outbox_drained(env: Env) -> None:
    await eventually(
        lambda: env.fetchval(
            "SELECT count(*) FROM outbox o LEFT JOIN outbox_cursor c USING (partition) "
            "WHERE o.id > coalesce(c.published_id, 0)"
        ),
        lambda n: n == 0,
        what="outbox published",
    )


async def test_sigkill_at_random_points_applies_every_input_exactly_once() -> None:
    inputs = workload.commands(count=3000, keys=150, seed=7)
    async with isolated_env(partitions=4) as env:
        await run_with_kills(env, inputs, kills=4, seed=7)
        await assert_applied_exactly_once(env, inputs)


@pytest.mark.soak
async def test_soak_sigkill_many_times() -> None:
    inputs = workload.commands(count=30_000, keys=2000, seed=11)
    async with isolated_env(partitions=12) as env:
        await run_with_kills(env, inputs, kills=20, seed=11)
        await assert_applied_exactly_once(env, inputs)


async def test_two_processors_with_forced_rebalances_record_every_input_exactly_once() -> None:
    inputs = workload.commands(count=3000, keys=150, seed=3)
    async with isolated_env(partitions=4) as env:
        first = await env.start_processor("p1", max_records=200)
        await publish(env, inputs)
        for _ in range(3):  # join and leave repeatedly while p1 is consuming
            second = await env.start_processor("p2", max_records=200)
            await eventually(
                lambda p=second: _assignment(p), bool, what="p2 to be assigned partitions"
            )
            await env.stop_processor(second)
        await env.wait_applied(len(inputs), timeout=120)
        await wait_outbox_drained(env)
        await env.stop_processor(first)
        await assert_applied_exactly_once(env, inputs)


async def test_a_second_writer_of_a_partition_writes_no_input_twice() -> None:
    inputs = workload.commands(count=60, keys=5, seed=5)
    async with isolated_env(partitions=1) as env:
        await publish(env, inputs)
        records = await env.read_topic(env.settings.topic_commands)
        owner = Processor(env.settings, env.pool, name="owner")
        zombie = Processor(env.settings, env.pool, name="zombie")
        for p in (owner, zombie):
            p.producer = await _started_producer(env)
        try:
            # Both believe they own partition 0 and race on the same records.
            applied = await asyncio.gather(
                owner.process_partition(0, records[:40]), zombie.process_partition(0, records[:40])
            )
            assert sorted(applied) == [0, 40]
            # A writer still holding an old batch after the owner moved on writes none of it.
            assert await zombie.process_partition(0, records[:30]) == 0
            # Overlapping batches apply only what is new.
            assert await owner.process_partition(0, records[30:]) == 20
            # The zombie's cursor write may come after the owner's (written at most every
            # _CURSOR_EVERY): the owner then found the zombie's records as a gap, which its
            # run loop would publish again when idle. Here: once the zombie has drained.
            await owner.drain()
            await zombie.stop()
            await owner.republish_gaps()
        finally:
            for p in (zombie, owner):
                await p.stop()
        assert await env.fetchval("SELECT count(*) FROM history") == 60
        assert (
            await env.fetchval(
                "SELECT next_offset FROM input_offsets WHERE topic = $1",
                env.settings.topic_commands,
            )
            == 60
        )
        await wait_outbox_drained(env)
        await assert_applied_exactly_once(env, inputs)


async def publish_and_settle(
    env: Env, inputs: list[workload.Command], end: int, start: int = 0
) -> None:
    """Publish ``inputs[start:end]``; return once all ``end`` are applied and published."""
    await publish(env, inputs[start:end])
    await env.wait_applied(end)
    await wait_outbox_drained(env)


async def test_the_processor_resumes_after_postgresql_ends_its_sessions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As in a database restart: the processor waits for PostgreSQL, goes back to the stored
    offsets, and every input is still applied exactly once."""
    caplog.set_level(logging.INFO, logger="sandstream.processor")
    inputs = workload.commands(count=600, keys=40, seed=13)
    async with isolated_env(partitions=4) as env:
        processor = await env.start_processor("p1", max_records=50)
        [(_, _, task)] = env.processors
        await publish_and_settle(env, inputs, 300)
        conns = (processor.writer.conn, processor.publisher.cursor_conn)
        sessions = [c.get_server_pid() for c in conns]
        terminated = await env.fetch(
            "SELECT pg_terminate_backend(pid) AS done FROM unnest($1::int[]) AS pid", sessions
        )
        assert [r["done"] for r in terminated] == [True, True]
        await publish_and_settle(env, inputs, len(inputs), start=300)
        assert not task.done()
        assert "lost PostgreSQL" in caplog.text
        assert "resumed from the offsets stored in PostgreSQL" in caplog.text
        await env.stop_processor(processor)
        await assert_applied_exactly_once(env, inputs)


async def test_the_processor_resumes_when_postgresql_s_goodbye_comes_before_the_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by the chaos checker: in a PostgreSQL restart, a session's "terminating connection"
    error can reach an idle connection before its close does. asyncpg then fails the next query
    with InternalClientError ("another operation is in progress"), which the processor did not
    take for a lost database: it died. A proxy here holds the closes, so the window stays open."""
    caplog.set_level(logging.INFO, logger="sandstream.processor")
    inputs = workload.commands(count=200, keys=20, seed=17)
    async with isolated_env(partitions=2) as env:
        async with behind_holding_proxy(env.settings) as (settings, proxy):
            pool = await connect_pool(settings)
            processor = Processor(settings, pool, name="goodbye", max_records=50)
            stop = asyncio.Event()
            try:
                await processor.start()
                task = asyncio.create_task(processor.run(stop))
                await publish_and_settle(env, inputs, 100)
                conns = (processor.writer.conn, processor.publisher.cursor_conn)
                await say_goodbye(env, proxy, [c.get_server_pid() for c in conns])
                # Both goodbyes are in the processor's sockets before anything makes it query.
                await publish_and_settle(env, inputs, len(inputs), start=100)
                assert not task.done()
                assert "lost PostgreSQL (InternalClientError(" in caplog.text
                assert "resumed from the offsets stored in PostgreSQL" in caplog.text
                stop.set()
                await task
            finally:
                await processor.stop()
                await proxy.cut()  # before the pool's polite close, whose end it would hold
                await pool.close()
        await assert_applied_exactly_once(env, inputs)


class HeldProducer:
    """A producer whose acknowledgements the test gives, in any order."""

    def __init__(self) -> None:
        self.sent: list[asyncio.Future[None]] = []

    async def send(
        self, topic: str, value: bytes, key: bytes | None, partition: int | None = None
    ) -> asyncio.Future[None]:
        self.sent.append(asyncio.get_running_loop().create_future())
        return self.sent[-1]

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}  # the tests' topics have one partition

    async def stop(self) -> None:
        return None


async def test_a_publish_cursor_moves_only_past_records_that_are_all_acknowledged() -> None:
    """A later batch's acknowledgement that comes back first must not move the cursor over
    an earlier batch still in flight: a crash then would lose the earlier batch's events."""
    async with isolated_env(partitions=1) as env:
        await publish(env, [f.create("a", command_id="c1"), f.create("b", command_id="c2")])
        records = await env.read_topic(env.settings.topic_commands)
        processor = Processor(env.settings, env.pool, name="held-acks")
        producer = HeldProducer()
        processor.producer = producer  # type: ignore[assignment]
        cursor = "SELECT published_id FROM outbox_cursor WHERE partition = 0"
        try:
            assert await processor.process_partition(0, records[:1]) == 1
            assert await processor.process_partition(0, records[1:]) == 1
            # Each batch sent its SandboxCreated and its chain checkpoint.
            first, second = producer.sent[:2], producer.sent[2:]
            for future in second:
                future.set_result(None)
            with pytest.raises(TimeoutError):  # the first batch is still unacknowledged
                await asyncio.wait_for(processor.drain(), timeout=0.5)
            assert await env.fetchval(cursor) is None
            for future in first:
                future.set_result(None)
            await processor.drain()
            assert await env.fetchval(cursor) == await env.fetchval("SELECT max(id) FROM outbox")
        finally:
            for future in producer.sent:
                if not future.done():
                    future.set_result(None)
            await processor.stop()


async def test_publish_cursors_are_written_once_per_interval_and_at_once_for_a_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a steady rate the cursor is not written for every batch: what is acknowledged within
    the interval is written together, and a drain (revoke, stop) writes it at once."""
    monkeypatch.setattr(publish_stage, "_CURSOR_EVERY", 3600.0)  # no write falls due by time
    writes: list[dict[int, list[int]]] = []

    async def counted(conn: Any, acked: dict[int, list[int]]) -> dict[int, int]:
        writes.append({p: list(ids) for p, ids in acked.items()})
        return await mark_published(conn, acked)

    monkeypatch.setattr(publish_stage, "mark_published", counted)
    async with isolated_env(partitions=1) as env:
        await publish(env, [f.create(f"k{i}", command_id=f"c{i}") for i in range(5)])
        records = await env.read_topic(env.settings.topic_commands)
        processor = Processor(env.settings, env.pool, name="coalesced")
        processor.producer = await _started_producer(env)
        cursor = "SELECT published_id FROM outbox_cursor WHERE partition = 0"
        try:
            assert await processor.process_partition(0, records[:1]) == 1
            await processor.drain()
            first = await env.fetchval(cursor)
            assert first == await env.fetchval("SELECT max(id) FROM outbox")
            for record in records[1:]:  # four batches, each acknowledged by Kafka
                assert await processor.process_partition(0, [record]) == 1
            await eventually(
                lambda: env.read_topic(env.settings.topic_events),
                lambda found: len(found) == 5,
                what="every event acknowledged and on the topic",
            )
            assert await env.fetchval(cursor) == first  # not written for each batch
            await processor.drain()
            assert await env.fetchval(cursor) == await env.fetchval("SELECT max(id) FROM outbox")
            # The four batches together (an event and a chain checkpoint each).
            assert len(writes) == 2 and len(writes[1][0]) == 8
        finally:
            await processor.stop()


async def _started_producer(env: Env):  # type: ignore[no-untyped-def]
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        **kafka_client_args(env.settings, "processor"), enable_idempotence=True, acks="all"
    )
    await producer.start()
    return producer


def conflicts_so_far() -> float:
    return metrics.WRITE_CONFLICTS._value.get()  # type: ignore[attr-defined,no-any-return]


async def _assignment(processor: Processor) -> set[object]:
    assert processor.consumer is not None
    return set(processor.consumer.assignment())


async def _create_and_two_attaches(env: Env, name: str) -> tuple[list[Any], Processor]:
    """c0 creates x, c1 and c2 attach p1 and p2; a processor (not consuming) to apply them."""
    await publish(
        env,
        [
            f.create("x", command_id="c0"),
            f.attach("x", "p1", command_id="c1"),
            f.attach("x", "p2", command_id="c2"),
        ],
    )
    records = await env.read_topic(env.settings.topic_commands)
    processor = Processor(env.settings, env.pool, name=name)
    processor.producer = await _started_producer(env)
    return records, processor


async def _apply_c1_as_another_writer(env: Env, other: Any) -> None:
    await other.execute("UPDATE sandboxes SET providers = '{p1}', version = 2 WHERE key = 'x'")
    await other.execute(
        "UPDATE input_offsets SET next_offset = 2 WHERE topic = $1 AND partition = 0",
        env.settings.topic_commands,
    )


async def _assert_c1_and_c2_applied_once(env: Env) -> None:
    row = (await env.fetch("SELECT providers, version FROM sandboxes WHERE key = 'x'"))[0]
    assert (list(row["providers"]), row["version"]) == (["p1", "p2"], 3)
    assert await env.fetchval("SELECT count(*) FROM history") == 2  # c0, c2: c1 was not theirs


async def test_a_write_committed_after_the_read_makes_the_batch_decided_again() -> None:
    """The processor reads the rows, decides, then writes only if the offsets are still those it
    read; when another writer committed in between, nothing of the stale decision is written
    and the batch is read and decided again on the committed row."""
    async with isolated_env(partitions=1) as env:
        records, processor = await _create_and_two_attaches(env, "late-reader")
        try:
            assert await processor.process_partition(0, records[:1]) == 1
            conflicts = conflicts_so_far()
            async with env.pool.acquire() as other, other.transaction():
                # Another writer holds the partition and applies c1 itself...
                await other.execute(
                    "SELECT 1 FROM input_offsets WHERE topic = $1 AND partition = 0 FOR UPDATE",
                    env.settings.topic_commands,
                )
                blocked = asyncio.create_task(processor.process_partition(0, records[1:]))
                await eventually(
                    lambda: env.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%input_offsets%'"
                    ),
                    lambda n: n >= 1,
                    what="the processor's write to wait for the offset row lock",
                )
                await _apply_c1_as_another_writer(env, other)
            # ...and commits after the processor read and decided on the older row.
            assert await blocked == 1  # c1 is fenced, c2 applied on the row as committed
            assert conflicts_so_far() == conflicts + 1
        finally:
            await processor.stop()
        await _assert_c1_and_c2_applied_once(env)


async def test_rows_kept_from_an_earlier_batch_are_not_used_once_another_writer_moved_on() -> None:
    """The processor keeps the rows it wrote; a write by anyone else moves the partition's
    offsets, and the next batch must then read the row rather than use the kept one."""
    async with isolated_env(partitions=1) as env:
        records, processor = await _create_and_two_attaches(env, "cached")
        try:
            assert await processor.process_partition(0, records[:1]) == 1
            assert len(processor.rows) == 1
            conflicts = conflicts_so_far()
            # Another writer applies c1 and commits before the processor's next read.
            async with env.pool.acquire() as other, other.transaction():
                await _apply_c1_as_another_writer(env, other)
            assert await processor.process_partition(0, records[1:]) == 1  # c2 only
            assert conflicts_so_far() == conflicts  # found at the read, not at the write
        finally:
            await processor.stop()
        await _assert_c1_and_c2_applied_once(env)
