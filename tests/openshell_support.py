"""The OpenShell gRPC gateway of the API tests: a control plane with the Podman driver and the
gRPC server in this process, on real Kafka, PostgreSQL and Podman (an isolated environment),
with tokens (no unauthenticated calls); and the helpers the tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from harness import Env
from pipeline_support import podman_env, running_plane
from podman import PodmanClient

from drivers.logs import LogSource
from events.publisher import CommandPublisher
from services.api.gateway import CommandGateway
from services.api.readmodel import ChangeFeed
from services.common.kafka_clients import kafka_client_args
from services.common.tokens import EXEC, PROVIDER_READ, PROVIDER_WRITE, READ, WRITE, TokenStore
from services.executor.log_sources import log_source
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import openshell_pb2_grpc
from services.openshell.server import RunningOpenShell, start_openshell
from services.openshell.service import COMMAND_ID_KEY

ADMIN = "sst_admin-token-for-tests"
READER = "sst_reader-token-for-tests"
WRITER = "sst_writer-token-for-tests"  # sandbox:read and :write, nothing else
EXECUTOR = "sst_executor-token-for-tests"  # sandbox:read and :exec
WAIT = 60.0
EXEC_LIMIT = 5  # seconds an exec may run here (the setting; the default is an hour)
EXEC_SESSIONS = 2  # exec sessions one token may have open here
EXEC_TOTAL = 3  # exec sessions all tokens together may have open here
Phase = pb.SandboxPhase
PATH = "/openshell.v1.OpenShell/"


@dataclass
class Gateway:
    stub: openshell_pb2_grpc.OpenShellStub
    channel: grpc.aio.Channel
    server: RunningOpenShell
    new_name: Any  # () -> a fresh sandbox name, cleaned up afterwards
    made: list[str]
    env: Env
    commands: CommandGateway  # the door's own command gateway, for commands it cannot send


def auth(token: str = ADMIN, command_id: str | None = None) -> list[tuple[str, str]]:
    metadata = [("authorization", f"Bearer {token}")]
    if command_id is not None:
        metadata.append((COMMAND_ID_KEY, command_id))
    return metadata


@asynccontextmanager
async def running_gateway(
    podman: PodmanClient,
    prefix: str = "osapi",
    wrap_logs: Callable[[LogSource], LogSource] | None = None,
    token_store: TokenStore | None = None,
    **settings: Any,
) -> AsyncIterator[Gateway]:
    """A gateway on a control plane of its own; ``settings`` override the environment's;
    ``wrap_logs`` stands between the gateway and the driver's log source; ``token_store``
    replaces the tokens of this module."""
    async with podman_env(podman, prefix) as (env, driver, keys):
        env.settings = env.settings.model_copy(update=settings)
        async with (
            running_plane(env, driver, removing=keys),
            serving_door(env, driver, wrap_logs, token_store, **settings) as (channel, server, gw),
        ):
            stub = openshell_pb2_grpc.OpenShellStub(channel)
            yield Gateway(stub, channel, server, keys, keys.made, env, gw)


@asynccontextmanager
async def serving_door(
    env: Env,
    driver: object,
    wrap_logs: Callable[[LogSource], LogSource] | None = None,
    token_store: TokenStore | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[grpc.aio.Channel, RunningOpenShell, CommandGateway]]:
    """The OpenShell door over ``env``'s plane (running beside it) and ``driver``, with a
    channel to it: the door of ``running_gateway``, for any driver."""
    async with CommandPublisher(
        kafka_client_args(env.settings, "api"), topic=env.settings.topic_commands
    ) as pub:
        feed = ChangeFeed(env.pool)
        await feed.start()
        tokens = token_store or TokenStore.of(
            admin=(ADMIN, READ, WRITE, EXEC, PROVIDER_READ, PROVIDER_WRITE),
            reader=(READER, READ),
            writer=(WRITER, READ, WRITE),
            executor=(EXECUTOR, READ, EXEC),
        )
        limits = {
            "openshell_exec_timeout_seconds": EXEC_LIMIT,
            "openshell_exec_sessions_per_token": EXEC_SESSIONS,
            "openshell_exec_sessions": EXEC_TOTAL,
        }
        limits.update((k, v) for k, v in settings.items() if k in limits)  # a test's own
        served = env.settings.model_copy(update={"openshell_port": 0, **limits})
        gateway = CommandGateway(
            env.pool, pub, feed, max_bytes=env.settings.processor_max_input_bytes
        )
        logs = log_source(served)
        door_logs = logs if wrap_logs is None else wrap_logs(logs)
        server = await start_openshell(
            served, pool=env.pool, gateway=gateway, tokens=tokens, driver=driver, logs=door_logs
        )
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                yield channel, server, gateway
        finally:
            await feed.close()
            await server.stop(0)
            await logs.close()


@pytest.fixture(scope="module", name="gateway")
async def gateway_fixture(podman: PodmanClient) -> AsyncIterator[Gateway]:
    """Import it into a test module (``gateway_fixture``) to get one gateway per module."""
    async with running_gateway(podman) as gateway:
        yield gateway


async def create(gw: Gateway, name: str, **request: Any) -> pb.Sandbox:
    request.setdefault("spec", pb.SandboxSpec())
    answer = await gw.stub.CreateSandbox(
        pb.CreateSandboxRequest(name=name, **request), metadata=auth()
    )
    return answer.sandbox


async def wait_phase(gw: Gateway, sandbox_id: str, phase: int) -> pb.Sandbox:
    """Watch (by id) until the phase; fails on ERROR or an ended stream, like OpenShell's suite."""
    request = pb.WatchSandboxRequest(id=sandbox_id, follow_status=True)
    stream = gw.stub.WatchSandbox(request, metadata=auth(), timeout=WAIT)
    async for event in stream:
        sandbox = event.sandbox
        assert sandbox.status.phase != Phase.SANDBOX_PHASE_ERROR, sandbox
        if sandbox.status.phase == phase:
            stream.cancel()
            return sandbox
    raise AssertionError(f"the watch ended before {Phase.Name(phase)}")


def call(gw: Gateway, method: str, request: Message, answer: type[Message], **kw: Any) -> Any:
    """A unary call with any generation's messages on OpenShell's method path."""
    rpc = gw.channel.unary_unary(
        PATH + method,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=answer.FromString,
    )
    return rpc(request, metadata=kw.pop("metadata", auth()), timeout=kw.pop("timeout", WAIT))


def stream(gw: Gateway, method: str, request: Message, answer: type[Message], **kw: Any) -> Any:
    rpc = gw.channel.unary_stream(
        PATH + method,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=answer.FromString,
    )
    return rpc(request, metadata=kw.pop("metadata", auth()), timeout=kw.pop("timeout", WAIT))


async def status_of(call: Any) -> grpc.StatusCode:
    """The status a call ends with (OK when it succeeds)."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK
