"""OpenShell's CreateSandbox naming a pooled ``workload_template`` is a claim, as
``POST /v1/sandboxes`` naming the template is (services/api/pool_claims.py): on the real stack
(Kafka, PostgreSQL, Podman), through the door's 0.1 protocol. No pool controller runs here, so
the pool is not refilled behind the claims: its two members are all there is."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import apikit
import pytest_asyncio
from apikit import Api, unique
from claims_support import SLEEPER, adoptions, all_ready, create_members
from openshell_support import PATH, auth, serving_door

from events.common import SandboxSpec, TemplateRef
from services.api.gateway import CommandGateway
from services.common import pools as pools_store
from services.common import templates
from services.common.settings import load_settings
from services.common.templates import TemplateBody
from services.executor.backends import podman_driver
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

IMAGE = load_settings().sandbox_image
SCOPE = dm1.WorkspaceSelector(workspace="default")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def driver() -> AsyncIterator[Any]:
    made = podman_driver(load_settings())
    try:
        yield made
    finally:
        await made.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api(driver: Any) -> AsyncIterator[Api]:
    async with apikit.running_api(driver) as running:
        yield running


def claim_of(sandbox: os1.Sandbox) -> tuple[str, str]:
    """The PoolClaim condition of a create's answer: (status, message)."""
    [found] = [c for c in sandbox.status.conditions if c.type == "PoolClaim"]
    return found.status, found.message


async def test_an_openshell_create_from_a_pooled_template_claims_as_over_http(
    api: Api, driver: Any
) -> None:
    """With 2 Ready members: a create with its own command is cold (and says why) and adopts
    none; two creates adopt one member each (the name answers GetSandbox with the member's
    row); a third is created cold; a retry under a request id is the same claim, counted
    once."""
    template, pool = unique("tpl"), unique("pool")
    async with api.env.pool.acquire() as conn:
        body = TemplateBody(spec=SandboxSpec(image=IMAGE, command=SLEEPER))
        await templates.create_template(conn, template, body, "test", datetime.now(UTC))
        await pools_store.create_pool(
            conn, pool, template, 2, "Recreate", "test", datetime.now(UTC)
        )
    gateway: CommandGateway = api.app.state.api.gateway
    members = await create_members(gateway, pool, 2, IMAGE, TemplateRef(name=template, revision=1))
    await all_ready(api.env.pool, members)
    ids = {r["key"]: str(r["sandbox_id"]) for r in await api.env.pool.fetch(
        "SELECT key, sandbox_id FROM sandboxes WHERE key = ANY($1)", members)}  # fmt: skip
    names = [unique("agent") for _ in range(4)]
    requests = [str(uuid.uuid4()) for _ in names]
    async with serving_door(api.env, driver) as (channel, _, _):

        def rpc(method: str, answer: Any) -> Any:
            return channel.unary_unary(
                PATH + method,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=answer.FromString,
            )

        async def create(i: int, **more: Any) -> os1.Sandbox:
            request = os1.CreateSandboxRequest(name=names[i], workspace_scope=SCOPE,
                                               workload_template=template,
                                               request_id=requests[i], **more)  # fmt: skip
            answer: os1.SandboxResponse = await rpc("CreateSandbox", os1.SandboxResponse)(
                request, metadata=auth(), timeout=90
            )
            return answer.sandbox

        own = await create(3, spec=os1.SandboxSpec(command=["sleep", "60"]))
        why = "a per-claim spec.command needs a cold start (the member runs the template's)"
        assert claim_of(own) == ("False", f"pool {pool!r}: created cold: {why}")
        assert await adoptions(api.env.pool, pool) == []

        warm = [await create(i, labels={"who": "os"}) for i in (0, 1)]
        adopted = {s.metadata.id: s for s in warm}
        assert sorted(adopted) == sorted(ids.values())
        for i, sandbox in enumerate(warm):
            member = next(k for k, v in ids.items() if v == sandbox.metadata.id)
            assert sandbox.metadata.name == names[i]
            assert claim_of(sandbox) == ("True", f"pool {pool!r}: adopted {member!r}")
            got = await rpc("GetSandbox", os1.SandboxResponse)(
                os1.GetSandboxRequest(name=names[i], workspace_scope=SCOPE), metadata=auth()
            )
            assert got.sandbox.metadata.id == ids[member]
            assert got.sandbox.status.phase == os1.SANDBOX_PHASE_READY
            assert dict(got.sandbox.metadata.labels) == {"who": "os"}

        cold = await create(2)
        assert claim_of(cold) == ("False", f"pool {pool!r}: created cold: no Ready member of "
                                           f"pool {pool!r} is unclaimed")  # fmt: skip
        assert cold.metadata.id not in ids.values()
        assert cold.created_from_workload_template.name == template

        again = await create(0, labels={"who": "os"})  # the same request: the same claim
        assert again.metadata.id == warm[0].metadata.id
        assert claim_of(again)[0] == "True"
        assert (await create(2)).metadata.id == cold.metadata.id
    claimed = await adoptions(api.env.pool, pool)
    assert sorted((a["adopted_as"], a["claim_id"]) for a in claimed) == sorted(
        zip(names[:2], requests[:2], strict=True)
    )
    async with api.env.pool.acquire() as conn:
        stats = await pools_store.claim_stats(conn, pool)
    assert (stats[True].count, stats[False].count) == (2, 2)  # each request once
    async with api.client() as c:
        for name in names:
            assert (await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})).is_success


async def test_an_openshell_claim_with_its_own_environment_is_warm_and_its_exec_sees_it(
    api: Api, driver: Any
) -> None:
    """``spec.environment`` on a create from a pooled template is the claim's env: warm on
    Podman, and ExecSandbox (the SDK's commands.run) gets it over the member's own; with its
    own ``spec.command`` the create stays cold for that reason."""
    template, pool = unique("tpl"), unique("pool")
    async with api.env.pool.acquire() as conn:
        spec = SandboxSpec(image=IMAGE, command=SLEEPER, env={"MODE": "template"})
        await templates.create_template(conn, template, TemplateBody(spec=spec), "test",
                                        datetime.now(UTC))  # fmt: skip
        await pools_store.create_pool(
            conn, pool, template, 1, "Recreate", "test", datetime.now(UTC)
        )
    gateway: CommandGateway = api.app.state.api.gateway
    ref = TemplateRef(name=template, revision=1)
    [member] = await create_members(gateway, pool, 1, IMAGE, ref, env={"MODE": "template"})
    await all_ready(api.env.pool, [member])
    name, other = unique("agent"), unique("agent")
    async with serving_door(api.env, driver) as (channel, _, _):
        create = channel.unary_unary(
            PATH + "CreateSandbox",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=os1.SandboxResponse.FromString,
        )
        execute = channel.unary_stream(
            PATH + "ExecSandbox",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=os1.ExecSandboxEvent.FromString,
        )
        asked = os1.SandboxSpec(environment={"MODE": "claim"}, command=["sleep", "60"])
        own = await create(os1.CreateSandboxRequest(name=other, workspace_scope=SCOPE,
                                                    workload_template=template, spec=asked),
                           metadata=auth(), timeout=90)  # fmt: skip
        status, message = claim_of(own.sandbox)
        assert status == "False" and "per-claim spec.command" in message, message

        asked = os1.SandboxSpec(environment={"MODE": "claim"})
        made = await create(os1.CreateSandboxRequest(name=name, workspace_scope=SCOPE,
                                                     workload_template=template, spec=asked),
                            metadata=auth(), timeout=90)  # fmt: skip
        status, message = claim_of(made.sandbox)
        assert status == "True" and f"adopted {member!r}" in message, message
        assert "reach every exec" in message, message
        request = os1.ExecSandboxRequest(
            sandbox=name, workspace_scope=SCOPE, command=["sh", "-c", 'echo "$MODE"']
        )
        events = [e async for e in execute(request, metadata=auth(), timeout=60)]
        out = b"".join(e.stdout.data for e in events if e.HasField("stdout"))
        assert out == b"claim\n" and events[-1].exit.exit_code == 0, events
    async with api.client() as c:
        for each in (name, other):
            assert (await c.delete(f"/v1/sandboxes/{each}", params={"wait": 30})).is_success
