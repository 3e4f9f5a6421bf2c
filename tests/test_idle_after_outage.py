"""Idle suspend across a PostgreSQL outage longer than the idle timeout (real PostgreSQL behind
a proxy the test cuts, real Kafka, the processor deciding).

During the outage the doors cannot write the use they see (an exec still running records
nothing), so once PostgreSQL is back the recorded use is as old as the outage. A scheduler that
read it before the doors' first flush after the outage took every sandbox in use for idle, and
the fold suspended it under the running command. The clocks are the scheduler's and the
recorder's own settings: the outage lasts an hour by them, which no wait in the test spends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta

import factories as f
import pytest
from harness import Env, isolated_env
from pipeline_support import command, running_plane, wait_phase
from tcp_proxy import TcpProxy

from drivers.fake import FakeDriver
from events.codec import OBSERVATIONS, decode
from events.common import SandboxSpec
from events.observations import DeadlineDue
from events.publisher import now
from projections.store import CONNECTION_ERRORS
from services.common.database import Pool, connect_pool
from services.common.usage import UseRecorder
from services.localstack.private_broker import free_port
from services.scheduler.scheduler import Scheduler

FLUSH = timedelta(seconds=10)  # the default use_flush_seconds


class Clock:
    """A settable wall clock shared by the scheduler and the doors' recorder."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


@asynccontextmanager
async def behind_proxy(env: Env) -> AsyncIterator[tuple[Pool, TcpProxy]]:
    """A pool of the environment's database whose connections go through a proxy."""
    proxy = TcpProxy(free_port(), env.settings.pg_port)
    await proxy.restore()
    moved = env.settings.model_copy(update={"pg_port": proxy.port})
    pool = await connect_pool(moved)
    try:
        yield pool, proxy
    finally:
        await proxy.restore()
        pool.terminate()
        await proxy.cut()


@asynccontextmanager
async def ready_on_a_plane(key: str, idle: int) -> AsyncIterator[Env]:
    """A control plane with the fake driver (no scheduler of its own) and a Ready sandbox
    ``key`` with idle timeout ``idle``; its environment at the default flush interval."""
    spec = SandboxSpec(image=f.IMAGE, idle_suspend_seconds=idle)
    async with isolated_env() as env, running_plane(env, FakeDriver()):
        assert env.settings.use_flush_seconds == FLUSH.total_seconds()
        async with await env.publisher() as pub:
            await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
        await wait_phase(env, key, "Ready", timeout=60)
        yield env


async def idle_messages(env: Env, key: str) -> list[DeadlineDue]:
    return [
        m for m in (
            decode(OBSERVATIONS, r.value)
            for r in await env.read_topic(env.settings.topic_observations)
        )
        if isinstance(m, DeadlineDue) and m.key == key and m.deadline == "idle"
    ]  # fmt: skip


async def test_a_session_open_through_an_outage_longer_than_the_timeout_is_not_taken_for_idle() -> (
    None
):
    flush = FLUSH
    async with ready_on_a_plane("busy", 60) as env:
        async with behind_proxy(env) as (pool, proxy):
            clock = Clock(now())
            use = UseRecorder(pool, flush.total_seconds(), clock=clock)
            scheduler = Scheduler(env.settings, pool, clock=clock)
            await scheduler.start()
            try:
                with use.using("busy"):  # an exec running through the whole outage
                    assert await use.flush() == 1
                    await scheduler.round()  # in use: nothing due
                    await proxy.cut()
                    clock.at += timedelta(minutes=30)
                    assert await use.flush() == 0  # kept for the next flush
                    with pytest.raises(CONNECTION_ERRORS):
                        await scheduler.round()
                    await proxy.restore()
                    clock.at += timedelta(minutes=30)
                    # Back, before the doors flushed: the recorded use is an hour old.
                    await scheduler.round()
                    assert await idle_messages(env, "busy") == []
                    # The doors flush as they do every interval, the scan reads their use.
                    for _ in range(3):
                        assert await use.flush() == 1
                        clock.at += flush
                        await scheduler.round()
                    assert scheduler.idle_scans > 1
                    assert await idle_messages(env, "busy") == []
            finally:
                await scheduler.stop()
        await wait_phase(env, "busy", "Ready", timeout=5)
