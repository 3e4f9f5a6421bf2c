"""The door's error mapping on a real gRPC server: a lost database is UNAVAILABLE and anything
else INTERNAL, each with a plain message, never UNKNOWN with an exception's text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest

from services.openshell import handlers
from services.openshell.proto import openshell_pb2 as pb


async def lost_database(raw: bytes, context: object) -> pb.HealthResponse:
    raise asyncpg.exceptions.ConnectionDoesNotExistError("password=hunter2 connection lost")


async def broken(raw: bytes, context: object) -> pb.HealthResponse:
    raise ValueError("internal detail: /srv/secret/path")


async def streaming_lost(raw: bytes, context: object) -> AsyncIterator[pb.HealthResponse]:
    yield pb.HealthResponse()
    raise OSError("connection refused by 10.0.0.7:5432")


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    methods = {
        "Lost": handlers._unary("Lost", lost_database),
        "Broken": handlers._unary("Broken", broken),
        "Stream": handlers._streaming("Stream", streaming_lost),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as opened:
            yield opened
    finally:
        await server.stop(0)


async def failure(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    return raised.value


async def test_a_lost_database_is_unavailable_and_nothing_internal_leaks(
    channel: grpc.aio.Channel,
) -> None:
    lost = await failure(channel.unary_unary("/t.T/Lost")(b""))
    assert lost.code() == grpc.StatusCode.UNAVAILABLE
    assert lost.details() == handlers.UNAVAILABLE_MESSAGE
    other = await failure(channel.unary_unary("/t.T/Broken")(b""))
    assert other.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in (other.details() or "") and "Broken" in (other.details() or "")
    stream = channel.unary_stream("/t.T/Stream")(b"")
    assert await stream.read() == b""  # the first answer, then the loss
    late = await failure(stream.read())
    assert late.code() == grpc.StatusCode.UNAVAILABLE
    assert "10.0.0.7" not in (late.details() or "")
