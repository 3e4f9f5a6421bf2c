"""Serving an ASGI app with uvicorn inside the embedding process's event loop (the HTTP API,
the roles' health endpoints)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

# How long an idle kept-alive connection stays open. Longer than the clients' own idle expiry
# (httpx's, so the SDK's and the CLI's, is 5 s; load balancers' 60 s), so that the client drops
# an idle connection first: a server that closes it just as a client sends on it fails that
# request with a read error, and uvicorn's default (5 s) raced httpx's to the millisecond.
KEEP_ALIVE_SECONDS = 75
# How long a connection may take to send a whole request head (line and headers), counted from
# its opening or from the first byte after an answer: nginx's client_header_timeout is 60 s;
# the CLI and the SDK send a head in one write.
HEAD_SECONDS = 30.0


class HeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request head.

    uvicorn has none: a connection that sent nothing, or a head a byte at a time, was held
    for as long as the client liked, and with it a file descriptor (slowloris). A body, an
    answer and an idle kept-alive connection are not under it (a slow upload or a watch
    stream runs as long as it needs; uvicorn's keep-alive timeout closes an idle one).
    """

    head_seconds = HEAD_SECONDS  # a class attribute, so the scaled tests can set it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still waiting for the rest of a head
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.head_timer is None and not self.transport.is_closing():
            self.head_timer = self.loop.call_later(self.head_seconds, self._head_late)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def http_config(app: Any, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for every embedded server: HeadDeadline, the keep-alive above, no
    logging configuration of its own; ``options`` add to them."""
    return uvicorn.Config(
        app, http=HeadDeadline, log_config=None, timeout_keep_alive=KEEP_ALIVE_SECONDS, **options
    )


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the embedding process owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: an ephemeral port); raises OSError when the port is taken.

    Made with the protocol named (IPPROTO_TCP): asyncio turns Nagle's algorithm off on the
    connections it accepts only when their protocol says TCP, and a socket made with the default
    (0) says nothing. With Nagle on, an answer written in two parts (uvicorn writes the headers,
    then the body) waited for the client's delayed acknowledgement of the first: 40 ms more on
    every request on Linux.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def serve_started(
    server: EmbeddedServer, sock: socket.socket, name: str = "http"
) -> asyncio.Task[None]:
    """Start ``server`` on ``sock``; returns its task (named ``name``) once it accepts
    connections."""
    task = asyncio.create_task(server.serve(sockets=[sock]), name=name)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped during startup")
        if loop.time() > deadline:
            raise RuntimeError("the HTTP server did not start within 30s")
        await asyncio.sleep(0.01)
    return task


def url_of(host: str, port: int, scheme: str = "http") -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", ""):
        shown = "127.0.0.1"
    return f"{scheme}://{shown}:{port}"
