"""The PostgreSQL pool every role opens: the schema from the settings on every connection."""

from __future__ import annotations

from typing import Any, TypeAlias

import asyncpg

from services.common.settings import Settings

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"


async def connect_pool(settings: Settings, **kwargs: Any) -> Pool:
    kwargs.setdefault("server_settings", {"search_path": settings.pg_schema})
    pool = await asyncpg.create_pool(settings.pg_dsn, min_size=2, max_size=8, **kwargs)
    assert pool is not None
    return pool
