"""Claims on the Kubernetes driver (the local kube-apiserver, kwok as the node): a pool
member's Pod is adopted as it runs, under the claimant's name, without a new Pod; deleting the
claimant's name removes the member's Pod and frees the name. A claim with per-claim env is cold
there (the driver's exec cannot pass an environment privately)."""

from __future__ import annotations

import uuid
from typing import Any

import apikit
from apikit import unique
from claims_support import all_ready, bindings, create_members
from harness import eventually
from kube_support import (
    Admin,
    admin_fixture,  # noqa: F401  (the module's admin client)
    driver_config,
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
)

from drivers.kube_exec import KubeExec
from drivers.kube_objects import pod_name
from drivers.protocol import exec_env_refusal
from services.api.claims import claim
from services.api.gateway import CommandGateway

IMAGE = "registry.example/agent:1"


async def test_a_claim_adopts_a_running_pod_without_a_new_one(admin: Admin, ns: str) -> None:
    driver = new_driver(admin, ns)
    try:
        await claimed_on(driver, admin, ns)
    finally:
        await driver.close()


async def claimed_on(driver: Any, admin: Admin, ns: str) -> None:
    async with apikit.running_api(driver) as api:
        gateway: CommandGateway = api.app.state.api.gateway
        pool = unique("kpool")
        members = await create_members(gateway, pool, 2, IMAGE)
        await all_ready(api.env.pool, members, timeout=120)
        pods = {m: await admin.pods(ns, m) for m in members}
        name = unique("kclaim")
        result = await claim(
            gateway, pool, name, actor="alice", claim_id=str(uuid.uuid4()), labels={"t": "1"}
        )
        assert result.warm and result.member in members, result
        member = result.member
        assert member is not None
        # Per-claim env through the Kubernetes driver's exec: cold, naming why (the other
        # member is left alone).
        refusal = exec_env_refusal(KubeExec(driver_config(admin, ns)))
        cold = await claim(
            gateway, pool, unique("kclaim"), actor="alice", claim_id=str(uuid.uuid4()),
            env={"K": "v"}, env_refusal=refusal,
        )  # fmt: skip
        assert not cold.warm and "kubernetes driver" in cold.reason, cold
        assert "request URL" in cold.reason, cold
        async with api.client() as c:
            view = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert (view["name"], view["member_key"], view["generation"]) == (name, member, 1)
            assert view["labels"] == {"t": "1"}
            # The same Pod, not a new one; nothing runs under the claimant's name.
            after = await admin.pods(ns, member)
            assert [p["metadata"]["uid"] for p in after] == [
                p["metadata"]["uid"] for p in pods[member]
            ]
            assert [p["metadata"]["name"] for p in after] == [pod_name(member, 1)]
            assert await admin.pod_names(ns, name) == []
            r = await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
            assert r.status_code == 200, r.text
            await api.wait_phase(member, "Deleted", timeout=120)
            assert await admin.pod_names(ns, member) == []
            await eventually(lambda: bindings(api.env.pool), lambda b: name not in b,
                             what="the name released")  # fmt: skip
            for other in set(members) - {member}:
                await c.delete(f"/v1/sandboxes/{other}", params={"wait": 30})
                await api.wait_phase(other, "Deleted", timeout=120)
