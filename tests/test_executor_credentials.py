"""The executor's read of a launch's credentials when PostgreSQL goes away, on real PostgreSQL."""

from __future__ import annotations

import factories as f
import pytest
from harness import isolated_env
from pg_goodbye import say_goodbye, single_connection_pool
from pipeline_support import command, wait_phase

from drivers.fake import FakeDriver
from drivers.protocol import DriverError
from services.common.providers import LaunchValues
from services.executor.credentials import LaunchCredentials
from services.up.control_plane import ControlPlane


async def test_a_credentials_read_on_a_session_postgresql_ended_is_a_retryable_failure() -> None:
    """Found by the chaos checker: in a PostgreSQL restart the read met a connection that had
    the server's goodbye but not yet its close (asyncpg's InternalClientError). It was taken
    for a driver bug and the launch failed for good; PostgreSQL being away is retried."""
    async with (
        isolated_env(partitions=1) as env,
        single_connection_pool(env.settings) as (pool, proxy),
    ):
        async with pool.acquire() as conn:
            session = conn.get_server_pid()
        await say_goodbye(env, proxy, [session])
        with pytest.raises(DriverError) as lost:
            await LaunchCredentials(env.settings, pool)("box")
    assert lost.value.retryable
    assert lost.value.reason == (
        "credentials unavailable: PostgreSQL unreachable (InternalClientError)"
    )


async def test_a_launch_whose_row_attaches_no_provider_asks_the_credential_source_nothing() -> None:
    """The executor reads the row right before a launch (is it still wanted?); a row that
    attaches no provider launches with no values without a second read of the same row. One
    that attaches a provider asks the source, once per launch."""
    asked: list[str] = []

    async def source(key: str) -> LaunchValues:
        asked.append(key)
        return LaunchValues(revisions={"p": 0})

    async with isolated_env(partitions=1) as env:
        plane = ControlPlane(env.settings, FakeDriver(), env.pool, reconcile_interval=3600)
        await plane.start()
        try:
            assert plane.executor is not None
            plane.executor.credentials = source
            async with await env.publisher() as pub:
                await command(env, pub, f.create("plain"))
                await command(env, pub, f.create("attached", providers=["p"]))
                await wait_phase(env, "plain", "Ready")
                await wait_phase(env, "attached", "Ready")
        finally:
            await plane.stop()
    assert asked == ["attached"]
