"""Serving the app with uvicorn inside the embedding process's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from fastapi import FastAPI

from services.api.readmodel import ChangeFeed
from services.common.serving import EmbeddedServer, bind, serve_started, url_of

__all__ = ["ApiServer", "RunningApi", "bind", "start_api"]


# uvicorn without its own signal handling: the embedding process owns the signals.
ApiServer = EmbeddedServer


class RunningApi:
    """A started API server in this event loop; ``stop`` ends watch streams, then the server."""

    def __init__(self, app: FastAPI, server: ApiServer, task: asyncio.Task[None], url: str):
        self.app = app
        self.server = server
        self.task = task
        self.url = url

    async def stop(self) -> None:
        feed: ChangeFeed = self.app.state.feed
        await feed.close()  # ends the watch streams, so no connection holds the shutdown up
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self.task


async def start_api(
    app: FastAPI,
    host: str,
    port: int,
    *,
    access_log: bool = True,
    sock: socket.socket | None = None,
) -> RunningApi:
    sock = sock or bind(host, port)
    actual = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = ApiServer(config)
    task = await serve_started(server, sock, name="api")
    return RunningApi(app, server, task, url_of(host, actual))
