"""The HTTP API, assembled: one router per resource, dependencies and error handlers declared
once (see the package docstring for what each module holds).

``create_app(settings, pool, publisher, tokens)`` builds the FastAPI application. Commands go
to Kafka through the gateway; reads only query PostgreSQL; nothing here makes a
lifecycle call to a driver (logs are read from the runtime through a log source, files read
and written through a file source, and exec runs a command through the driver's exec
capability).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI

from drivers.files import FilesBackend
from drivers.logs import LogSource
from drivers.protocol import ExecDriver
from events.publisher import CommandPublisher
from services.api import console, idempotency
from services.api.deps import ApiState, Pool
from services.api.gateway import CommandGateway
from services.api.guard import GuardMiddleware
from services.api.handlers import install_error_handlers
from services.api.middleware import MetricsMiddleware
from services.api.probe import KafkaProbe
from services.api.providers import ProviderService
from services.api.readmodel import ChangeFeed
from services.api.routes import (
    audit,
    commands,
    exec,
    files,
    history,
    lifecycle,
    operations,
    pools,
    providers,
    sandboxes,
    templates,
    watch,
)
from services.api.routes import (
    logs as logs_routes,
)
from services.common.exec_sessions import ExecLimits
from services.common.settings import Settings
from services.common.tokens import TokenStore
from services.executor.exec_sources import exec_source
from services.executor.file_sources import file_source
from services.executor.log_sources import log_source

# The order of inclusion is the order of the paths in the OpenAPI document.
ROUTE_MODULES = (
    commands, lifecycle, sandboxes, logs_routes, exec, files, history, watch, audit, operations,
    providers, templates, pools,
)  # fmt: skip


def create_app(
    settings: Settings,
    pool: Pool,
    publisher: CommandPublisher,
    tokens: TokenStore,
    *,
    poll_interval: float = 1.0,
    publish_timeout: float | None = None,
    down: Callable[[], dict[str, str]] | None = None,
    logs: LogSource | None = None,
    files: FilesBackend | None = None,
    exec_driver: ExecDriver | Literal["settings"] | None = "settings",
    exec_limits: ExecLimits | None = None,
) -> FastAPI:
    """``logs``, ``files``: the runtime's log and file sources (default: those of
    ``settings``' driver, closed with the app); ``exec_driver``: the driver exec runs
    commands through (default: the one of ``settings``, closed with the app; None: no exec);
    ``exec_limits``: the exec sessions' bounds and counts (default: new ones of
    ``settings``)."""
    own_logs = logs is None
    logs = log_source(settings) if logs is None else logs
    own_files = files is None
    files = file_source(settings) if files is None else files
    owned_exec = exec_source(settings) if exec_driver == "settings" else None
    execs = owned_exec if exec_driver == "settings" else exec_driver
    feed = ChangeFeed(pool, poll_interval=poll_interval)
    probe = KafkaProbe(settings, publisher)
    gateway = CommandGateway.of_role(
        settings, pool, publisher, feed, poll_interval=poll_interval,
        publish_timeout=publish_timeout,
    )  # fmt: skip
    provider_service = ProviderService(settings, pool, gateway)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await feed.start()
        # Every API process relays the provider outbox (docs/adr/0005). Cancelled at shutdown
        # rather than awaited: a send in flight may wait out the publish timeout, and what it
        # leaves stays stored for the next relay.
        relay = asyncio.create_task(provider_service.relay(asyncio.Event()), name="provider relay")
        # Every API process forgets expired command ids (deleting what another already did is
        # a no-op).
        retention = settings.api_command_retention_hours
        sweep = asyncio.create_task(
            idempotency.keep_forgetting(pool, retention, asyncio.Event()), name="command ids"
        )
        try:
            yield
        finally:
            for task in (relay, sweep):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await feed.close()
            await probe.close()
            if own_logs:
                await logs.close()
            if own_files:
                await files.close()
            if owned_exec is not None:
                await owned_exec.close()

    app = FastAPI(
        title="sandstream",
        version="1",
        summary="Control plane for agent sandboxes: commands in, phases out.",
        description="Commands are published to Kafka and decided by the lifecycle processor; "
        "reads come from the PostgreSQL projection. Errors are `{code, message}`.",
        lifespan=lifespan,
    )
    app.state.tokens = tokens
    app.state.feed = feed
    limits = ExecLimits.of(settings) if exec_limits is None else exec_limits
    app.state.api = ApiState(settings, pool, feed, gateway, probe, down, logs, files, execs, limits)
    # Last added runs first: metrics see every answer, the guard's 401/403/413 included.
    app.add_middleware(
        GuardMiddleware,
        max_body_bytes=settings.api_max_body_bytes,
        max_upload_bytes=settings.files_max_upload_bytes,
    )
    app.state.providers = provider_service
    app.add_middleware(MetricsMiddleware)
    install_error_handlers(app)
    for module in ROUTE_MODULES:
        app.include_router(module.router)
    console.mount(app)  # the operator's console under /ui/
    return app
