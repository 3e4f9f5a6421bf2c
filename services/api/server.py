"""Serving the app with uvicorn inside the embedding process's event loop, over TLS when given
a certificate."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from services.api.readmodel import ChangeFeed
from services.common.secret_files import check_private
from services.common.settings import Settings


class ApiServer(uvicorn.Server):
    """uvicorn without its own signal handling: the embedding process owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: an ephemeral port); raises OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


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


@dataclass(frozen=True, slots=True)
class Tls:
    """The server's certificate (PEM, its chain after it) and private key."""

    certfile: Path
    keyfile: Path

    @classmethod
    def of(cls, settings: Settings) -> Tls | None:
        """From the settings (api_tls_certfile, api_tls_keyfile): both or neither; the key
        file must not be readable by others."""
        cert, key = settings.api_tls_certfile, settings.api_tls_keyfile
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise ValueError("TLS needs both api_tls_certfile and api_tls_keyfile")
        check_private(key)
        return cls(cert, key)


async def start_api(
    app: FastAPI,
    host: str,
    port: int,
    *,
    access_log: bool = True,
    sock: socket.socket | None = None,
    tls: Tls | None = None,
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
        ssl_certfile=tls.certfile if tls else None,
        ssl_keyfile=tls.keyfile if tls else None,
    )
    server = ApiServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="api")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the API server stopped during startup")
        if loop.time() > deadline:
            raise RuntimeError("the API server did not start within 30s")
        await asyncio.sleep(0.01)
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", ""):
        shown = "127.0.0.1"
    return RunningApi(app, server, task, f"{'https' if tls else 'http'}://{shown}:{actual}")
