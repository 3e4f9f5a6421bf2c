"""A warm pool on Kubernetes: the pool controller and a claim with the Kubernetes driver
against a real kube-apiserver (kwok as the node; `make k8s` starts it): members are Pods, a
claim adopts one without touching its Pod, a template change rolls the unclaimed ones (new
Pods before old ones go), and deleting the pool leaves the claimed sandbox's Pod running. A
claim with per-claim env is cold there (an exec's environment is in the apiserver's request
URL), one with a time to live warm."""

from __future__ import annotations

from typing import Any

import apikit
from apikit import Api, unique
from harness import eventually
from kube_support import (
    Admin,
    admin_fixture,  # noqa: F401  (the module's admin client)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
)

from drivers.kubernetes import KubernetesDriver

SPEC = {"image": "registry.example/agent:1", "command": ["sleep", "3600"]}


async def members(api: Api, pool: str) -> dict[str, tuple[str, int]]:
    rows = await api.env.pool.fetch(
        "SELECT key, phase, (template->>'revision')::int AS revision FROM sandboxes "
        "WHERE pool = $1 AND phase <> 'Deleted' AND adopted_as IS NULL",
        pool,
    )
    return {r["key"]: (r["phase"], r["revision"]) for r in rows}


def ready_of(found: dict[str, tuple[str, int]], revision: int) -> int:
    return sum(v == ("Ready", revision) for v in found.values())


async def test_a_pool_of_pods_is_claimed_rolled_and_deleted(admin: Admin, ns: str) -> None:
    driver = new_driver(admin, ns)
    try:
        await _claimed_rolled_and_deleted(admin, ns, driver)
    finally:
        await driver.close()


async def _claimed_rolled_and_deleted(admin: Admin, ns: str, driver: KubernetesDriver) -> None:
    # The API's own exec is the Kubernetes driver's, as under `sandstream up` with it.
    update = {"pool_poll_seconds": 0.5, "driver": "kubernetes", "kube_namespace": ns,
              "kube_config": admin.kubeconfig}  # fmt: skip
    async with apikit.running_api(
        driver, with_scheduler=True, settings_update=update
    ) as api, api.client() as c:  # fmt: skip
        template, pool = unique("tpl"), unique("kpool")
        r = await c.post("/v1/templates", json={"name": template, "spec": SPEC})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 2})
        assert r.status_code == 201, r.text
        first = await eventually(lambda: members(api, pool),
                                 lambda m: len(m) == 2 and ready_of(m, 1) == 2,
                                 timeout=90, what="two Ready members")  # fmt: skip
        for key in first:
            assert len(await admin.pods(ns, key)) == 1, key

        # Per-claim env (or providers) cannot reach a Pod's exec privately: cold, saying why.
        cold = unique("agent")
        body = {"name": cold, "template": {"name": template}, "overrides": {"env": {"K": "v"}}}
        r = await c.post("/v1/sandboxes", json=body)
        assert r.status_code in (201, 202) and r.json()["claim"]["warm"] is False, r.text
        assert "kubernetes driver" in r.json()["claim"]["reason"], r.text
        assert "request URL" in r.json()["claim"]["reason"], r.text

        name = unique("agent")  # with a time to live: warm, the TTL applied at the adoption
        body = {"name": name, "template": {"name": template}, "ttl_seconds": 3600}
        r = await c.post("/v1/sandboxes", json=body)
        assert r.status_code == 201 and r.json()["claim"]["warm"] is True, r.text
        member = r.json()["claim"]["member"]
        assert (await c.get(f"/v1/sandboxes/{name}")).json()["expires_at"] is not None
        pod: list[dict[str, Any]] = await admin.pods(ns, member)
        assert len(pod) == 1

        newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "expected_revision": 1}
        assert (await c.put(f"/v1/templates/{template}", json=newer)).status_code == 200
        rolled = await eventually(lambda: members(api, pool),
                                  lambda m: len(m) == 2 and ready_of(m, 2) == 2,
                                  timeout=90, what="two Ready members of revision 2")  # fmt: skip
        assert not set(rolled) & set(first)
        for key in rolled:
            [made] = await admin.pods(ns, key)
            assert made["spec"]["containers"][0]["image"] == "registry.example/agent:2"

        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200
        for key in rolled:
            await eventually(lambda k=key: admin.pods(ns, k), lambda p: p == [], timeout=90,
                             what=f"{key}'s Pod deleted")  # fmt: skip
        kept = await admin.pods(ns, member)  # the claimed one: the same Pod, untouched
        assert [p["metadata"]["uid"] for p in kept] == [p["metadata"]["uid"] for p in pod]
        assert (await c.get(f"/v1/sandboxes/{name}")).json()["phase"] == "Ready"

        assert (await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})).status_code == 200
        assert (await c.delete(f"/v1/sandboxes/{cold}", params={"wait": 30})).status_code == 200
        await eventually(lambda: admin.pods(ns, member), lambda p: p == [], timeout=90,
                         what="the claimed sandbox's Pod deleted")  # fmt: skip
