"""OpenShell 0.1's protocol on the same port as 0.0's: each drift between the two generations
(docs/openshell-compat.md), sent as a 0.1 client encodes it (the vendored 0.1.5 messages), on
real Kafka, PostgreSQL and Podman. Each of these failed on the facade that spoke 0.0 only.
Also the door's bounds and error mapping (exec limits, idempotency conflicts, scopes)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from openshell_support import (
    EXEC_LIMIT,
    EXEC_SESSIONS,
    WAIT,
    WRITER,
    Gateway,
    Phase,
    auth,
    create,
    gateway_fixture,  # noqa: F401  (the module's gateway)
    status_of,
    wait_phase,
)

from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

SCOPE = dm1.WorkspaceSelector(workspace="default")
PATH = "/openshell.v1.OpenShell/"


def call(gw: Gateway, method: str, request: Message, answer: type[Message], **kw: Any) -> Any:
    """A 0.1 client's unary call: its own messages on OpenShell's method path."""
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


async def ready(gw: Gateway, name: str, **request: Any) -> str:
    sandbox_id = (await create(gw, name, **request)).metadata.id
    await wait_phase(gw, sandbox_id, Phase.SANDBOX_PHASE_READY)
    return sandbox_id


# -- names and workspace selectors ---------------------------------------------------------------


async def test_a_0_1_client_gets_lists_and_deletes_with_a_workspace_selector(
    gateway: Gateway,
) -> None:
    name = gateway.new_name()
    sandbox_id = await ready(gateway, name)
    got = await call(
        gateway,
        "GetSandbox",
        os1.GetSandboxRequest(name=name, workspace_scope=SCOPE),
        os1.SandboxResponse,
    )
    assert got.sandbox.metadata.id == sandbox_id
    assert got.sandbox.metadata.created_time.ToMilliseconds() > 0  # 0.1's creation time
    listed = await call(
        gateway,
        "ListSandboxes",
        os1.ListSandboxesRequest(workspace_scope=SCOPE, page_size=500),
        os1.ListSandboxesResponse,
    )
    assert name in [s.metadata.name for s in listed.sandboxes]
    everywhere = dm1.WorkspaceSelector(all_workspaces=dm1.AllWorkspaces())
    listed = await call(
        gateway,
        "ListSandboxes",
        os1.ListSandboxesRequest(workspace_scope=everywhere, page_size=500),
        os1.ListSandboxesResponse,
    )
    assert name in [s.metadata.name for s in listed.sandboxes]
    deleted = await call(
        gateway,
        "DeleteSandbox",
        os1.DeleteSandboxRequest(name=name, workspace_scope=SCOPE),
        os1.DeleteSandboxResponse,
    )
    assert deleted.outcome == os1.DELETION_OUTCOME_ACCEPTED
    assert deleted.sandbox_id == sandbox_id
    old = pb.DeleteSandboxResponse.FromString(deleted.SerializeToString())
    assert old.deleted  # the same answer, read by a 0.0 client


async def test_delete_with_allow_missing_answers_already_absent(gateway: Gateway) -> None:
    name = gateway.new_name()
    request = os1.DeleteSandboxRequest(name=name, workspace_scope=SCOPE, allow_missing=True)
    answer = await call(gateway, "DeleteSandbox", request, os1.DeleteSandboxResponse)
    assert answer.outcome == os1.DELETION_OUTCOME_ALREADY_ABSENT
    strict = os1.DeleteSandboxRequest(name=name, workspace_scope=SCOPE)
    missing = call(gateway, "DeleteSandbox", strict, os1.DeleteSandboxResponse)
    assert await status_of(missing) == grpc.StatusCode.NOT_FOUND


async def test_list_pages_follow_next_page_token_to_the_end(gateway: Gateway) -> None:
    tag = uuid.uuid4().hex[:8]
    names = sorted(gateway.new_name() for _ in range(3))
    for name in names:
        await create(gateway, name, labels={"pages": tag})
    seen: list[str] = []
    token, pages = "", 0
    while True:
        request = os1.ListSandboxesRequest(
            workspace_scope=SCOPE, page_size=1, page_token=token, label_selector=f"pages={tag}"
        )
        page = await call(gateway, "ListSandboxes", request, os1.ListSandboxesResponse)
        seen += [s.metadata.name for s in page.sandboxes]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == names and pages == 3
    # A 0.0 client with limit and offset pages the same list.
    second = pb.ListSandboxesRequest(limit=1, offset=1, label_selector=f"pages={tag}")
    answer = await gateway.stub.ListSandboxes(second, metadata=auth())
    assert [s.metadata.name for s in answer.sandboxes] == names[1:2]


async def test_exec_and_watch_take_a_sandbox_name_from_a_0_1_client(gateway: Gateway) -> None:
    name = gateway.new_name()
    await ready(gateway, name)
    request = os1.ExecSandboxRequest(sandbox=name, workspace_scope=SCOPE, command=["echo", "hi"])
    events = [e async for e in stream(gateway, "ExecSandbox", request, os1.ExecSandboxEvent)]
    assert b"".join(e.stdout.data for e in events) == b"hi\n"
    assert events[-1].exit.exit_code == 0
    watch = os1.WatchSandboxRequest(
        sandbox=name, workspace_scope=SCOPE, follow_status=True, stop_on_terminal=True
    )
    snapshots = [e async for e in stream(gateway, "WatchSandbox", watch, os1.SandboxStreamEvent)]
    assert [s.sandbox.status.phase for s in snapshots] == [os1.SANDBOX_PHASE_READY]
    assert snapshots[0].cursor  # 0.1's resumable cursor


async def test_exec_execution_timeout_ends_the_command(gateway: Gateway) -> None:
    name = gateway.new_name()
    await ready(gateway, name)
    request = os1.ExecSandboxRequest(sandbox=name, workspace_scope=SCOPE, command=["sleep", "20"])
    request.execution_timeout.seconds = 1
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _ = [e async for e in stream(gateway, "ExecSandbox", request, os1.ExecSandboxEvent)]
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "longer than 1s" in (raised.value.details() or "")


# -- phases --------------------------------------------------------------------------------------


async def test_a_completed_sandbox_is_completed_for_0_1_and_stopped_for_0_0(
    gateway: Gateway,
) -> None:
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name, spec=pb.SandboxSpec(command=["true"]))).metadata.id
    request = os1.GetSandboxRequest(name=name, workspace_scope=SCOPE)

    async def phase() -> int:
        answer = await call(gateway, "GetSandbox", request, os1.SandboxResponse)
        return int(answer.sandbox.status.phase)

    deadline = asyncio.get_running_loop().time() + WAIT
    while await phase() != os1.SANDBOX_PHASE_COMPLETED:
        assert asyncio.get_running_loop().time() < deadline, "never COMPLETED"
        await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_STOPPED)  # what 0.0 sees
    old = await gateway.stub.GetSandbox(pb.GetSandboxRequest(name=name), metadata=auth())
    assert old.sandbox.status.phase == Phase.SANDBOX_PHASE_STOPPED
    assert old.sandbox.status.HasField("exit_code") and old.sandbox.status.exit_code == 0


# -- request ids ---------------------------------------------------------------------------------


async def test_request_id_replays_the_first_outcome_and_refuses_another_request(
    gateway: Gateway,
) -> None:
    name = gateway.new_name()
    request_id = str(uuid.uuid4())
    request = os1.CreateSandboxRequest(
        name=name, workspace_scope=SCOPE, spec=os1.SandboxSpec(), request_id=request_id
    )
    first = await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
    again = await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
    assert again.sandbox.metadata.id == first.sandbox.metadata.id
    other = os1.StopSandboxRequest(name=name, workspace_scope=SCOPE, request_id=request_id)
    refused = call(gateway, "StopSandbox", other, os1.SandboxResponse)
    assert await status_of(refused) == grpc.StatusCode.ALREADY_EXISTS  # was UNKNOWN


# -- bounds and scopes ---------------------------------------------------------------------------


async def test_exec_has_a_default_limit_and_a_cap_of_sessions_per_token(gateway: Gateway) -> None:
    name = gateway.new_name()
    sandbox_id = await ready(gateway, name)
    sleeper = pb.ExecSandboxRequest(
        sandbox_id=sandbox_id, command=["sh", "-c", "echo started; exec sleep 60"]
    )
    calls = [gateway.stub.ExecSandbox(sleeper, metadata=auth()) for _ in range(EXEC_SESSIONS)]
    try:
        for running in calls:  # each session is open once its first output arrived
            assert (await running.read()).stdout.data == b"started\n"
        third = gateway.stub.ExecSandbox(sleeper, metadata=auth())
        assert await status_of(third.read()) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # No timeout asked: the gateway's limit ends them.
        for running in calls:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await asyncio.wait_for(running.read(), EXEC_LIMIT + WAIT)
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        for running in calls:
            running.cancel()


async def test_exec_needs_the_exec_scope_and_providers_at_create_need_provider_write(
    gateway: Gateway,
) -> None:
    name = gateway.new_name()
    sandbox_id = await ready(gateway, name)
    request = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=["true"])
    denied = gateway.stub.ExecSandbox(request, metadata=auth(WRITER))
    assert await status_of(denied.read()) == grpc.StatusCode.PERMISSION_DENIED
    with_providers = pb.CreateSandboxRequest(
        name=gateway.new_name(), spec=pb.SandboxSpec(providers=["anything"])
    )
    create_call = gateway.stub.CreateSandbox(with_providers, metadata=auth(WRITER))
    assert await status_of(create_call) == grpc.StatusCode.PERMISSION_DENIED
