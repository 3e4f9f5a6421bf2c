"""A warm pool on Podman (real containers; Kafka, PostgreSQL): the pool controller keeps
members running, a create from the pooled template adopts one whose container answers an exec
at once under the claimant's name, and the pool refills with a new container."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import apikit
import pytest_asyncio
from apikit import Api, unique
from harness import eventually
from podman import PodmanClient

from drivers.podman import container_name
from services.common.settings import load_settings
from services.executor.backends import podman_driver

IMAGE = load_settings().sandbox_image


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    driver = podman_driver(load_settings(), stop_timeout=2)
    try:
        async with apikit.running_api(
            driver, with_scheduler=True, settings_update={"pool_poll_seconds": 0.5}
        ) as running:
            yield running
    finally:
        await driver.close()


async def ready_members(api: Api, pool: str) -> list[dict[str, Any]]:
    rows = await api.env.pool.fetch(
        "SELECT key, generation FROM sandboxes WHERE pool = $1 AND adopted_as IS NULL "
        "AND phase = 'Ready' ORDER BY key",
        pool,
    )
    return [dict(r) for r in rows]


async def test_a_claim_gets_a_running_container_that_answers_an_exec(
    api: Api, podman: PodmanClient
) -> None:
    template, pool = unique("tpl"), unique("pool")
    spec = {"image": IMAGE, "command": ["sleep", "3600"], "stop_timeout_seconds": 2}
    async with api.client() as c:
        assert (await c.post("/v1/templates", json={"name": template, "spec": spec})).is_success
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 1})
        assert r.status_code == 201, r.text
        [first] = await eventually(lambda: ready_members(api, pool), lambda m: len(m) == 1,
                                   timeout=90, what="a Ready member")  # fmt: skip
        running = podman.containers.get(container_name(first["key"], first["generation"]))
        assert running.status == "running"

        name = unique("agent")
        r = await c.post("/v1/sandboxes", json={"name": name, "template": {"name": template}})
        assert r.status_code == 201 and r.json()["claim"]["member"] == first["key"], r.text
        r = await c.post(f"/v1/sandboxes/{name}/exec", json={"command": ["echo", "warm"]})
        assert r.status_code == 200 and r.json()["stdout"] == "warm\n", r.text
        running.reload()  # the same container, never restarted for the claim
        assert running.status == "running" and running.attrs["RestartCount"] == 0

        [refill] = await eventually(lambda: ready_members(api, pool), lambda m: len(m) == 1,
                                    timeout=90, what="the pool refilled")  # fmt: skip
        assert refill["key"] != first["key"]
        assert podman.containers.get(container_name(refill["key"], 1)).status == "running"

        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200
        assert (await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})).is_success
        live = "SELECT count(*) FROM sandboxes WHERE pool = $1 AND phase <> 'Deleted'"
        await eventually(lambda: api.env.fetchval(live, pool), lambda n: n == 0, timeout=60,
                         what="the pool's members and the claimed sandbox deleted")  # fmt: skip
