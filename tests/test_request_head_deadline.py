"""Each request head must arrive within the embedded servers' deadline (HeadDeadline in
services/common/serving.py). uvicorn alone held a connection that sent nothing, or sent its head
a byte at a time, for as long as the client liked, and a file descriptor with it (slowloris).

Scaled: the deadline is set to half a second here, through the same code as the product's
30 s; that both servers run it, with that default, is checked on its own. A body, an answer
and an idle kept-alive connection are not under the deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import apikit
import pytest

from services.common.health import Readiness, start_health
from services.common.serving import (
    HEAD_SECONDS,
    EmbeddedServer,
    HeadDeadline,
    bind,
    http_config,
    serve_started,
)

SCALED = 0.5  # the deadline in these tests
CLOSED_WITHIN = 10.0  # how long a test waits for the server's close before it fails


@pytest.fixture
def scaled() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HeadDeadline, "head_seconds", SCALED)
        yield


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection (fails if it keeps it open)."""
    return await asyncio.wait_for(reader.read(), CLOSED_WITHIN)


async def test_the_api_closes_a_connection_that_sends_no_request(scaled: None) -> None:
    async with apikit.running_api(None) as api:
        reader, writer = await asyncio.open_connection(*address(api.url))
        try:
            assert await closed_by_server(reader) == b""
        finally:
            writer.close()


async def test_the_api_closes_a_connection_sending_its_head_a_byte_at_a_time(
    scaled: None,
) -> None:
    """Each byte arrives well within the deadline; the head as a whole does not."""
    async with apikit.running_api(None) as api:
        reader, writer = await asyncio.open_connection(*address(api.url))
        sent = 0

        async def trickle() -> None:
            nonlocal sent
            for byte in b"GET /healthz HTTP/1.1\r\nHost: sandstream\r\nX-Slow: " + b"a" * 10_000:
                writer.write(bytes([byte]))
                sent += 1
                await asyncio.sleep(SCALED / 10)  # the client's pace, not a wait on the server

        trickling = asyncio.create_task(trickle())
        try:
            assert await closed_by_server(reader) == b""
            assert sent >= 5  # bytes kept coming, each a tenth of the deadline after the last
        finally:
            trickling.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await trickling
            writer.close()


async def echo_length(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, then answers its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    answer = str(size).encode()
    length = [(b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": length})
    await send({"type": "http.response.body", "body": answer})


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[tuple[EmbeddedServer, tuple[str, int]]]:
    sock = bind("127.0.0.1", 0)
    server = EmbeddedServer(http_config(echo_length, lifespan="off"))
    task = await serve_started(server, sock)
    try:
        yield server, ("127.0.0.1", sock.getsockname()[1])
    finally:
        server.should_exit = True
        await task


async def test_a_body_slower_than_the_deadline_is_not_cut(scaled: None) -> None:
    body = b"0123456789"
    async with echo_server() as (_, where):
        reader, writer = await asyncio.open_connection(*where)
        head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode())
        for byte in body:  # two seconds of body (the client's pace): four deadlines
            await asyncio.sleep(SCALED * 4 / len(body))
            writer.write(bytes([byte]))
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSED_WITHIN)
        assert answer.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"10"
        writer.close()


async def test_a_kept_alive_connection_idle_past_the_deadline_is_kept_until_a_head_is_late(
    scaled: None,
) -> None:
    async with echo_server() as (server, where):
        reader, writer = await asyncio.open_connection(*where)
        request = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab"
        for _ in range(2):
            writer.write(request)
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSED_WITHIN)
            assert answer.startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(1) == b"2"
            [protocol] = server.server_state.connections
            assert isinstance(protocol, HeadDeadline)
            assert protocol.head_timer is None  # idle: the keep-alive timeout's, not ours
            # Idle past the deadline: nothing arrives, the connection is not closed (a close
            # would end this read at once with b"").
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), SCALED * 2)
        # The next head, begun and never finished: its deadline counts from its first byte.
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\n")
        assert await closed_by_server(reader) == b""
        writer.close()


async def _ready() -> Readiness:
    return Readiness(True, "ok", {})


async def test_the_api_and_the_health_endpoints_run_the_deadline_at_its_default(
    tmp_path: Path,
) -> None:
    assert HeadDeadline.head_seconds == HEAD_SECONDS == 30.0
    async with apikit.running_api(None) as api:
        assert api.server.server.config.http is HeadDeadline
    health = await start_health("processor", _ready, "127.0.0.1", 0, None, tmp_path / "none")
    try:
        assert health.server.config.http is HeadDeadline
    finally:
        await health.stop()


def address(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port)
