"""What each request pays for being served: the embedded HTTP servers (the API, the roles'
health endpoints) answer without Nagle's algorithm (uvicorn writes an answer's headers and body
in two sends, and with Nagle on the body waited for the client's delayed acknowledgement of the
headers: 40 ms on Linux), and no API request hops to a worker thread (FastAPI runs a plain
function endpoint or dependency in its thread pool). And what a client pays for reusing a
connection: the servers keep an idle one open well past httpx's expiry (the SDK's, the CLI's),
so the client drops it first and never sends on a connection the server is closing (a CI run
failed on that race)."""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import apikit
import httpx
import uvicorn
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from harness import eventually
from starlette.routing import BaseRoute

from services.common.health import Readiness, start_health
from services.common.serving import EmbeddedServer, bind, serve_started, url_of

HTTPX_IDLE_EXPIRY = httpx.Limits().keepalive_expiry or 5.0  # how long the SDK keeps a connection


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


async def idle_close_after(server: uvicorn.Server, url: str) -> float:
    """Seconds until ``server`` would close a connection a client left idle after a request:
    the close timer uvicorn arms on that connection once its answer is sent."""
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/healthz")).status_code == 200  # the connection stays open
        protocols = await eventually(
            lambda: [c for c in server.server_state.connections if c.timeout_keep_alive_task],
            lambda armed: len(armed) == 1,
            what="the idle connection's close timer armed",
        )
        return float(protocols[0].timeout_keep_alive_task.when() - loop.time())


async def test_the_api_keeps_an_idle_connection_open_longer_than_its_clients_do() -> None:
    """The old code armed 5 s, httpx's own expiry: a request sent just as both ran out was met
    by the close (a read error). The server's close must come well after the client's (twice
    its expiry: a margin for a busy loop, not a figure of its own)."""
    async with apikit.running_api(None) as api:
        assert await idle_close_after(api.server.server, api.url) > 2 * HTTPX_IDLE_EXPIRY


async def _ready() -> Readiness:
    return Readiness(True, "ok", {})


async def test_a_health_endpoint_keeps_an_idle_connection_open_longer_than_its_clients_do(
    tmp_path: Path,
) -> None:
    health = await start_health("processor", _ready, "127.0.0.1", 0, None, tmp_path / "none")
    try:
        assert await idle_close_after(health.server, health.url) > 2 * HTTPX_IDLE_EXPIRY
    finally:
        await health.stop()


def api_routes(routes: Sequence[BaseRoute]) -> Iterator[APIRoute]:
    """Every endpoint, through the routers included in one another."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif (router := getattr(route, "original_router", None)) is not None:
            yield from api_routes(router.routes)
        elif (inner := getattr(route, "routes", None)) is not None:
            yield from api_routes(inner)


def run_in_a_thread(dependant: Dependant) -> Iterator[str]:
    """The endpoint and dependencies FastAPI would call in its thread pool."""
    call = dependant.call
    if call is not None and not any(
        inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)
        for f in (call, type(call).__call__)  # a function, or an instance (HTTPBearer)
    ):
        yield getattr(call, "__qualname__", repr(call))
    for inner in dependant.dependencies:
        yield from run_in_a_thread(inner)


async def test_no_api_endpoint_or_dependency_runs_in_a_worker_thread() -> None:
    async with apikit.running_api(None) as api:
        routes = list(api_routes(api.app.routes))
        assert len(routes) > 30  # the walk reaches the included routers' endpoints
        threaded = {(r.path, name) for r in routes for name in run_in_a_thread(r.dependant)}
        assert threaded == set()
