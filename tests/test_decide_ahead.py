"""Deciding poll N+1 while poll N's write is in flight, raced deterministically.

Real PostgreSQL and Kafka records; the consumer is replaced by queued polls where the ordering
must be exact (which poll the processor finds already fetched, what happens while N is being
written). Each test has N+1 decided ahead, then makes N fail or the partitions move, and checks
that what lands is what the committed state decides, never the decision made ahead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import factories as f
import pytest
from aiokafka import AIOKafkaProducer, ConsumerRecord, TopicPartition
from harness import Env, eventually, isolated_env
from test_exactly_once import assert_applied_exactly_once, publish, wait_outbox_drained
from test_input_edges import key_on, refuse_poison_rows
from workload import commands

from events.codec import encode
from events.topics import partition_for
from projections.store import BatchRead
from services.audit.chains import check_chains
from services.common import metrics
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.processor import write
from services.processor.consumer import Processor
from services.processor.intake import parse
from services.processor.plan import View, decide_batch, deciding

Records = list[ConsumerRecord[bytes, bytes]]
Poll = dict[TopicPartition, Records]


class QueuedPolls:
    """The consumer as the processor sees it between polls: polls already fetched."""

    def __init__(self) -> None:
        self.polls: list[Poll] = []
        self._subscription = SimpleNamespace(reassignment_in_progress=False)

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> Poll:
        return self.polls.pop(0) if self.polls else {}

    def assignment(self) -> set[TopicPartition]:
        return set()

    def pause(self, *partitions: TopicPartition) -> None:
        pass

    async def stop(self) -> None:
        pass


def poll_of(records: Records) -> Poll:
    poll: Poll = {}
    for r in records:
        poll.setdefault(TopicPartition(r.topic, r.partition), []).append(r)
    return poll


def ahead(outcome: str) -> float:
    return metrics.DECIDED_AHEAD.labels(outcome)._value.get()  # type: ignore[no-any-return]


async def queued_processor(
    env: Env, name: str, max_records: int = 5000
) -> tuple[Processor, QueuedPolls]:
    """A poll of ``max_records`` records is a full one: only then is the next decided ahead."""
    processor = Processor(env.settings, env.pool, name=name, max_records=max_records)
    processor.producer = AIOKafkaProducer(
        **kafka_client_args(env.settings, "processor"), enable_idempotence=True, acks="all"
    )
    await processor.producer.start()
    polls = QueuedPolls()
    processor.consumer = polls  # type: ignore[assignment]  # the part of it the processor uses
    return processor, polls


async def _nothing() -> None:
    return None


def hold_first_write(
    monkeypatch: pytest.MonkeyPatch,
    processor: Processor,
    meanwhile: Callable[[], Awaitable[None]] = _nothing,
) -> None:
    """Hold the next write until the poll after it has been decided ahead, then run
    ``meanwhile`` (another writer, a rebalance) before letting the write go to PostgreSQL."""
    decided = asyncio.Event()
    decide = processor.reader.decide

    async def deciding(conn: Any, inputs: Any, after: Any = None) -> Any:
        out = await decide(conn, inputs, after)
        if after is not None:
            decided.set()
        return out

    monkeypatch.setattr(processor.reader, "decide", deciding)
    write_batch = write.write_batch
    held = [True]

    async def writing(conn: Any, batch: Any, **kw: Any) -> list[int]:
        if held.pop() if held else False:
            await asyncio.wait_for(decided.wait(), 30)
            await meanwhile()
        return await write_batch(conn, batch, **kw)

    monkeypatch.setattr(write, "write_batch", writing)


async def apply_held(processor: Processor) -> int:
    held = processor.polls.take_held()
    assert held is not None, "the next poll was not fetched ahead"
    return await processor.process(held)


async def assert_chains_intact(env: Env) -> None:
    async with env.pool.acquire() as conn:
        report = await check_chains(conn)
    assert report.intact, [b.describe() for b in report.broken]


# Rows kept from earlier writes (the default) or none: what N leaves is never taken from them.
ROW_CACHE = pytest.mark.parametrize("row_cache", [20_000, 0], ids=["rows-kept", "no-rows-kept"])


def hold_write_until_fetched(monkeypatch: pytest.MonkeyPatch, processor: Processor) -> None:
    """Hold the next write until the processor has taken the next poll (deterministic: the
    write could otherwise be done before the poll made during it)."""
    write_batch = write.write_batch
    held = [True]

    async def writing(conn: Any, batch: Any, **kw: Any) -> list[int]:
        if held.pop() if held else False:
            await eventually(lambda: processor.polls.held, bool, what="the next poll to be taken")
        return await write_batch(conn, batch, **kw)

    monkeypatch.setattr(write, "write_batch", writing)


async def test_a_small_poll_has_the_next_fetched_meanwhile_and_a_full_one_has_it_decided(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small poll (here below ``max_records``, which is below a slice) means the processor
    keeps up: during the write it only takes what the consumer fetches (so the fetcher
    fetches again), decided after the write together with what arrived since. A full poll
    means it is behind: the next is decided ahead."""
    async with isolated_env(partitions=1) as env:
        await env.produce(
            env.settings.topic_commands,
            [(f"k{i}".encode(), encode(f.create(f"k{i}", command_id=f"c{i}"))) for i in range(5)],
        )
        records = await env.read_topic(env.settings.topic_commands)
        processor, polls = await queued_processor(env, "paths", max_records=2)
        try:
            decided, written = ahead("decided"), ahead("written")
            hold_write_until_fetched(monkeypatch, processor)
            polls.polls.append(poll_of(records[1:2]))
            assert await processor.process(poll_of(records[:1])) == 1  # 1 < max_records
            assert processor.polls.held == poll_of(records[1:2])  # taken during the write...
            assert ahead("decided") == decided  # ...and not decided
            polls.polls += [poll_of(records[2:3]), poll_of(records[3:])]
            nxt = await processor.polls.next()  # with what was fetched since, up to 2
            assert nxt == poll_of(records[1:3])
            assert await processor.process(nxt) == 2  # 2 == max_records
            assert ahead("decided") == decided + 1
            assert await apply_held(processor) == 2
            assert ahead("written") == written + 1
        finally:
            await processor.stop()
        history = await env.fetch('SELECT "offset", disposition FROM history ORDER BY id')
        assert [(h["offset"], h["disposition"]) for h in history] == [
            (i, "applied") for i in range(5)
        ]
        await assert_chains_intact(env)


@ROW_CACHE
async def test_a_poll_decided_ahead_of_a_fenced_write_is_decided_again_on_the_winner(
    monkeypatch: pytest.MonkeyPatch, row_cache: int
) -> None:
    """N is fenced (another writer applied its record differently and moved the offsets to
    exactly where N would have): N+1, decided as of N, must not land on the other's row."""
    async with isolated_env(partitions=1, processor_row_cache=row_cache) as env:
        await env.produce(
            env.settings.topic_commands,
            [
                (b"x", encode(m))
                for m in (
                    f.create("x", command_id="c0"),
                    f.attach("x", "p1", command_id="c1"),
                    f.attach("x", "p2", command_id="c2"),
                )
            ],
        )
        c0, c1, c2 = await env.read_topic(env.settings.topic_commands)
        processor, polls = await queued_processor(env, "fenced", max_records=1)
        try:
            assert await processor.process(poll_of([c0])) == 1
            decided, written = ahead("decided"), ahead("written")

            async def another_writer_applies_c1() -> None:
                await env.fetch("UPDATE sandboxes SET providers = '{other}', version = 2")
                await env.fetch(
                    "UPDATE input_offsets SET next_offset = 2 WHERE topic = $1 AND partition = 0",
                    env.settings.topic_commands,
                )

            hold_first_write(monkeypatch, processor, another_writer_applies_c1)
            polls.polls.append(poll_of([c2]))
            assert await processor.process(poll_of([c1])) == 0  # fenced: c1 is the other's
            assert ahead("decided") == decided + 1  # c2 was decided while c1 was in flight
            assert await apply_held(processor) == 1
            assert ahead("written") == written  # ...and decided again, on the other's row
        finally:
            await processor.stop()
        row = (await env.fetch("SELECT providers, version FROM sandboxes WHERE key = 'x'"))[0]
        assert (list(row["providers"]), row["version"]) == (["other", "p2"], 3)
        offsets = [r["offset"] for r in await env.fetch('SELECT "offset" FROM history ORDER BY id')]
        assert offsets == [0, 2]
        await assert_chains_intact(env)


@ROW_CACHE
async def test_a_poll_decided_ahead_of_a_refused_write_is_decided_again_after_the_split(
    monkeypatch: pytest.MonkeyPatch, row_cache: int
) -> None:
    """N is refused for one record's content and split down to it (dead-lettered, so no row):
    N+1 creates the same sandbox again, which as of N-as-decided would be a rejected duplicate
    chained to an entry that never landed; decided again, it is refused and dead-lettered."""
    async with isolated_env(partitions=1, processor_row_cache=row_cache) as env:
        await refuse_poison_rows(env)
        names = ["a", "poison", "b", "poison"]
        await env.produce(
            env.settings.topic_commands,
            [(n.encode(), encode(f.create(n, command_id=f"c{i}"))) for i, n in enumerate(names)],
        )
        records = await env.read_topic(env.settings.topic_commands)
        processor, polls = await queued_processor(env, "refused", max_records=3)
        try:
            decided, written = ahead("decided"), ahead("written")
            hold_first_write(monkeypatch, processor)
            polls.polls.append(poll_of(records[3:]))
            assert await processor.process(poll_of(records[:3])) == 3
            assert ahead("decided") == decided + 1
            assert await apply_held(processor) == 1
            assert ahead("written") == written
        finally:
            await processor.stop()
        history = await env.fetch('SELECT disposition FROM history ORDER BY "offset"')
        assert [h["disposition"] for h in history] == [
            "applied", "dead-lettered", "applied", "dead-lettered",
        ]  # fmt: skip
        assert {r["key"] for r in await env.fetch("SELECT key FROM sandboxes")} == {"a", "b"}
        await assert_chains_intact(env)


async def test_a_poll_decided_ahead_is_not_written_for_a_partition_revoked_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rebalance revokes partition 1 while N is being written (the revoke waits for N):
    N+1's records of partition 1 are left to the next owner, those of partition 0 decided
    again and written; the next owner applies the rest from the stored offsets."""
    async with isolated_env(partitions=2) as env:
        k0, k1 = key_on(0, 2, "k"), key_on(1, 2, "k")
        sent: list[tuple[bytes | None, bytes | None]] = [
            (k.encode(), encode(f.create(k, command_id=f"c-{k}"))) for k in (k0, k1)
        ]
        sent += [(k.encode(), encode(f.attach(k, "p1", command_id=f"a-{k}"))) for k in (k0, k1)]
        await env.produce(env.settings.topic_commands, sent)
        records = await env.read_topic(env.settings.topic_commands)
        creates = [r for r in records if r.offset == 0]
        attaches = [r for r in records if r.offset == 1]
        processor, polls = await queued_processor(env, "revoked", max_records=2)
        processor.owned.partitions = {0, 1}
        revoked: list[asyncio.Task[None]] = []

        async def rebalance() -> None:
            gone = {TopicPartition(t, 1) for t in processor.input_topics}
            revoked.append(asyncio.create_task(processor.on_revoked(gone)))

        try:
            decided, written = ahead("decided"), ahead("written")
            hold_first_write(monkeypatch, processor, rebalance)
            polls.polls.append(poll_of(attaches))
            assert await processor.process(poll_of(creates)) == 2
            await revoked[0]  # it ran once N was applied and published
            assert ahead("decided") == decided + 1
            assert await apply_held(processor) == 1  # partition 0's attach only
            assert ahead("written") == written
        finally:
            await processor.stop()
        stored = await env.fetch(
            "SELECT partition, next_offset FROM input_offsets WHERE topic = $1",
            env.settings.topic_commands,
        )
        assert {r["partition"]: r["next_offset"] for r in stored} == {0: 2, 1: 1}
        next_owner, _ = await queued_processor(env, "next-owner")
        (rest,) = [r for r in attaches if r.partition == 1]
        try:
            assert await next_owner.process_partition(1, [rest]) == 1
        finally:
            await next_owner.stop()
        rows = await env.fetch("SELECT key, providers, version FROM sandboxes")
        assert {r["key"]: (list(r["providers"]), r["version"]) for r in rows} == {
            k0: (["p1"], 2),
            k1: (["p1"], 2),
        }
        assert await env.fetchval("SELECT count(*) FROM history") == 4
        await assert_chains_intact(env)


async def second_joins(env: Env, first: Processor, joined: list[asyncio.Task[Processor]]) -> None:
    """Once: start a second processor and wait until the first sees the rebalance begin."""
    if joined:
        return
    joined.append(asyncio.create_task(env.start_processor("second", max_records=20)))
    subscription = first.consumer._subscription  # type: ignore[union-attr]
    await eventually(
        lambda: subscription.reassignment_in_progress,
        bool,
        what="the first processor to see the rebalance begin",
    )


async def run_while_second_joins(
    env: Env, first: Processor, inputs: list[Any], joined: list[asyncio.Task[Processor]]
) -> None:
    """Run the first until every input is applied; the second must have joined meanwhile
    (the rebalance completed) and every input landed once."""
    await first.start()
    stop = asyncio.Event()
    running = asyncio.create_task(first.run(stop))
    try:
        await env.wait_applied(len(inputs), timeout=120)
        assert joined, "the second processor never joined during a write"
        second = await joined[0]
        await eventually(lambda: second.owned.partitions, bool, what="the second to own partitions")
        await wait_outbox_drained(env)
    finally:
        stop.set()
        await asyncio.wait_for(running, 60)
        await first.stop()
    await assert_applied_exactly_once(env, inputs)
    await assert_chains_intact(env)


async def test_a_rebalance_begun_while_a_write_is_in_flight_is_not_waited_for_by_the_poll_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real Kafka: a second processor joins while the first writes a batch. The first's
    rebalance callback waits for that batch, and a poll made meanwhile would wait for the
    rebalance: the first must not poll ahead then. Both go on; every input lands once."""

    inputs = commands(count=300, keys=30, seed=23)
    async with isolated_env(partitions=2) as env:
        await publish(env, inputs)
        first = Processor(env.settings, env.pool, name="first", max_records=20)
        decide_ahead = first.polls.decide_ahead
        joined: list[asyncio.Task[Processor]] = []

        async def second_joins_first(inflight: Any) -> Any:
            await second_joins(env, first, joined)  # while this write is in flight
            return await decide_ahead(inflight)

        monkeypatch.setattr(first.polls, "decide_ahead", second_joins_first)
        await run_while_second_joins(env, first, inputs, joined)


async def test_a_rebalance_begun_while_a_poll_waits_during_a_write_does_not_hold_that_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real Kafka, a first poll below a slice: a second processor joins while the first's poll
    made during a write is waiting. The rebalance waits for the first's batch; the write ends
    and the batch is let go without that poll. Both go on; every input lands once."""

    inputs = commands(count=200, keys=20, seed=31)
    async with isolated_env(partitions=2) as env:
        await publish(env, inputs)
        first = Processor(env.settings, env.pool, name="first", max_records=5000)
        fetch_during = first.polls.fetch_during
        joined: list[asyncio.Task[Processor]] = []

        async def second_joins_meanwhile(write: Any) -> None:
            if joined:
                return await fetch_during(write)
            # The first write's poll is made (the consumer entered) before the rebalance begins.
            assert first.consumer is not None
            polled, getmany = asyncio.Event(), first.consumer.getmany

            async def noted(*args: Any, **kwargs: Any) -> Any:
                polled.set()
                return await getmany(*args, **kwargs)

            monkeypatch.setattr(first.consumer, "getmany", noted)
            polling = asyncio.ensure_future(fetch_during(write))
            await asyncio.wait_for(polled.wait(), 30)
            await second_joins(env, first, joined)
            await polling

        monkeypatch.setattr(first.polls, "fetch_during", second_joins_meanwhile)
        await run_while_second_joins(env, first, inputs, joined)


class Crash(BaseException):
    """The process dies here: nothing after it runs."""


async def test_a_crash_between_a_write_and_the_poll_decided_ahead_of_it_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real Kafka, small polls: the processor dies after N committed with N+1 decided ahead
    and not yet written; the next processor applies everything exactly once, deciding ahead
    itself."""

    inputs = commands(count=400, keys=40, seed=19)
    async with isolated_env(partitions=2) as env:
        await publish(env, inputs)
        first = Processor(env.settings, env.pool, name="dies", max_records=20)
        take = first.polls.take_ahead
        taken = [0]

        def crash_at_the_third(records: Any) -> Any:
            found = take(records)
            if found is not None:
                taken[0] += 1
                if taken[0] == 3:
                    raise Crash
            return found

        monkeypatch.setattr(first.polls, "take_ahead", crash_at_the_third)
        await first.start()
        try:
            with pytest.raises(Crash):
                await asyncio.wait_for(first.run(asyncio.Event()), 120)
            applied = await env.fetchval("SELECT count(*) FROM history")
            assert 0 < applied < len(inputs)
        finally:
            await first.stop()  # the group learns it left; nothing more is written
        written = ahead("written")
        await env.start_processor("survivor", max_records=20)
        await env.wait_applied(len(inputs), timeout=120)
        await wait_outbox_drained(env)
        assert ahead("written") > written  # it decided ahead too
        await assert_applied_exactly_once(env, inputs)
        await assert_chains_intact(env)


def test_deciding_in_slices_decides_what_deciding_at_once_does() -> None:
    """Ahead, the fold runs in slices, each from what the slices before it left: the plan must
    be the one a single fold gives (retries of a command id across slices included)."""

    settings = Settings()
    records = [
        ConsumerRecord(settings.topic_commands, partition_for(c.key.encode(), 1), offset, 0, 0,
                       c.key.encode(), encode(c), None, 0, 0, [])
        for offset, c in enumerate(commands(count=120, keys=8, seed=29))
    ]  # fmt: skip
    items = [parse(r, settings.topic_commands, 1) for r in records]
    offsets = {(t, 0): 0 for t in (settings.topic_commands, settings.topic_observations)}
    view = View.of(BatchRead(offsets, {}, {}, {}))
    at_once = decide_batch(items, {}, view, settings)
    steps = deciding(items, {}, view, settings, slice_size=7)
    paused = 0
    while True:
        try:
            next(steps)
            paused += 1
        except StopIteration as done:
            in_slices = done.value
            break
    assert paused > 10
    assert in_slices.plan == at_once.plan
    assert in_slices.result.states == at_once.result.states
    assert any(h.disposition == "duplicate" for h in at_once.plan.history)
