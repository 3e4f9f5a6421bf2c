"""ExecSandbox's deadline, and a client that cancels or goes away, end the command inside the
sandbox (its process group: SIGTERM, SIGKILL after a grace), on real Kafka, PostgreSQL and
Podman. Before, the RPC ended and the command ran on in the sandbox."""

from __future__ import annotations

import uuid

import grpc
import pytest
from exec_support import running_with
from harness import eventually
from openshell_support import (
    EXEC_LIMIT,
    WAIT,
    Gateway,
    Phase,
    auth,
    create,
    gateway_fixture,  # noqa: F401  (the module's gateway)
    stream,
    wait_phase,
)
from podman import PodmanClient

from drivers.podman_objects import container_name
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import openshell_pb2_grpc
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1


async def ready(gw: Gateway) -> tuple[str, str]:
    """A Ready sandbox: its name and id (its container is generation 1's)."""
    name = gw.new_name()
    sandbox_id = (await create(gw, name)).metadata.id
    await wait_phase(gw, sandbox_id, Phase.SANDBOX_PHASE_READY)
    return name, sandbox_id


def sleeper(marker: str) -> list[str]:
    """A shell with a background and a foreground sleep, saying "started" once both run."""
    return ["sh", "-c", f"sleep {marker} & sleep {marker} & echo started; wait"]


def new_marker() -> str:
    return str(uuid.uuid4().int % 100_000 + 300_000)  # a sleep no other test runs


async def test_the_deadline_ends_the_command_and_its_children_before_deadline_exceeded(
    gateway: Gateway, podman: PodmanClient
) -> None:
    name, _ = await ready(gateway)
    container, marker = container_name(name, 1), new_marker()
    request = os1.ExecSandboxRequest(
        sandbox=name, workspace_scope=dm1.WorkspaceSelector(workspace="default"),
        command=sleeper(marker),
    )  # fmt: skip
    request.execution_timeout.seconds = EXEC_LIMIT  # long enough to start under load
    call = stream(gateway, "ExecSandbox", request, os1.ExecSandboxEvent)
    assert (await call.read()).stdout.data == b"started\n"
    assert len(running_with(podman, container, f"sleep {marker}")) == 3  # sh -c, two sleeps
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Ended before the status went out: nothing of it is left alive already.
    assert running_with(podman, container, f"sleep {marker}") == []


async def test_a_cancelled_or_disconnected_client_ends_the_command(
    gateway: Gateway, podman: PodmanClient
) -> None:
    name, sandbox_id = await ready(gateway)
    container = container_name(name, 1)
    cancelled, dropped = new_marker(), new_marker()
    request = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=sleeper(cancelled))
    call = gateway.stub.ExecSandbox(request, metadata=auth(), timeout=WAIT)
    assert (await call.read()).stdout.data == b"started\n"
    call.cancel()
    # Its own connection, closed under the running call: the client is gone.
    async with grpc.aio.insecure_channel(gateway.server.address) as channel:
        stub = openshell_pb2_grpc.OpenShellStub(channel)
        request = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=sleeper(dropped))
        other = stub.ExecSandbox(request, metadata=auth(), timeout=WAIT)
        assert (await other.read()).stdout.data == b"started\n"
    for marker in (cancelled, dropped):
        await eventually(lambda m=marker: running_with(podman, container, f"sleep {m}"),
                         lambda left: not left, timeout=WAIT, what="the command gone")  # fmt: skip
