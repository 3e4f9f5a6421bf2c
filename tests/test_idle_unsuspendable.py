"""An idle timeout on a sandbox the backend cannot keep a workspace for through a suspend
(Kubernetes without a storage class: the default chart). Each idle suspend failed, put the
sandbox back to Ready, and the next scan found it idle again, for as long as it lived. The API
now refuses such a timeout (tests/test_api_suspend.py); the scheduler does not act on one a
row already has (real PostgreSQL and Kafka, the processor deciding).

A warm pool of a template with an idle timeout was accepted where its members cannot be
suspended, and every claim from it was then refused (422, as a create with the timeout is). The
API now refuses such a pool when it is written, and a template update (or re-create) that
would give such a pool's template an idle timeout (through the API, on the real store). The
OpenShell door refuses a create from a template with an idle timeout as the HTTP one does."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import apikit
import grpc
import pytest
from apikit import unique
from harness import isolated_env
from test_idle_after_outage import FLUSH, Clock, idle_messages, ready_on_a_plane

from drivers.kube_objects import WORKSPACE_DIES_WITH_POD
from events.common import SandboxSpec
from events.publisher import now
from services.api.gateway import CommandGateway
from services.api.readmodel import ChangeFeed
from services.common import templates
from services.common.templates import TemplateBody
from services.common.tokens import READ, WRITE, TokenStore
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1
from services.openshell.server import start_openshell
from services.scheduler.scheduler import Scheduler


async def scan(scheduler: Scheduler, clock: Clock) -> None:
    """Rounds until one idle scan ran (the first is held two flush intervals)."""
    scans = scheduler.idle_scans
    await scheduler.start()
    try:
        while scheduler.idle_scans == scans:
            await scheduler.round()
            clock.at += FLUSH
    finally:
        await scheduler.stop()


async def test_the_scheduler_sends_no_idle_message_for_a_sandbox_it_cannot_suspend() -> None:
    key = "kube-idle"
    async with ready_on_a_plane(key, 60) as env:  # made on the log: no API check on the way
        clock = Clock(now() + timedelta(hours=1))  # an hour unused, its timeout a minute
        routed = {"driver_route_prefix": "kube-", "driver_route": "kubernetes"}
        cannot = env.settings.model_copy(update=routed)
        assert cannot.kube_storage_class is None
        await scan(Scheduler(cannot, env.pool, clock=clock), clock)
        assert await idle_messages(env, key) == []
        # The same row where the backend can suspend it: the scan finds it idle.
        await scan(Scheduler(env.settings, env.pool, clock=clock), clock)
        assert [m.key for m in await idle_messages(env, key)] == [key]


KUBE = "kube-"  # names routed to a Kubernetes backend without a storage class
ROUTED = {"driver_route_prefix": KUBE, "driver_route": "kubernetes"}
IDLE_SPEC = {"image": "registry.example/agent:1", "idle_suspend_seconds": 60}
PLAIN_SPEC = {"image": "registry.example/agent:1"}


def refused(r: Any, field: str) -> str:
    assert r.status_code == 422, r.text
    message = str(r.json()["message"])
    assert r.json()["code"] == "INVALID_ARGUMENT", r.text
    assert message.startswith(f"field '{field}': ") and WORKSPACE_DIES_WITH_POD in message, message
    return message


async def test_a_pool_whose_members_cannot_take_its_templates_idle_timeout_is_refused() -> None:
    async with apikit.running_api(None, settings_update=ROUTED) as api, api.client() as c:
        idle, plain = unique("tpl-idle"), unique("tpl-plain")
        for name, spec in ((idle, IDLE_SPEC), (plain, PLAIN_SPEC)):
            r = await c.post("/v1/templates", json={"name": name, "spec": spec})
            assert r.status_code == 201, r.text
        # A pool whose members run on the backend that cannot suspend: refused, nothing kept.
        kube_pool = unique(KUBE + "p")
        r = await c.post("/v1/pools", json={"name": kube_pool, "template": idle, "size": 1})
        assert f"pool {kube_pool!r}" in refused(r, "template")
        assert (await c.get(f"/v1/pools/{kube_pool}")).status_code == 404
        # Of a template without one it is kept; pointing it at the idle template is refused.
        r = await c.post("/v1/pools", json={"name": kube_pool, "template": plain, "size": 1})
        assert r.status_code == 201, r.text
        body = {"expected_revision": 1, "template": idle}
        refused(await c.patch(f"/v1/pools/{kube_pool}", json=body), "template")
        r = await c.get(f"/v1/pools/{kube_pool}")
        assert (r.json()["template"], r.json()["revision"]) == (plain, 1), r.text
        # Its template taking an idle timeout is refused, naming the pool; nothing written.
        update = {"expected_revision": 1, "spec": IDLE_SPEC}
        message = refused(await c.put(f"/v1/templates/{plain}", json=update),
                          "spec.idle_suspend_seconds")  # fmt: skip
        assert f"pool {kube_pool!r}" in message, message
        assert (await c.get(f"/v1/templates/{plain}")).json()["revision"] == 1
        # ... and so is the template created again under its name after a delete.
        assert (await c.delete(f"/v1/templates/{plain}")).status_code == 200
        r = await c.post("/v1/templates", json={"name": plain, "spec": IDLE_SPEC})
        refused(r, "spec.idle_suspend_seconds")
        r = await c.post("/v1/templates", json={"name": plain, "spec": PLAIN_SPEC})
        assert r.status_code == 201, r.text
        # Other changes of that pool are not refused.
        r = await c.patch(f"/v1/pools/{kube_pool}", json={"expected_revision": 1, "size": 0})
        assert r.status_code == 200, r.text
        # Where the members can be suspended, the idle template is fine, and so are its
        # updates (the refused pool holds nothing of it).
        other = unique("p")
        r = await c.post("/v1/pools", json={"name": other, "template": idle, "size": 1})
        assert r.status_code == 201, r.text
        spec = {**IDLE_SPEC, "idle_suspend_seconds": 120}
        r = await c.put(f"/v1/templates/{idle}", json={"expected_revision": 1, "spec": spec})
        assert r.status_code == 200, r.text


async def test_an_openshell_create_from_a_template_with_an_idle_timeout_is_refused_here() -> None:
    """The HTTP door refused the create (422), OpenShell's CreateSandbox took it: a
    ``workload_template`` with an idle timeout, for a name that cannot be suspended, is now
    INVALID_ARGUMENT naming it (the gateway has no publisher: nothing gets that far)."""
    async with isolated_env(partitions=1) as env:
        idle = unique("tpl-idle")
        async with env.pool.acquire() as conn:
            body = TemplateBody(spec=SandboxSpec.model_validate(IDLE_SPEC))
            await templates.create_template(conn, idle, body, "t", now())
        served = env.settings.model_copy(update={**ROUTED, "openshell_port": 0})
        gateway = CommandGateway(env.pool, None, ChangeFeed(env.pool))  # type: ignore[arg-type]
        tokens = TokenStore.of(admin=(apikit.ADMIN, READ, WRITE))
        door = await start_openshell(served, pool=env.pool, gateway=gateway, tokens=tokens,
                                     driver=None)  # fmt: skip
        try:
            async with grpc.aio.insecure_channel(door.address) as channel:
                create = channel.unary_unary(
                    "/openshell.v1.OpenShell/CreateSandbox",
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=os1.SandboxResponse.FromString,
                )
                request = os1.CreateSandboxRequest(
                    name=unique(KUBE + "sb"),
                    workspace_scope=dm1.WorkspaceSelector(workspace="default"),
                    workload_template=idle,
                )
                metadata = [("authorization", f"Bearer {apikit.ADMIN}")]
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await create(request, metadata=metadata, timeout=30)
        finally:
            await door.stop(0)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    details = raised.value.details() or ""
    assert details.startswith("workload_template: ") and WORKSPACE_DIES_WITH_POD in details
