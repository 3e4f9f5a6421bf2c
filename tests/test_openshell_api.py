"""The OpenShell gRPC API on real Kafka, PostgreSQL and Podman (an isolated environment).

One gateway for the module: a control plane with the Podman driver and the gRPC server in
this process, with tokens (no unauthenticated calls). Every test uses its own sandbox names.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from harness import eventually
from openshell_support import (
    READER,
    WAIT,
    Gateway,
    Phase,
    auth,
    create,
    gateway_fixture,  # noqa: F401  (the module's gateway)
    status_of,
    wait_phase,
)
from pipeline_support import history

from events.commands import HoldSandbox
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import openshell_pb2_grpc

# -- lifecycle -----------------------------------------------------------------------------------


async def test_create_answers_before_ready_and_the_id_is_stable_across_stop_and_start(
    gateway: Gateway,
) -> None:
    name = gateway.new_name()
    created = await create(gateway, name, labels={"team": "research"})
    assert created.metadata.name == name
    assert created.status.phase == Phase.SANDBOX_PHASE_PROVISIONING
    assert created.metadata.labels == {"team": "research"}
    sandbox_id = created.metadata.id
    assert str(uuid.UUID(sandbox_id)) == sandbox_id

    ready = await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    assert ready.metadata.id == sandbox_id
    await gateway.stub.StopSandbox(pb.StopSandboxRequest(name=name), metadata=auth())
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_STOPPED)
    await gateway.stub.StartSandbox(pb.StartSandboxRequest(name=name), metadata=auth())
    again = await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    assert again.metadata.id == sandbox_id
    assert again.metadata.resource_version > ready.metadata.resource_version

    got = await gateway.stub.GetSandbox(pb.GetSandboxRequest(name=name), metadata=auth())
    assert got.sandbox.metadata.id == sandbox_id
    deleted = await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())
    assert deleted.deleted
    await eventually(
        lambda: status_of(
            gateway.stub.GetSandbox(pb.GetSandboxRequest(name=name), metadata=auth())
        ),
        lambda code: code == grpc.StatusCode.NOT_FOUND,
        timeout=WAIT,
        what="the row gone",
    )
    second = gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())
    assert await status_of(second) == grpc.StatusCode.NOT_FOUND


async def test_unknown_names_are_not_found(gateway: Gateway) -> None:
    name = gateway.new_name()
    calls = [
        gateway.stub.GetSandbox(pb.GetSandboxRequest(name=name), metadata=auth()),
        gateway.stub.StartSandbox(pb.StartSandboxRequest(name=name), metadata=auth()),
        gateway.stub.StopSandbox(pb.StopSandboxRequest(name=name), metadata=auth()),
        gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth()),
    ]
    for call in calls:
        assert await status_of(call) == grpc.StatusCode.NOT_FOUND
    watch = gateway.stub.WatchSandbox(
        pb.WatchSandboxRequest(id=str(uuid.uuid4()), follow_status=True), metadata=auth()
    )
    assert await status_of(watch.read()) == grpc.StatusCode.NOT_FOUND


async def test_the_processors_rejections_keep_their_codes(gateway: Gateway) -> None:
    """A rejected command ends the RPC with the outcome's code and message (a held sandbox
    refuses start)."""
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name)).metadata.id
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    again = gateway.stub.CreateSandbox(
        pb.CreateSandboxRequest(name=name, spec=pb.SandboxSpec()), metadata=auth()
    )
    with pytest.raises(grpc.aio.AioRpcError) as exists:
        await again
    assert exists.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert exists.value.details() == f"sandbox {name!r} already exists (phase: Ready)"
    hold = HoldSandbox(
        type="HoldSandbox", command_id=str(uuid.uuid4()), key=name, actor="test",
        occurred_at=datetime.now(UTC), reason="investigating",
    )  # fmt: skip
    assert (await gateway.commands.submit(hold, WAIT)).outcome is not None
    start = gateway.stub.StartSandbox(pb.StartSandboxRequest(name=name), metadata=auth())
    with pytest.raises(grpc.aio.AioRpcError) as held:
        await start
    assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "investigating" in (held.value.details() or "")


async def test_invalid_specs_are_invalid_argument_and_create_nothing(gateway: Gateway) -> None:
    before = await gateway.stub.ListSandboxes(pb.ListSandboxesRequest(), metadata=auth())
    no_spec = gateway.stub.CreateSandbox(pb.CreateSandboxRequest(), metadata=auth())
    assert await status_of(no_spec) == grpc.StatusCode.INVALID_ARGUMENT
    gpu = pb.SandboxSpec(
        resource_requirements=pb.ResourceRequirements(gpu=pb.GpuResourceRequirements(count=0))
    )
    zero_gpus = gateway.stub.CreateSandbox(pb.CreateSandboxRequest(spec=gpu), metadata=auth())
    assert await status_of(zero_gpus) == grpc.StatusCode.INVALID_ARGUMENT
    bad_label = gateway.stub.CreateSandbox(
        pb.CreateSandboxRequest(name=gateway.new_name(), spec=pb.SandboxSpec(), labels={"-x": "1"}),
        metadata=auth(),
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await bad_label
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "labels" in (raised.value.details() or "")
    after = await gateway.stub.ListSandboxes(pb.ListSandboxesRequest(), metadata=auth())
    assert len(after.sandboxes) == len(before.sandboxes)


async def test_list_filters_by_label_selector(gateway: Gateway) -> None:
    a, b = gateway.new_name(), gateway.new_name()
    tag = uuid.uuid4().hex[:8]
    await create(gateway, a, labels={"suite": tag, "side": "a"})
    await create(gateway, b, labels={"suite": tag, "side": "b"})
    listed = await gateway.stub.ListSandboxes(pb.ListSandboxesRequest(), metadata=auth())
    assert {a, b} <= {s.metadata.name for s in listed.sandboxes}
    only_a = await gateway.stub.ListSandboxes(
        pb.ListSandboxesRequest(label_selector=f"suite={tag},side=a"), metadata=auth()
    )
    assert [s.metadata.name for s in only_a.sandboxes] == [a]
    malformed = gateway.stub.ListSandboxes(
        pb.ListSandboxesRequest(label_selector="side!=a"), metadata=auth()
    )
    assert await status_of(malformed) == grpc.StatusCode.INVALID_ARGUMENT
    for name in (a, b):
        await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())


# -- idempotent retries --------------------------------------------------------------------------


async def test_a_retried_create_after_a_lost_answer_creates_no_second_sandbox(
    gateway: Gateway,
) -> None:
    command_id = f"os-create-{uuid.uuid4().hex}"
    request = pb.CreateSandboxRequest(spec=pb.SandboxSpec())  # the name is generated
    first = await gateway.stub.CreateSandbox(request, metadata=auth(command_id=command_id))
    name = first.sandbox.metadata.name
    gateway.made.append(name)
    # The answer was "lost": the client sends the same request with the same command id.
    second = await gateway.stub.CreateSandbox(request, metadata=auth(command_id=command_id))
    assert second.sandbox.metadata.name == name
    assert second.sandbox.metadata.id == first.sandbox.metadata.id
    listed = await gateway.stub.ListSandboxes(pb.ListSandboxesRequest(), metadata=auth())
    assert [s.metadata.name for s in listed.sandboxes].count(name) == 1
    creates = [h for h in await history_of(gateway, name) if h["message_type"] == "CreateSandbox"]
    assert len(creates) == 1
    await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())


async def test_a_retried_start_after_a_lost_answer_does_not_start_again(gateway: Gateway) -> None:
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name)).metadata.id
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    await gateway.stub.StopSandbox(pb.StopSandboxRequest(name=name), metadata=auth())
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_STOPPED)
    start_id = f"os-start-{uuid.uuid4().hex}"
    request = pb.StartSandboxRequest(name=name)
    await gateway.stub.StartSandbox(request, metadata=auth(command_id=start_id))
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    await gateway.stub.StopSandbox(pb.StopSandboxRequest(name=name), metadata=auth())
    stopped = await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_STOPPED)

    # The retry of the lost start: answered with the first outcome, not applied again.
    retried = await gateway.stub.StartSandbox(request, metadata=auth(command_id=start_id))
    assert retried.sandbox.status.phase == Phase.SANDBOX_PHASE_STOPPED
    assert retried.sandbox.metadata.resource_version == stopped.metadata.resource_version
    starts = [h for h in await history_of(gateway, name) if h["message_type"] == "StartSandbox"]
    assert len(starts) == 1
    await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())


async def history_of(gateway: Gateway, name: str) -> list[dict[str, Any]]:
    return await history(gateway.env, name)


# -- watch, exec ---------------------------------------------------------------------------------


async def test_watch_sends_the_snapshot_first_then_one_per_change_and_ends_after_delete(
    gateway: Gateway,
) -> None:
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name)).metadata.id
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    stream = gateway.stub.WatchSandbox(
        pb.WatchSandboxRequest(id=sandbox_id, follow_status=True), metadata=auth(), timeout=WAIT
    )
    first = await stream.read()
    assert first.sandbox.status.phase == Phase.SANDBOX_PHASE_READY
    await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())
    rest = []
    while (event := await stream.read()) is not grpc.aio.EOF:  # ends after the tombstone
        rest.append(event)
    phases = [e.sandbox.status.phase for e in rest]
    assert phases and set(phases) == {Phase.SANDBOX_PHASE_DELETING}
    versions = [e.sandbox.metadata.resource_version for e in rest]
    assert versions == sorted(set(versions))  # one snapshot per change


async def test_exec_streams_output_then_the_exit_and_core_dumps_are_off(gateway: Gateway) -> None:
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name)).metadata.id
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    script = 'printf out; printf err >&2; test "$(ulimit -c)" = 0 && exit 7'
    request = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=["sh", "-lc", script])
    events = [e async for e in gateway.stub.ExecSandbox(request, metadata=auth(), timeout=WAIT)]
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds[-1] == "exit" and kinds.count("exit") == 1
    assert events[-1].exit.exit_code == 7
    assert b"".join(e.stdout.data for e in events if e.HasField("stdout")) == b"out"
    assert b"".join(e.stderr.data for e in events if e.HasField("stderr")) == b"err"
    await gateway.stub.StopSandbox(pb.StopSandboxRequest(name=name), metadata=auth())
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_STOPPED)
    not_ready = gateway.stub.ExecSandbox(request, metadata=auth())
    assert await status_of(not_ready.read()) == grpc.StatusCode.FAILED_PRECONDITION
    await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())


# -- auth, the rest ------------------------------------------------------------------------------


async def test_tokens_and_scopes_are_checked(gateway: Gateway) -> None:
    request = pb.ListSandboxesRequest()
    assert await status_of(gateway.stub.ListSandboxes(request)) == grpc.StatusCode.UNAUTHENTICATED
    wrong = gateway.stub.ListSandboxes(request, metadata=auth("sst_wrong"))
    assert await status_of(wrong) == grpc.StatusCode.UNAUTHENTICATED
    await gateway.stub.ListSandboxes(request, metadata=auth(READER))  # reading is allowed
    create_call = gateway.stub.CreateSandbox(
        pb.CreateSandboxRequest(name=gateway.new_name(), spec=pb.SandboxSpec()),
        metadata=auth(READER),
    )
    assert await status_of(create_call) == grpc.StatusCode.PERMISSION_DENIED
    health = await gateway.stub.Health(pb.HealthRequest())  # unauthenticated, as in OpenShell
    assert health.status == pb.SERVICE_STATUS_HEALTHY


async def test_methods_outside_the_subset_are_unimplemented(gateway: Gateway) -> None:
    call = gateway.channel.unary_unary("/openshell.v1.OpenShell/GetProviderCredentials")
    assert await status_of(call(b"", metadata=auth())) == grpc.StatusCode.UNIMPLEMENTED


async def test_an_idle_watch_survives_frequent_client_pings(gateway: Gateway) -> None:
    """OpenShell's clients ping on idle connections; grpc-core's default server policy would
    answer with GOAWAY (too many pings) and break the open watch."""
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name)).metadata.id
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    options = [
        ("grpc.keepalive_time_ms", 500),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    async with grpc.aio.insecure_channel(gateway.server.address, options=options) as channel:
        stub = openshell_pb2_grpc.OpenShellStub(channel)
        stream = stub.WatchSandbox(
            pb.WatchSandboxRequest(id=sandbox_id, follow_status=True), metadata=auth()
        )
        assert (await stream.read()).sandbox.status.phase == Phase.SANDBOX_PHASE_READY
        # The idle time is what is tested: with the default policy, 3 pings end the connection.
        await asyncio.sleep(4)
        await gateway.stub.StopSandbox(pb.StopSandboxRequest(name=name), metadata=auth())
        nxt = await asyncio.wait_for(stream.read(), WAIT)
        assert nxt.sandbox.status.phase in (
            Phase.SANDBOX_PHASE_STOPPING,
            Phase.SANDBOX_PHASE_STOPPED,
        )
        stream.cancel()
    await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())


async def test_exec_timeout_stdin_fed_and_watch_stop_on_terminal(gateway: Gateway) -> None:
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name)).metadata.id
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    slow = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=["sleep", "30"], timeout_seconds=1)
    call = gateway.stub.ExecSandbox(slow, metadata=auth(), timeout=WAIT)
    assert await status_of(call.read()) == grpc.StatusCode.DEADLINE_EXCEEDED
    fed = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=["cat"], stdin=b"fed")
    events = [event async for event in gateway.stub.ExecSandbox(fed, metadata=auth(), timeout=WAIT)]
    assert b"".join(e.stdout.data for e in events) == b"fed"  # stdin reaches the command
    assert events[-1].exit.exit_code == 0
    request = pb.WatchSandboxRequest(id=sandbox_id, follow_status=True, stop_on_terminal=True)
    stream = gateway.stub.WatchSandbox(request, metadata=auth(), timeout=WAIT)
    assert (await stream.read()).sandbox.status.phase == Phase.SANDBOX_PHASE_READY
    assert await stream.read() is grpc.aio.EOF  # Ready is terminal: the stream ends
    other = pb.ListSandboxesRequest(workspace="elsewhere")
    assert not (await gateway.stub.ListSandboxes(other, metadata=auth())).sandboxes
    elsewhere = pb.GetSandboxRequest(name=name, workspace="elsewhere")
    assert await status_of(gateway.stub.GetSandbox(elsewhere, metadata=auth())) == (
        grpc.StatusCode.NOT_FOUND
    )
    await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())
