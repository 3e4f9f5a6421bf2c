"""OpenShell 0.1's protocol on the same port as 0.0's: each drift between the two generations
(docs/openshell-compat.md), sent as a 0.1 client encodes it (the vendored 0.1.5 messages), on
real Kafka, PostgreSQL and Podman. Each of these failed on the facade that spoke 0.0 only.
Also the door's bounds and error mapping (exec limits, idempotency conflicts, scopes)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from openshell_support import (
    ADMIN,
    EXEC_LIMIT,
    EXEC_SESSIONS,
    EXEC_TOTAL,
    EXECUTOR,
    WAIT,
    WRITER,
    Gateway,
    Phase,
    auth,
    call,
    create,
    gateway_fixture,  # noqa: F401  (the module's gateway)
    running_gateway,
    status_of,
    stream,
    wait_phase,
)
from pipeline_support import history
from pipeline_support import wait_phase as ready_in
from podman import PodmanClient

from events.commands import CreateSandbox
from events.common import SandboxSpec
from services.common import templates
from services.common.templates import TemplateBody
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

SCOPE = dm1.WorkspaceSelector(workspace="default")


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


@pytest.mark.parametrize("scoped", [True, False], ids=["workspace_scope", "spec-only"])
async def test_a_0_1_create_with_a_restart_policy_sets_it_and_answers_it(
    gateway: Gateway, scoped: bool
) -> None:
    """Also without workspace_scope or request_id (a grpcurl client): the restart policy in
    the spec makes the create 0.1. It was read as 0.0 then, the policy dropped and an unknown
    one accepted."""
    name = gateway.new_name()
    scope = {"workspace_scope": SCOPE} if scoped else {}
    request = os1.CreateSandboxRequest(
        name=name,
        spec=os1.SandboxSpec(
            command=["sleep", "3600"], restart_policy=os1.SANDBOX_RESTART_POLICY_ON_FAILURE
        ),
        **scope,
    )
    created = await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
    assert created.sandbox.spec.restart_policy == os1.SANDBOX_RESTART_POLICY_ON_FAILURE
    spec = await gateway.env.fetchval("SELECT spec FROM sandboxes WHERE key = $1", name)
    assert '"restart_policy": "OnFailure"' in spec
    unknown = os1.CreateSandboxRequest(
        name=gateway.new_name(), spec=os1.SandboxSpec(restart_policy=99), **scope
    )
    refused = call(gateway, "CreateSandbox", unknown, os1.SandboxResponse)
    assert await status_of(refused) == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_watch_sends_every_version_also_two_decided_on_one_input(gateway: Gateway) -> None:
    """A sandbox deleted by its completion policy: the exit is decided as Completed and then
    Deleting on one input, one row write. The watch sends both versions (it sent Deleting
    only), each change once and in order."""
    name = gateway.new_name()
    spec = SandboxSpec(
        image=gateway.env.settings.sandbox_image,
        command=["sh", "-c", "while [ ! -e /tmp/go ]; do sleep 0.1; done"],
    )
    create_command = CreateSandbox(
        type="CreateSandbox", command_id=str(uuid.uuid4()), key=name, actor="test",
        occurred_at=datetime.now(UTC), spec=spec, on_exit="delete",
    )  # fmt: skip
    assert (await gateway.commands.submit(create_command, WAIT)).outcome is not None
    request = os1.WatchSandboxRequest(sandbox=name, workspace_scope=SCOPE, follow_status=True)
    watch = stream(gateway, "WatchSandbox", request, os1.SandboxStreamEvent)
    seen = []
    async for event in watch:
        seen.append(event.sandbox)
        if event.sandbox.status.phase == os1.SANDBOX_PHASE_READY:
            break
    go = os1.ExecSandboxRequest(sandbox=name, workspace_scope=SCOPE, command=["touch", "/tmp/go"])
    assert [e async for e in stream(gateway, "ExecSandbox", go, os1.ExecSandboxEvent)][-1].exit
    seen += [event.sandbox async for event in watch]  # until the tombstone ends it
    phases = [s.status.phase for s in seen]
    assert phases[phases.index(os1.SANDBOX_PHASE_READY) :] == [
        os1.SANDBOX_PHASE_READY, os1.SANDBOX_PHASE_COMPLETED, os1.SANDBOX_PHASE_DELETING,
        os1.SANDBOX_PHASE_DELETING,  # the tombstone
    ]  # fmt: skip
    versions = [s.metadata.resource_version for s in seen]
    assert versions == list(range(versions[0], versions[0] + len(versions)))


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


async def test_a_command_too_large_for_a_kafka_record_is_resource_exhausted(
    gateway: Gateway,
) -> None:
    """Within the gRPC message limit (4 MiB), above Kafka's record size (1 MiB): retrying
    cannot help, so RESOURCE_EXHAUSTED (as the HTTP API's 413), never a retryable UNAVAILABLE
    nor INTERNAL; nothing is created."""
    name = gateway.new_name()
    env = {f"V{i}": "x" * 9000 for i in range(200)}  # about 1.8 MB
    request = os1.CreateSandboxRequest(
        name=name, workspace_scope=SCOPE, spec=os1.SandboxSpec(environment=env)
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the processor decides" in (raised.value.details() or "")
    get = os1.GetSandboxRequest(name=name, workspace_scope=SCOPE)
    assert await status_of(call(gateway, "GetSandbox", get, os1.SandboxResponse)) == (
        grpc.StatusCode.NOT_FOUND
    )


async def test_a_command_above_what_the_processor_decides_is_refused_before_it_is_accepted(
    gateway: Gateway,
) -> None:
    """A command within Kafka's record size but above the processor's input limit, from either
    generation (within every field's bounds: 10,000-character values), was published, then
    dead-lettered and never decided: the client waited 30 s for UNAVAILABLE, and its retries
    likewise. Now RESOURCE_EXHAUSTED naming the limit, at once and again on a retry with the
    same request_id; nothing recorded under the id, nothing on the commands topic, no history."""
    env = gateway.env
    limit = env.settings.processor_max_input_bytes
    assert limit + 30_000 < env.settings.kafka_max_record_bytes  # Kafka would take it
    environment = {f"V{i}": "x" * 9999 for i in range(limit // 10_000 + 1)}
    image = "localhost/sandstream-base:1"
    old, new = gateway.new_name(), gateway.new_name()
    request_id = str(uuid.uuid4())
    request = os1.CreateSandboxRequest(
        name=new,
        workspace_scope=SCOPE,
        spec=os1.SandboxSpec(template=os1.SandboxTemplate(image=image), environment=environment),
        request_id=request_id,
    )
    refused = []
    for _ in range(2):  # the first try and its retry
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(gateway, "CreateSandbox", request, os1.SandboxResponse, timeout=20)
        refused.append(raised.value)
    spec = pb.SandboxSpec(template=pb.SandboxTemplate(image=image), environment=environment)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await gateway.stub.CreateSandbox(
            pb.CreateSandboxRequest(name=old, spec=spec), metadata=auth(), timeout=20
        )
    refused.append(raised.value)
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        details = error.details() or ""
        assert f"above the {limit} bytes the processor decides" in details, details
    recorded = await env.fetch("SELECT 1 FROM api_commands WHERE command_id = $1", request_id)
    assert recorded == []
    logged = {r.key for r in await env.read_topic(env.settings.topic_commands)}
    assert old.encode() not in logged and new.encode() not in logged
    assert await history(env, old) == [] and await history(env, new) == []


# -- bounds and scopes ---------------------------------------------------------------------------


async def test_a_spec_beyond_the_records_bounds_is_invalid_argument_and_never_logged(
    gateway: Gateway,
) -> None:
    """Bounds the API's records keep (an environment value of at most 10,000 characters, at
    most 256 variables, an image name of at most 500), sent by either generation: refused
    before anything is submitted, naming the field, and no command of the name on the commands
    topic nor in the history."""
    old, new = gateway.new_name(), gateway.new_name()
    long_value = pb.SandboxSpec(environment={"BIG": "x" * 10_001})
    with pytest.raises(grpc.aio.AioRpcError) as value:
        await gateway.stub.CreateSandbox(
            pb.CreateSandboxRequest(name=old, spec=long_value), metadata=auth()
        )
    many = os1.SandboxSpec(environment={f"V{i}": "1" for i in range(257)})
    with pytest.raises(grpc.aio.AioRpcError) as count:
        await call(
            gateway,
            "CreateSandbox",
            os1.CreateSandboxRequest(name=new, workspace_scope=SCOPE, spec=many),
            os1.SandboxResponse,
        )
    image = pb.SandboxSpec(template=pb.SandboxTemplate(image="i" * 501))
    with pytest.raises(grpc.aio.AioRpcError) as long_image:
        await gateway.stub.CreateSandbox(
            pb.CreateSandboxRequest(name=old, spec=image), metadata=auth()
        )
    for raised, field in (
        (value, "spec.environment.BIG"),
        (count, "spec.environment"),
        (long_image, "spec.template.image"),
    ):
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (raised.value.details() or "").startswith(field + ":"), raised.value.details()
    accepted = gateway.new_name()  # within the bounds: its command is on the topic
    await create(gateway, accepted, spec=pb.SandboxSpec(environment={"BIG": "x" * 10_000}))
    env = gateway.env
    logged = {r.key for r in await env.read_topic(env.settings.topic_commands)}
    assert accepted.encode() in logged
    assert old.encode() not in logged and new.encode() not in logged
    assert await history(env, old) == [] and await history(env, new) == []


@asynccontextmanager
async def sleepers(gw: Gateway, tokens: list[str]) -> AsyncIterator[Any]:
    """One exec session per token in a Ready sandbox, each open (its first output arrived);
    yields a call that opens one more. No timeout asked: the gateway's limit must end each."""
    sandbox_id = await ready(gw, gw.new_name())
    sleeper = pb.ExecSandboxRequest(
        sandbox_id=sandbox_id, command=["sh", "-c", "echo started; exec sleep 60"]
    )
    calls = [gw.stub.ExecSandbox(sleeper, metadata=auth(token)) for token in tokens]
    try:
        for running in calls:
            assert (await running.read()).stdout.data == b"started\n"
        yield lambda token: gw.stub.ExecSandbox(sleeper, metadata=auth(token))
        for running in calls:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await asyncio.wait_for(running.read(), EXEC_LIMIT + WAIT)
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        for running in calls:
            running.cancel()


async def test_exec_has_a_default_limit_and_a_cap_of_sessions_per_token(gateway: Gateway) -> None:
    async with sleepers(gateway, [ADMIN] * EXEC_SESSIONS) as one_more:
        third = one_more(ADMIN)
        assert await status_of(third.read()) == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_exec_refuses_a_timeout_beyond_the_gateways_limit(gateway: Gateway) -> None:
    """A client cannot ask its way past the limit, in either generation: INVALID_ARGUMENT,
    before the sandbox is looked up. Before the bound, any timeout was taken."""
    name = gateway.new_name()  # never created: the refusal comes first
    new = os1.ExecSandboxRequest(sandbox=name, workspace_scope=SCOPE, command=["true"])
    new.execution_timeout.seconds = EXEC_LIMIT + 1
    old = pb.ExecSandboxRequest(sandbox_id=name, command=["true"], timeout_seconds=EXEC_LIMIT + 1)
    for request in (new, old):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            _ = [e async for e in stream(gateway, "ExecSandbox", request, os1.ExecSandboxEvent)]
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details() == f"execution_timeout: at most {EXEC_LIMIT} seconds"


async def test_exec_has_a_cap_of_sessions_in_all_tokens_together(gateway: Gateway) -> None:
    """Each session holds a thread reading Podman's stream: past the gateway's cap (here one
    token at its own cap and another below it), one more is RESOURCE_EXHAUSTED naming the
    gateway's cap, not the token's. Before the caps, every session was served."""
    tokens = [ADMIN] * EXEC_SESSIONS + [EXECUTOR] * (EXEC_TOTAL - EXEC_SESSIONS)
    assert EXEC_TOTAL - EXEC_SESSIONS < EXEC_SESSIONS  # EXECUTOR stays below its own cap
    async with sleepers(gateway, tokens) as one_more:
        fourth = one_more(EXECUTOR)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await fourth.read()
            fourth.cancel()  # served: end it before failing
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raised.value.details() == (
            f"{EXEC_TOTAL} exec sessions are running (the most this gateway allows)"
        )


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


# -- references and nested 0.1 fields ------------------------------------------------------------


async def test_a_reference_that_is_one_sandboxs_id_and_anothers_name_is_refused(
    gateway: Gateway,
) -> None:
    """A UUID is a valid sandbox name: a sandbox named with another one's incarnation id. Exec,
    logs and watch by that string reached the sandbox whose id it is (a 0.1 client meant the
    named one); now they are refused, and each sandbox is still reached by what only it has."""
    first = gateway.new_name()
    first_id = await ready(gateway, first)
    twin_id = await ready(gateway, first_id)  # named with the first sandbox's incarnation id
    assert twin_id != first_id
    got = await call(
        gateway, "GetSandbox", os1.GetSandboxRequest(name=first_id, workspace_scope=SCOPE),
        os1.SandboxResponse,
    )  # fmt: skip
    assert got.sandbox.metadata.id == twin_id
    hostname = os1.ExecSandboxRequest(sandbox=first_id, workspace_scope=SCOPE, command=["true"])
    logs = os1.GetSandboxLogsRequest(sandbox=first_id, workspace_scope=SCOPE)
    watch = os1.WatchSandboxRequest(sandbox=first_id, workspace_scope=SCOPE, follow_status=False)
    for method, request, answer in (
        ("ExecSandbox", hostname, os1.ExecSandboxEvent),
        ("WatchSandbox", watch, os1.SandboxStreamEvent),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            _ = [e async for e in stream(gateway, method, request, answer)]
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION, method
        assert first in (raised.value.details() or ""), method
    refused = call(gateway, "GetSandboxLogs", logs, os1.GetSandboxLogsResponse)
    assert await status_of(refused) == grpc.StatusCode.FAILED_PRECONDITION
    for reference in (first, twin_id):  # each by a reference only it has
        ok = os1.ExecSandboxRequest(sandbox=reference, workspace_scope=SCOPE, command=["true"])
        events = [e async for e in stream(gateway, "ExecSandbox", ok, os1.ExecSandboxEvent)]
        assert events[-1].exit.exit_code == 0


async def test_a_create_naming_a_missing_provider_is_not_found_and_creates_nothing(
    gateway: Gateway,
) -> None:
    """As an attach of a missing provider is (it used to create a sandbox attached to none)."""
    name, missing = gateway.new_name(), gateway.new_name()
    request = pb.CreateSandboxRequest(name=name, spec=pb.SandboxSpec(providers=[missing]))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await gateway.stub.CreateSandbox(request, metadata=auth())
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert raised.value.details() == f"spec.providers: provider {missing!r} not found"
    assert await gateway.env.fetchval("SELECT count(*) FROM sandboxes WHERE key = $1", name) == 0


async def test_a_create_from_a_template_retried_by_request_id_gets_its_first_outcome(
    gateway: Gateway,
) -> None:
    """Also after the template changed or was deleted: the retry resolves to the revision the
    first create was decided with, so it is the same request."""
    name, template = gateway.new_name(), f"tpl-{uuid.uuid4().hex[:8]}"
    async with gateway.env.pool.acquire() as conn:
        body = TemplateBody(spec=SandboxSpec(image=gateway.env.settings.sandbox_image,
                                             command=["sleep", "infinity"]))  # fmt: skip
        await templates.create_template(conn, template, body, "test", datetime.now(UTC))
    request = os1.CreateSandboxRequest(
        name=name, workspace_scope=SCOPE, workload_template=template, request_id=str(uuid.uuid4())
    )
    first = await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
    assert first.sandbox.created_from_workload_template.resource_version == "1"
    async with gateway.env.pool.acquire() as conn:
        newer = body.model_copy(update={"description": "revision 2"})
        await templates.update_template(conn, template, newer, 1, "test", datetime.now(UTC))
    again = await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
    assert again.sandbox.metadata.id == first.sandbox.metadata.id
    async with gateway.env.pool.acquire() as conn:
        await templates.delete_template(conn, template)
    gone = await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
    assert gone.sandbox.metadata.id == first.sandbox.metadata.id
    assert gone.sandbox.created_from_workload_template.resource_version == "1"


async def test_a_create_from_a_template_keeps_to_the_tokens_stop_timeout_cap(
    gateway: Gateway,
) -> None:
    """A template's grace period above what the caller may ask for (the server's cap, 600 s
    here) is refused as over HTTP, naming the field: the template is no way around the cap."""
    name, template = gateway.new_name(), f"tpl-{uuid.uuid4().hex[:8]}"
    spec = SandboxSpec(image=gateway.env.settings.sandbox_image, command=["sleep", "infinity"],
                       stop_timeout_seconds=3600)  # fmt: skip
    async with gateway.env.pool.acquire() as conn:
        await templates.create_template(
            conn, template, TemplateBody(spec=spec), "test", datetime.now(UTC)
        )
    request = os1.CreateSandboxRequest(name=name, workspace_scope=SCOPE, workload_template=template)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "CreateSandbox", request, os1.SandboxResponse, metadata=auth(WRITER))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (raised.value.details() or "").startswith(
        "workload_template: its stop_timeout_seconds: at most 600 seconds for token"
    ), raised.value.details()
    assert await gateway.env.fetchval("SELECT count(*) FROM sandboxes WHERE key = $1", name) == 0


async def test_creates_without_a_time_to_live_get_the_servers_default_as_over_http(
    podman: PodmanClient,
) -> None:
    """SANDSTREAM_DEFAULT_TTL_SECONDS is the time to live of every sandbox created without one:
    a plain create and one from a template that sets none (a template's own wins)."""
    async with running_gateway(podman, "osttl", default_ttl_seconds=3600) as gw:
        plain, bare, timed = gw.new_name(), gw.new_name(), gw.new_name()
        without, with_ttl = f"tpl-{uuid.uuid4().hex[:8]}", f"tpl-{uuid.uuid4().hex[:8]}"
        spec = SandboxSpec(image=gw.env.settings.sandbox_image, command=["sleep", "infinity"])
        async with gw.env.pool.acquire() as conn:
            for template, ttl in ((without, None), (with_ttl, 60)):
                body = TemplateBody(spec=spec, ttl_seconds=ttl)
                await templates.create_template(conn, template, body, "test", datetime.now(UTC))
        await call(gw, "CreateSandbox", os1.CreateSandboxRequest(name=plain, spec=os1.SandboxSpec(),
                                                                 workspace_scope=SCOPE),
                   os1.SandboxResponse)  # fmt: skip
        for name, template in ((bare, without), (timed, with_ttl)):
            request = os1.CreateSandboxRequest(
                name=name, workspace_scope=SCOPE, workload_template=template
            )
            await call(gw, "CreateSandbox", request, os1.SandboxResponse)
        lives = {
            r["key"]: None if r["life"] is None else round(r["life"])
            for r in await gw.env.fetch(
                "SELECT key, extract(epoch FROM expires_at - created_at) AS life FROM sandboxes "
                "WHERE key = ANY($1)",
                [plain, bare, timed],
            )
        }
        assert lives == {plain: 3600, bare: 3600, timed: 60}
        for name in lives:  # launched before the plane stops, so its cleanup finds them all
            await ready_in(gw.env, name, "Ready", timeout=WAIT)


async def test_a_create_from_a_template_names_a_refused_override_in_openshells_terms(
    gateway: Gateway,
) -> None:
    """A label the template sets, changed by the request's labels, is INVALID_ARGUMENT naming
    ``labels.<key>`` (the request's field), not the HTTP API's ``overrides.labels``; too many
    variables name ``spec.environment``."""
    template = f"tpl-{uuid.uuid4().hex[:8]}"
    spec = SandboxSpec(
        image=gateway.env.settings.sandbox_image,
        command=["sleep", "infinity"],
        labels={"team": "research"},
        env={f"V{i}": "x" for i in range(200)},
    )
    async with gateway.env.pool.acquire() as conn:
        await templates.create_template(
            conn, template, TemplateBody(spec=spec), "test", datetime.now(UTC)
        )
    cases = [
        (os1.CreateSandboxRequest(labels={"team": "other"}), "labels.team: template "),
        (
            os1.CreateSandboxRequest(
                spec=os1.SandboxSpec(environment={f"W{i}": "y" for i in range(100)})
            ),
            "spec.environment: ",
        ),
    ]
    for request, start in cases:
        name = gateway.new_name()
        request.MergeFrom(
            os1.CreateSandboxRequest(name=name, workspace_scope=SCOPE, workload_template=template)
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (raised.value.details() or "").startswith(start), raised.value.details()
        count = "SELECT count(*) FROM sandboxes WHERE key = $1"
        assert await gateway.env.fetchval(count, name) == 0


async def test_a_create_from_a_template_naming_a_gone_provider_names_the_template(
    gateway: Gateway,
) -> None:
    """A provider the template names, gone since: NOT_FOUND naming workload_template (the
    request's spec.providers named nothing). A delete is refused while a live template names
    the provider and OpenShell's template names no revision, so only an out-of-band removal
    (a restored or hand-edited database, as here) leaves the template naming a gone one."""
    name, template, gone = gateway.new_name(), f"tpl-{uuid.uuid4().hex[:8]}", gateway.new_name()
    spec = SandboxSpec(image=gateway.env.settings.sandbox_image, command=["sleep", "infinity"])
    now = datetime.now(UTC)
    async with gateway.env.pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO providers (name, type, revision, created_at, updated_at) "
            "VALUES ($1, 'generic', 1, $2, $2)",
            gone, now,
        )  # fmt: skip
        body = TemplateBody(spec=spec, providers=[gone])
        await templates.create_template(conn, template, body, "test", now)
        await conn.execute("DELETE FROM providers WHERE name = $1", gone)
    request = os1.CreateSandboxRequest(name=name, workspace_scope=SCOPE, workload_template=template)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "CreateSandbox", request, os1.SandboxResponse)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert raised.value.details() == (
        f"workload_template: provider {gone!r} not found (template {template!r} revision 1 "
        "names it)"
    )
    assert await gateway.env.fetchval("SELECT count(*) FROM sandboxes WHERE key = $1", name) == 0
