"""A pool connection is reset on release only when it may carry session state, against the
real PostgreSQL: whatever a user of the pool left in its session (a setting, a LISTEN, a
session advisory lock, an open transaction) is gone for the next user, and a connection that
ran plain queries goes back without asyncpg's reset round trip.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio

from services.common.database import Pool, connect_pool
from services.common.pool_reset import leaves_session_state
from services.common.settings import Settings


@pytest_asyncio.fixture(loop_scope="session")
async def pool(settings: Settings) -> AsyncIterator[Pool]:
    opened = await connect_pool(settings)
    try:
        yield opened
    finally:
        await opened.close()


async def next_user(pool: Pool, pid: int) -> asyncpg.pool.PoolConnectionProxy[asyncpg.Record]:
    """The pool's next acquisition, which is the connection just released (the pool hands
    out the last one taken back first)."""
    conn = await pool.acquire()
    assert await conn.fetchval("SELECT pg_backend_pid()") == pid
    return conn


async def last_statement(settings: Settings, pid: int) -> str:
    """What the backend ``pid`` ran last, as another connection sees it."""
    other = await asyncpg.connect(settings.pg_dsn)
    try:
        return str(await other.fetchval("SELECT query FROM pg_stat_activity WHERE pid = $1", pid))
    finally:
        await other.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_connection_that_ran_plain_queries_goes_back_without_a_reset(
    pool: Pool, settings: Settings
) -> None:
    async with pool.acquire() as conn:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        assert await conn.fetchval("SELECT 41 + 1 AS plain") == 42
    assert await last_statement(settings, pid) == "SELECT 41 + 1 AS plain"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_session_setting_is_reset_for_the_next_user(pool: Pool) -> None:
    async with pool.acquire() as conn:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        await conn.execute("SET statement_timeout = '1234ms'")
    conn = await next_user(pool, pid)
    try:
        assert await conn.fetchval("SHOW statement_timeout") == "0"
    finally:
        await pool.release(conn)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_listen_left_registered_is_gone_for_the_next_user(pool: Pool) -> None:
    with pytest.warns(asyncpg.InterfaceWarning, match="active notification listener"):
        async with pool.acquire() as conn:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            await conn.add_listener("pool_reset_test", lambda *_: None)  # never removed
    conn = await next_user(pool, pid)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pg_listening_channels()") == 0
    finally:
        await pool.release(conn)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_listen_removed_by_its_user_leaves_no_reset_to_do(
    pool: Pool, settings: Settings
) -> None:
    def woken(*_: object) -> None:
        pass

    async with pool.acquire() as conn:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        await conn.add_listener("pool_reset_test", woken)
        await conn.remove_listener("pool_reset_test", woken)
        assert await conn.fetchval("SELECT count(*) FROM pg_listening_channels()") == 0
    assert await last_statement(settings, pid) == "SELECT count(*) FROM pg_listening_channels()"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_session_advisory_lock_is_released_for_everyone_else(
    pool: Pool, settings: Settings
) -> None:
    async with pool.acquire() as conn:
        await conn.fetchval("SELECT pg_advisory_lock(hashtext('pool_reset_test'))")
    other = await asyncpg.connect(settings.pg_dsn)
    try:
        assert await other.fetchval("SELECT pg_try_advisory_lock(hashtext('pool_reset_test'))")
    finally:
        await other.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_an_open_transaction_is_rolled_back_for_the_next_user(pool: Pool) -> None:
    async with pool.acquire() as conn:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        await conn.execute("BEGIN")
        await conn.execute("CREATE TEMP TABLE IF NOT EXISTS pool_reset_probe (x int)")
    conn = await next_user(pool, pid)
    try:
        assert not await conn.fetchval("SELECT pg_current_xact_id_if_assigned() IS NOT NULL")
        assert await conn.fetchval("SELECT to_regclass('pg_temp.pool_reset_probe')") is None
    finally:
        await pool.release(conn)


@pytest.mark.parametrize(
    ("query", "leaves"),
    [
        ("SET plan_cache_mode = force_generic_plan; SET enable_hashjoin = off", True),
        ("  -- planned once\n  SET jit = off", True),
        ("SELECT 1; RESET ALL", True),
        ("SELECT set_config('search_path', 'x', false)", True),
        ("SELECT pg_try_advisory_lock($1)", True),
        ("SELECT pg_advisory_lock_shared(1)", True),
        ("LISTEN changes", True),
        ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", True),
        ("CREATE TEMPORARY TABLE t (x int)", True),
        ("SET LOCAL statement_timeout = '1s'", False),
        ("SELECT pg_advisory_xact_lock(hashtext($1))", False),
        ("INSERT INTO t VALUES (1) ON CONFLICT (k) DO UPDATE\nSET v = excluded.v", False),
        ("UPDATE sandboxes SET phase = $1 WHERE key = $2", False),
        ("SELECT offset_set FROM input_offsets", False),
    ],
)
def test_statements_that_may_outlive_their_transaction_are_told_apart(
    query: str, leaves: bool
) -> None:
    assert leaves_session_state(query) is leaves
