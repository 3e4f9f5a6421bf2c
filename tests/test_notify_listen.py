"""The NOTIFY wake-ups survive a lost connection: the scheduler and the pool controller each
LISTENed once, at start, on a connection of their own, and after losing it ran on their polls
(5 s, 2 s) until restarted (the change feed listened again already; all three share
``services.common.notify_channels.Listening`` now). On real PostgreSQL: the listening backend
is killed, a new one listens, and the next NOTIFY wakes the role."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from harness import Env, eventually, isolated_env

from events.topics import CHANGES_CHANNEL, POOLS_CHANNEL
from services.common.notify_channels import Listening
from services.scheduler.pool_controller import PoolController
from services.scheduler.scheduler import Scheduler


async def listening_backends(env: Env, base: str) -> list[int]:
    """The backends whose last statement LISTENed on channel ``base`` of the test's schema
    (asyncpg's ``LISTEN "<channel>"``; the channel names the schema, so only the test's own)."""
    channel = await env.pool.fetchval("SELECT notify_channel($1)", base)
    rows = await env.pool.fetch(
        "SELECT pid FROM pg_stat_activity WHERE query = $1", f'LISTEN "{channel}"'
    )
    return [r["pid"] for r in rows]


async def lose_and_hear_again(env: Env, base: str, woken: Callable[[], bool]) -> None:
    """Kill the backend listening on ``base``; once a new one listens, a NOTIFY wakes."""
    [killed] = await eventually(
        lambda: listening_backends(env, base), lambda pids: len(pids) == 1, what="LISTEN"
    )
    assert await env.pool.fetchval("SELECT pg_terminate_backend($1)", killed)
    await eventually(
        lambda: listening_backends(env, base),
        lambda pids: len(pids) == 1 and killed not in pids,
        what="LISTEN again on a new connection",
    )
    await env.pool.execute("SELECT pg_notify(notify_channel($1), '')", base)
    await eventually(woken, bool, what="woken by the next NOTIFY")


async def test_a_listening_whose_connection_is_lost_listens_again_and_hears_the_next_notify() -> (
    None
):
    async with isolated_env(partitions=1) as env:
        calls: list[tuple[object, ...]] = []
        listening = Listening(env.pool, CHANGES_CHANNEL, lambda *a: calls.append(a), "test")
        listening.start()
        try:
            await eventually(lambda: listening_backends(env, CHANGES_CHANNEL), bool, what="LISTEN")
            before = len(calls)
            await lose_and_hear_again(
                env, CHANGES_CHANNEL, lambda: any(len(a) == 4 for a in calls[before:])
            )
            # The loss itself woke it once, without a notification (what was missed: look now).
            assert () in calls[before:]
        finally:
            await listening.close()


async def test_a_lost_listen_connection_is_not_logged_as_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: asyncpg detaches a lost connection's proxy, and asking it ``is_closed()``
    on the way out raised, so every plain loss was logged as a failed LISTEN ("cannot call
    Connection.is_closed(): connection has been released back to the pool")."""
    async with isolated_env(partitions=1) as env:
        calls: list[tuple[object, ...]] = []
        listening = Listening(env.pool, CHANGES_CHANNEL, lambda *a: calls.append(a), "test")
        listening.start()
        try:
            with caplog.at_level(logging.INFO, logger="sandstream.notify"):
                await lose_and_hear_again(env, CHANGES_CHANNEL, lambda: len(calls) > 0)
        finally:
            await listening.close()
        failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert failures == []


async def test_the_scheduler_and_the_pool_controller_listen_again_after_a_lost_connection() -> None:
    async with isolated_env(partitions=1) as env:
        scheduler = Scheduler(env.settings, env.pool)
        pools = PoolController(env.settings, env.pool)
        await scheduler.start()
        await pools.start()
        try:
            scheduler._changed.clear()
            await lose_and_hear_again(env, CHANGES_CHANNEL, scheduler._changed.is_set)
            pools._changed.clear()
            await lose_and_hear_again(env, POOLS_CHANNEL, pools._changed.is_set)
        finally:
            await scheduler.stop()
            await pools.stop()
