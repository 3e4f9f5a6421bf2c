"""The embedded HTTP servers (the API, the roles' health endpoints) answer without Nagle's
algorithm: uvicorn writes an answer's headers and body in two sends, and with Nagle on the
body waited for the client's delayed acknowledgement of the headers (40 ms on Linux)."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import uvicorn

from services.common.serving import EmbeddedServer, bind, serve_started, url_of


async def ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def nodelay(protocol: Any) -> int:
    sock: socket.socket = protocol.transport.get_extra_info("socket")
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def test_a_served_connection_has_nagle_off() -> None:
    sock = bind("127.0.0.1", 0)
    server = EmbeddedServer(uvicorn.Config(ok, log_config=None, lifespan="off"))
    task = await serve_started(server, sock)
    try:
        url = url_of("127.0.0.1", sock.getsockname()[1])
        async with httpx.AsyncClient(base_url=url) as client:
            answer = await client.get("/")  # the connection stays open (keep-alive)
            assert answer.text == "ok"
            connections = list(server.server_state.connections)
            assert connections, "the server holds the client's connection"
            assert [nodelay(c) for c in connections] == [1] * len(connections)
    finally:
        server.should_exit = True
        await task
