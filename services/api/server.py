"""Serving the app with uvicorn inside the embedding process's event loop, over TLS when given
a certificate."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from services.api.readmodel import ChangeFeed
from services.common.secret_files import check_private
from services.common.serving import EmbeddedServer, bind, http_config, serve_started, url_of
from services.common.settings import Settings

__all__ = ["ApiServer", "RunningApi", "Tls", "bind", "start_api"]


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
    trusted_proxies: Sequence[str] = (),
) -> RunningApi:
    """Serve ``app``; X-Forwarded-Proto and -For count only from ``trusted_proxies`` (IP
    addresses or networks; empty: from no one, so no client can claim https or another
    address)."""
    sock = sock or bind(host, port)
    actual = sock.getsockname()[1]
    config = http_config(
        app,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=5,
        ssl_certfile=tls.certfile if tls else None,
        ssl_keyfile=tls.keyfile if tls else None,
        proxy_headers=bool(trusted_proxies),
        forwarded_allow_ips=list(trusted_proxies),
    )
    server = ApiServer(config)
    task = await serve_started(server, sock, name="api")
    return RunningApi(app, server, task, url_of(host, actual, "https" if tls else "http"))
