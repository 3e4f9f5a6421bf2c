"""Two processors writing one history chain at once, raced deterministically on real PostgreSQL.

A record on a partition its key does not hash to is dead-lettered by the owner of that
partition, yet its history entry joins its key's chain, which the owner of the key's partition
writes too. Each writer fences only its own partitions' offsets, so both can read the same
chain head and link an entry onto it: a fork. The database refuses the second link (migration
0135) and that writer decides its batch again on the new head.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import factories as f
import pytest
from aiokafka import ConsumerRecord
from harness import Env, eventually, isolated_env
from test_exactly_once import _started_producer
from test_input_edges import key_on, produce_to

from events.codec import encode
from projections.chain import Chains, HistoryContent
from projections.stopped import record_stop, skip_record
from services.audit.chains import check_chains
from services.common import metrics
from services.processor import read
from services.processor.consumer import Processor

Records = list[ConsumerRecord[bytes, bytes]]


def chain_conflicts() -> float:
    return metrics.CHAIN_CONFLICTS._value.get()  # type: ignore[attr-defined,no-any-return]


def both_read_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold each of the first two batch reads until both are done: the two writers then decide
    on the same chain heads and offsets before either writes. Later reads pass."""
    both = asyncio.Barrier(2)
    held = [True, True]
    read_batch = read.read_batch

    async def reading(conn: Any, *args: Any) -> Any:
        out = await read_batch(conn, *args)
        if held.pop() if held else False:
            await asyncio.wait_for(both.wait(), 30)
        return out

    monkeypatch.setattr(read, "read_batch", reading)


@asynccontextmanager
async def two_processors(env: Env) -> AsyncIterator[tuple[Processor, Processor]]:
    first = Processor(env.settings, env.pool, name="first")
    second = Processor(env.settings, env.pool, name="second")
    for p in (first, second):
        p.producer = await _started_producer(env)
    try:
        yield first, second
    finally:
        for p in (first, second):
            await p.stop()


async def chain_of_key(env: Env, key: str) -> list[Any]:
    return await env.fetch(
        "SELECT partition, prev_hash, entry_hash FROM history WHERE key = $1 ORDER BY id", key
    )


async def assert_intact(env: Env, key: str, entries: int) -> None:
    async with env.pool.acquire() as conn:
        report = await check_chains(conn)
    assert report.intact, [b.describe() for b in report.broken]
    chain = await chain_of_key(env, key)
    assert len(chain) == entries
    assert [c["prev_hash"] for c in chain] == [None] + [c["entry_hash"] for c in chain[:-1]]


async def records_of(env: Env, key: str, partitions: Sequence[int]) -> dict[int, Records]:
    """A create of ``key`` produced to each of ``partitions``, by partition."""
    topic = env.settings.topic_commands
    await produce_to(env, topic, [(key.encode(), encode(f.create(key)), p) for p in partitions])
    by_partition: dict[int, Records] = {}
    for r in await env.read_topic(topic):
        by_partition.setdefault(r.partition, []).append(r)
    return by_partition


@pytest.mark.parametrize("earlier", [0, 1], ids=["at-the-chain-s-start", "after-an-entry"])
async def test_a_misrouted_dead_letter_and_its_key_s_own_partition_written_at_once_fork_no_chain(
    monkeypatch: pytest.MonkeyPatch, earlier: int
) -> None:
    async with isolated_env(partitions=2) as env:
        key = key_on(0, 2, "forked")
        records = await records_of(env, key, [0] * (earlier + 1) + [1])
        owned, misrouted = records[0], records[1]
        async with two_processors(env) as (owner, stray):
            if earlier:
                assert await owner.process_partition(0, owned[:earlier]) == earlier
            both_read_first(monkeypatch)
            before = chain_conflicts()
            applied = await asyncio.gather(
                owner.process_partition(0, owned[earlier:]), stray.process_partition(1, misrouted)
            )
        assert applied == [1, 1]
        assert chain_conflicts() == before + 1  # the second link was refused, then decided again
        dead = await env.fetchval(
            "SELECT disposition FROM history WHERE key = $1 AND partition = 1", key
        )
        assert dead == "dead-lettered"
        await assert_intact(env, key, entries=earlier + 2)


async def test_a_zombie_and_the_new_owner_of_a_partition_write_one_misrouted_entry_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same record held by two writers of its partition (the old owner after a rebalance):
    the offsets' compare-and-set in the write lets one of them write its chain entry."""
    async with isolated_env(partitions=2) as env:
        key = key_on(0, 2, "zombie")
        misrouted = (await records_of(env, key, [1]))[1]
        async with two_processors(env) as (zombie, owner):
            both_read_first(monkeypatch)
            applied = await asyncio.gather(
                zombie.process_partition(1, misrouted), owner.process_partition(1, misrouted)
            )
        assert sorted(applied) == [0, 1]
        await assert_intact(env, key, entries=1)


async def test_a_skip_whose_chain_moved_while_it_linked_its_entry_links_it_onto_the_new_head() -> (
    None
):
    """`processor skip` of a misrouted record stopped on partition 1, while the owner of its
    key's partition links the chain's next entry (held open here until the skip waits on it)."""
    async with isolated_env(partitions=2) as env:
        key = key_on(0, 2, "skipped")
        topic = env.settings.topic_commands
        async with two_processors(env) as (owner, _):
            assert await owner.process_partition(0, (await records_of(env, key, [0]))[0]) == 1
        head = await env.fetchval("SELECT entry_hash FROM history WHERE key = $1", key)
        racing: HistoryContent = (
            key, topic, 0, 1, None, None, "dead-lettered", "the owner's next entry", None, None,
            None, [], None, None, None,
        )  # fmt: skip
        prev, own = Chains({(key, None): head}).linked(racing)
        async with env.pool.acquire() as conn, env.pool.acquire() as owners:
            await record_stop(conn, topic, 1, 0, key, "refused (test)")
            async with owners.transaction():
                await owners.execute(
                    'INSERT INTO history (key, topic, partition, "offset", disposition, reason, '
                    "event_types, prev_hash, entry_hash) VALUES ($1, $2, 0, 1, 'dead-lettered', "
                    "$3, '{}', $4, $5)",
                    key, topic, racing[7], prev, own,
                )  # fmt: skip
                skipping = asyncio.create_task(skip_record(conn, topic, 1, 0, "tester", "poison"))
                pid = conn.get_server_pid()
                await eventually(
                    lambda: env.fetchval(
                        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", pid
                    ),
                    lambda waiting: waiting == "Lock",
                    what="the skip's link to wait for the owner's",
                )
            await asyncio.wait_for(skipping, 30)
        await assert_intact(env, key, entries=3)
