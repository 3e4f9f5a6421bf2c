"""The PostgreSQL pool every role opens: the schema from the settings on every connection."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import asyncpg

from services.common.pool_reset import SessionAware, reset_if_needed
from services.common.settings import Settings

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"
Connection: TypeAlias = "asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"


async def connect_pool(settings: Settings, **kwargs: Any) -> Pool:
    kwargs.setdefault("server_settings", {"search_path": settings.pg_schema})
    # A connection taken back is reset only if it may carry session state (pool_reset.py).
    kwargs.setdefault("connection_class", SessionAware)
    kwargs.setdefault("reset", reset_if_needed)
    pool = await asyncpg.create_pool(settings.pg_dsn, min_size=2, max_size=8, **kwargs)
    assert pool is not None
    return pool


@asynccontextmanager
async def planned_for_now(pool: Pool) -> AsyncIterator[Connection]:
    """A connection in a transaction whose statements are planned for their arguments and the
    tables as they are now (``force_custom_plan``). asyncpg keeps each statement prepared, and
    PostgreSQL may keep a generic plan made when a table was empty: made on an outbox analysed
    empty (housekeeping drains it), a walk of one key's events stayed a scan of the whole outbox
    until the next ANALYZE."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
        yield conn
