"""The owner epoch: a previous owner of a partition that learns of the rebalance late (a zombie)
commits nothing after the new owner's assignment (real Kafka and PostgreSQL).

Without it such a commit landed after the new owner had read what was left to publish: the new
owner then published its own later decisions first, and the zombie's event reached
sandbox.events after them (seen in a chaos run with two `sandstream up`, the events check:
"published out of order"), where the rebuild folds each sandbox's events in offset order and
skips one whose version is not above the row's. The processors here are driven directly, their
assignments made as the rebalance callback makes them (``claim_partitions``, then what the
previous owner left published); the zombie's producer never hears back, as from a process
paused past its session.
"""

from __future__ import annotations

import factories as f
import pytest
from harness import Env, eventually, isolated_env
from test_exactly_once import HeldProducer, _started_producer, publish

from events.codec import EVENTS, decode
from projections.offsets import claim_partitions, owner_epochs
from projections.store import BatchWrite, OffsetsMoved, write_batch
from services.processor.consumer import Processor


async def assign(env: Env, processor: Processor) -> None:
    """Partition 0 of both input topics assigned to ``processor`` (what ``on_assigned`` does
    in PostgreSQL), and what its previous owner left published."""
    topics = [env.settings.topic_commands, env.settings.topic_observations]
    async with env.pool.acquire() as conn:
        processor.owned.epochs = await claim_partitions(conn, [(t, 0) for t in topics])
    processor.owned.partitions = {0}
    await processor.publisher.publish_pending(0)


async def test_a_previous_owner_commits_nothing_after_the_next_owners_assignment() -> None:
    async with isolated_env(partitions=1) as env:
        await publish(env, [f.create("a", command_id="c1"), f.delete("a", command_id="c2")])
        records = await env.read_topic(env.settings.topic_commands)
        zombie = Processor(env.settings, env.pool, name="zombie")
        zombie.producer = HeldProducer()  # type: ignore[assignment]
        owner = Processor(env.settings, env.pool, name="next-owner")
        owner.producer = await _started_producer(env)
        try:
            await assign(env, zombie)
            await assign(env, owner)  # the rebalance the zombie has not heard of yet
            assert await zombie.process_partition(0, records[:1]) == 0  # fenced: nothing
            assert zombie.owned.partitions == set()  # let go at once
            assert await zombie.process_partition(0, records[1:]) == 0  # dropped, not written
            assert await owner.process_partition(0, records) == 2
            await owner.drain()
            await owner.process_partition(0, [])  # the next poll: nothing left to republish
            await owner.drain()
        finally:
            await zombie.stop()
            await owner.stop()
        decided = [
            (r["key"], r["command_id"])
            for r in await env.fetch('SELECT key, command_id FROM history ORDER BY "offset"')
        ]
        assert decided == [("a", "c1"), ("a", "c2")]  # each input once, by the owner
        events = [decode(EVENTS, r.value) for r in await env.read_topic(env.settings.topic_events)]
        assert [(e.type, e.version) for e in events] == [
            ("SandboxCreated", 1),
            ("SandboxDeleting", 2),
        ]


async def test_a_batch_written_with_an_older_epoch_is_refused_and_one_without_is_not_checked() -> (
    None
):
    async with isolated_env(partitions=1) as env:
        tp = (env.settings.topic_commands, 0)
        async with env.pool.acquire() as conn:
            first = await claim_partitions(conn, [tp])
            second = await claim_partitions(conn, [tp])
            assert (first[tp], second[tp]) == (1, 2)
            with pytest.raises(OffsetsMoved):
                await write_batch(conn, BatchWrite([], [], [], [], {tp: (0, 1)}), epochs=first)
            assert await env.fetchval("SELECT next_offset FROM input_offsets") == 0
            await write_batch(conn, BatchWrite([], [], [], [], {tp: (0, 1)}), epochs=second)
            await write_batch(conn, BatchWrite([], [], [], [], {tp: (1, 2)}))
        assert await env.fetchval("SELECT next_offset FROM input_offsets") == 2


async def test_a_group_assignment_raises_the_epochs_that_fence_the_previous_owner() -> None:
    """The rebalance callback itself raises the epochs (the tests above make the assignment by
    hand): a batch written under the epochs of an assignment made before it is refused."""
    async with isolated_env(partitions=1) as env:
        tps = [(env.settings.topic_commands, 0), (env.settings.topic_observations, 0)]
        async with env.pool.acquire() as conn:
            before = await claim_partitions(conn, tps)  # the previous owner's assignment
        processor = await env.start_processor()
        await eventually(lambda: processor.ownership.joined, bool, what="the assignment")
        async with env.pool.acquire() as conn:
            stored = await owner_epochs(conn, tps)
            assert processor.owned.epochs == stored
            assert all(stored[tp] > before[tp] for tp in tps)
            with pytest.raises(OffsetsMoved):
                await write_batch(conn, BatchWrite([], [], [], [], {tps[0]: (0, 0)}), epochs=before)
