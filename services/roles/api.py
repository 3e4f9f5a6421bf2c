"""`sandstream api`: the HTTP API as a process of its own; N of them serve the same rows and
publish to the same log (no state of their own beyond the change feed each one polls).

The OpenShell gRPC API runs as its own process (``python -m services.openshell``) in this
layout; the provider-sync controller as ``sandstream provider-sync`` (one instance).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import asyncpg

from events.publisher import CommandPublisher
from projections.store import DATABASE_ERRORS
from services.api.app import create_app
from services.api.server import RunningApi, Tls, start_api
from services.common.database import connect_pool
from services.common.health import Readiness
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.common.tokens import TokenStore


@dataclass
class ApiRole:
    settings: Settings
    name: str = "api"
    started: bool = False
    api: RunningApi | None = None
    pool: asyncpg.Pool[asyncpg.Record] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        tokens = TokenStore.from_file(self.settings.tokens_file)  # `sandstream prepare` made it
        pool = self.pool = await connect_pool(self.settings)
        publisher = CommandPublisher(kafka_client_args(self.settings, "api"),
                                     topic=self.settings.topic_commands)  # fmt: skip
        try:
            await publisher.__aenter__()
            app = create_app(self.settings, pool, publisher, tokens)
            api = self.api = await start_api(
                app,
                self.settings.api_host,
                self.settings.api_port,
                tls=Tls.of(self.settings),
                trusted_proxies=self.settings.trusted_proxies,
            )
            self.started = True
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, api.task], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not stop.is_set():
                raise RuntimeError("the API server stopped by itself")
        finally:
            if self.api is not None:
                await self.api.stop()  # ends the watch streams, then the server
            with contextlib.suppress(Exception):
                await publisher.__aexit__()
            await pool.close()

    async def readiness(self) -> Readiness:
        if self.api is None or self.pool is None or not self.started:
            return Readiness(False, "starting")
        detail = {"url": self.api.url}
        if self.api.task.done():
            return Readiness(False, "the API server stopped", detail)
        try:
            await self.pool.fetchval("SELECT 1")
        except DATABASE_ERRORS as exc:
            return Readiness(False, f"PostgreSQL unreachable: {exc!r}", detail)
        return Readiness(True, "", detail)
