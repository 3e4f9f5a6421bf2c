"""PostgreSQL behind a proxy that holds the server's closes: a session the server ends has sent
its goodbye ("terminating connection due to administrator command") but is not yet seen closed,
the window a PostgreSQL restart opens for every idle connection."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from harness import Env, eventually
from tcp_proxy import TcpProxy

from services.common.settings import Settings
from services.localstack.private_broker import free_port


@asynccontextmanager
async def behind_holding_proxy(settings: Settings) -> AsyncIterator[tuple[Settings, TcpProxy]]:
    """``settings`` moved to the proxy; clients made with them must close before this exits
    (the proxy is cut first, so a polite close does not wait for a held end)."""
    proxy = TcpProxy(free_port(), settings.pg_port, hold_closes=True)
    await proxy.restore()
    try:
        yield settings.model_copy(update={"pg_port": proxy.port}), proxy
    finally:
        await proxy.cut()


@asynccontextmanager
async def single_connection_pool(
    settings: Settings,
) -> AsyncIterator[tuple[asyncpg.Pool[asyncpg.Record], TcpProxy]]:
    """A pool of one connection behind a holding proxy."""
    async with behind_holding_proxy(settings) as (moved, proxy):
        pool = await asyncpg.create_pool(
            moved.pg_dsn, min_size=1, max_size=1,
            server_settings={"search_path": moved.pg_schema},
        )  # fmt: skip
        assert pool is not None
        try:
            yield pool, proxy
        finally:
            await proxy.cut()
            await pool.close()


async def say_goodbye(env: Env, proxy: TcpProxy, sessions: list[int]) -> None:
    """End ``sessions`` from the server side and return once their goodbyes are in the
    clients' sockets (and their closes held)."""
    held = proxy.closes_held
    await env.fetch("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", sessions)
    await eventually(
        lambda: proxy.closes_held - held, lambda n: n >= len(sessions), what="goodbyes held"
    )
