"""The executor's read of a launch's credentials when PostgreSQL goes away, on real PostgreSQL."""

from __future__ import annotations

import pytest
from harness import isolated_env
from pg_goodbye import say_goodbye, single_connection_pool

from drivers.protocol import DriverError
from services.executor.credentials import LaunchCredentials


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
