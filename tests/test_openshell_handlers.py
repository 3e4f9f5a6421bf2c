"""The door's error mapping on a real gRPC server: a lost database is UNAVAILABLE and anything
else INTERNAL, each with a plain message, never UNKNOWN with an exception's text; a command
Kafka did not acknowledge or no processor decided in time is UNAVAILABLE naming the id to retry
with (one Kafka refuses for want of an ACL is INTERNAL: tests/test_kafka_forbidden.py); a watch
that loses its database ends UNAVAILABLE. Also ListSandboxes' page bounds: no answer holds more
than one page (real PostgreSQL and Kafka)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import grpc
import pytest
from harness import isolated_env
from tcp_proxy import TcpProxy

from events.publisher import CommandPublisher
from services.api.gateway import CommandGateway
from services.api.readmodel import MAX_PAGE, ChangeFeed
from services.common.database import connect_pool
from services.common.exec_sessions import ExecLimits
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.common.tokens import TokenStore
from services.localstack.private_broker import free_port
from services.openshell import handlers
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1
from services.openshell.sandboxes import DEFAULT_PAGE, MAX_OFFSET
from services.openshell.service import Authenticator, Door

SCOPE = dm1.WorkspaceSelector(workspace="default")


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
    async with serving(server) as opened:
        yield opened


@asynccontextmanager
async def serving(server: grpc.aio.Server) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to ``server``, started on a free port and stopped after."""
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


# -- the door's own mappings, on real PostgreSQL and Kafka ----------------------------------------


@asynccontextmanager
async def door_channel(
    settings: Settings, pool: Any, gateway: CommandGateway, **door: Any
) -> AsyncIterator[grpc.aio.Channel]:
    """The OpenShell door over ``pool`` and ``gateway`` (unauthenticated local calls)."""
    served = Door(
        pool=pool, gateway=gateway, auth=Authenticator(TokenStore.of(), True), driver=None,
        logs=None, providers=None, driver_name="podman", default_image=settings.sandbox_image,
        events_topic=settings.topic_events, **door,
    )  # fmt: skip
    server = grpc.aio.server()
    limits = ExecLimits(timeout=5.0, per_token=1, total=1)
    server.add_generic_rpc_handlers((handlers.OpenShellService(served, limits).generic_handler(),))
    async with serving(server) as opened:
        yield opened


def rpc(channel: grpc.aio.Channel, method: str, request: Any, answer: Any) -> Any:
    """A 0.1 client's call (a stream for Watch)."""
    make = channel.unary_stream if method == "WatchSandbox" else channel.unary_unary
    return make(
        f"/openshell.v1.OpenShell/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=answer.FromString,
    )(request, timeout=60)


def create_call(channel: grpc.aio.Channel, request_id: str) -> Any:
    request = os1.CreateSandboxRequest(
        name="door", workspace_scope=SCOPE, spec=os1.SandboxSpec(), request_id=request_id
    )
    return rpc(channel, "CreateSandbox", request, os1.SandboxResponse)


async def test_a_command_kafka_does_not_acknowledge_is_unavailable_naming_the_request_id() -> None:
    """UNAVAILABLE for an unacknowledged command is as old as the door; what this checks beyond
    it is that the message names 0.1's request_id to retry with (the door used to name only the
    metadata id). A publish timeout of 0: the gateway gives up before Kafka can acknowledge,
    as it does when a broker does not answer in time (a topic the principal may not write is a
    refusal, INTERNAL: tests/test_kafka_forbidden.py)."""
    async with (
        isolated_env(partitions=1) as env,
        CommandPublisher(
            kafka_client_args(env.settings, "api"), topic=env.settings.topic_commands
        ) as publisher,
    ):
        feed = ChangeFeed(env.pool)
        gateway = CommandGateway(env.pool, publisher, feed, publish_timeout=0)
        async with door_channel(env.settings, env.pool, gateway) as channel:
            lost = await failure(create_call(channel, "req-kafka-gone"))
    assert lost.code() == grpc.StatusCode.UNAVAILABLE
    assert (lost.details() or "").startswith("Kafka did not acknowledge the command")
    assert "retry with the same request_id" in (lost.details() or "")
    assert "req-kafka-gone" in (lost.details() or "")


async def test_a_command_not_decided_in_time_is_unavailable() -> None:
    """Published, but no processor decides it: UNAVAILABLE naming the id to retry with, not an
    answer without an outcome (as the door has answered since its first version)."""
    async with (
        isolated_env(partitions=1) as env,
        CommandPublisher(
            kafka_client_args(env.settings, "api"), topic=env.settings.topic_commands
        ) as publisher,
    ):
        feed = ChangeFeed(env.pool, poll_interval=0.1)
        await feed.start()
        try:
            gateway = CommandGateway(env.pool, publisher, feed)
            async with door_channel(env.settings, env.pool, gateway, outcome_wait=0.5) as channel:
                late = await failure(create_call(channel, "req-undecided"))
        finally:
            await feed.close()
    assert late.code() == grpc.StatusCode.UNAVAILABLE
    assert "not decided within" in (late.details() or "")
    assert "req-undecided" in (late.details() or "")


@asynccontextmanager
async def door_over_a_proxy(env: Any) -> AsyncIterator[tuple[grpc.aio.Channel, TcpProxy]]:
    """The door over a pool that reaches PostgreSQL through a proxy the test can cut, with one
    Ready row named 'door' (no commands: the gateway has no publisher)."""
    await env.pool.execute(
        "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers,"
        " identity, created_at, updated_at, partition, change_seq) VALUES ('door', $1,"
        " 'Ready', 1, 2, '{\"image\": \"x\"}', '{}', 'i', now(), now(), 0, 1)",
        uuid.uuid4(),
    )
    proxy = TcpProxy(free_port(), env.settings.pg_port)
    await proxy.restore()
    moved = env.settings.model_copy(update={"pg_port": proxy.port})
    pool = await connect_pool(moved)
    feed = ChangeFeed(pool, poll_interval=0.1)
    await feed.start()
    try:
        gateway = CommandGateway(pool, None, feed)  # type: ignore[arg-type]  (no commands)
        async with door_channel(env.settings, pool, gateway) as channel:
            yield channel, proxy
    finally:
        await feed.close()
        await proxy.cut()
        pool.terminate()


async def test_a_watch_whose_database_is_lost_ends_unavailable() -> None:
    """The status part of a watch failed inside its own task, and the stream then ended as if
    the watch were done (OK): a client took that for the end of the sandbox."""
    async with isolated_env(partitions=1) as env, door_over_a_proxy(env) as (channel, proxy):
        request = os1.WatchSandboxRequest(sandbox="door", workspace_scope=SCOPE, follow_status=True)
        watch = rpc(channel, "WatchSandbox", request, os1.SandboxStreamEvent)
        first = await watch.read()
        assert first.sandbox.status.phase == os1.SANDBOX_PHASE_READY
        await proxy.cut()
        lost = await failure(watch.read())
    assert lost.code() == grpc.StatusCode.UNAVAILABLE
    assert lost.details() == handlers.UNAVAILABLE_MESSAGE


async def test_a_read_whose_database_is_lost_is_unavailable_without_its_details() -> None:
    """A real loss (PostgreSQL cut off) under GetSandbox: UNAVAILABLE with the plain message.
    The door without the mapping answered UNKNOWN with asyncpg's text."""
    async with isolated_env(partitions=1) as env, door_over_a_proxy(env) as (channel, proxy):
        get = os1.GetSandboxRequest(name="door", workspace_scope=SCOPE)
        found = await rpc(channel, "GetSandbox", get, os1.SandboxResponse)
        assert found.sandbox.metadata.name == "door"
        await proxy.cut()
        lost = await failure(rpc(channel, "GetSandbox", get, os1.SandboxResponse))
    assert lost.code() == grpc.StatusCode.UNAVAILABLE
    assert lost.details() == handlers.UNAVAILABLE_MESSAGE


async def test_a_list_answer_holds_one_page_however_many_rows_there_are() -> None:
    """More live rows than the largest page: a list without a size answers DEFAULT_PAGE rows
    (0.1 with its next_page_token, 0.0 as well), a bigger page_size is held to MAX_PAGE, the
    tokens reach every row once, and a 0.0 offset beyond MAX_OFFSET is INVALID_ARGUMENT. Before
    the bound, a list without a size read every row into one answer."""
    rows = MAX_PAGE + 1
    async with isolated_env(partitions=1) as env:
        await env.pool.execute(
            "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers,"
            " identity, created_at, updated_at, partition, change_seq) SELECT"
            " format('page-%s', lpad(i::text, 4, '0')), gen_random_uuid(), 'Ready', 1, 2,"
            " '{\"image\": \"x\"}', '{}', 'i', now(), now(), 0, i FROM generate_series(1, $1) i",
            rows,
        )
        gateway = CommandGateway(env.pool, None, ChangeFeed(env.pool))  # type: ignore[arg-type]
        async with door_channel(env.settings, env.pool, gateway) as channel:

            async def page(**request: Any) -> Any:
                asked = os1.ListSandboxesRequest(workspace_scope=SCOPE, **request)
                return await rpc(channel, "ListSandboxes", asked, os1.ListSandboxesResponse)

            unsized = await page()
            assert len(unsized.sandboxes) == DEFAULT_PAGE and unsized.next_page_token
            seen, token = [], ""
            while True:
                big = await page(page_size=MAX_PAGE * 2, page_token=token)
                assert len(big.sandboxes) <= MAX_PAGE
                seen += [s.metadata.name for s in big.sandboxes]
                token = big.next_page_token
                if not token:
                    break
            assert seen == [f"page-{i:04}" for i in range(1, rows + 1)]
            old = await rpc(
                channel, "ListSandboxes", pb.ListSandboxesRequest(), pb.ListSandboxesResponse
            )
            assert len(old.sandboxes) == DEFAULT_PAGE
            deep = pb.ListSandboxesRequest(limit=1, offset=MAX_OFFSET + 1)
            refused = await failure(rpc(channel, "ListSandboxes", deep, pb.ListSandboxesResponse))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == f"offset: at most {MAX_OFFSET}"
