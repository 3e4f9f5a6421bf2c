"""A warm pool on Podman (real containers; Kafka, PostgreSQL): the pool controller keeps
members running, a create from the pooled template adopts one whose container answers an exec
at once under the claimant's name, and the pool refills with a new container. A claim's time
to live, env and providers are applied warm: the member expires by the claim's TTL, and every
exec gets the claim's env and its providers' values (rotated ones without a restart), which
never reach the log."""

from __future__ import annotations

import base64
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import apikit
import pytest_asyncio
from apikit import Api, unique
from harness import eventually
from podman import PodmanClient
from pydantic import SecretStr

from drivers.podman import container_name
from services.audit.verify import verify
from services.common.settings import load_settings
from services.executor.backends import podman_driver
from services.processor.rebuild import rebuild_and_compare

IMAGE = load_settings().sandbox_image
KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
SPEC = {"image": IMAGE, "command": ["sleep", "3600"], "stop_timeout_seconds": 2}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    driver = podman_driver(load_settings(), stop_timeout=2)
    update = {"pool_poll_seconds": 0.5, "credentials_key": KEY}
    try:
        async with apikit.running_api(
            driver, with_scheduler=True, settings_update=update
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


async def pooled(api: Api, c: Any, spec: dict[str, Any], **template: Any) -> tuple[str, str, str]:
    """A template of ``spec`` and a pool of one Ready member: (template, pool, member key)."""
    name, pool = unique("tpl"), unique("pool")
    r = await c.post("/v1/templates", json={"name": name, "spec": spec, **template})
    assert r.status_code == 201, r.text
    r = await c.post("/v1/pools", json={"name": pool, "template": name, "size": 1})
    assert r.status_code == 201, r.text
    [member] = await eventually(lambda: ready_members(api, pool), lambda m: len(m) == 1,
                                timeout=90, what="a Ready member")  # fmt: skip
    return name, pool, member["key"]


async def row_of(api: Api, key: str) -> dict[str, Any]:
    row = await api.env.pool.fetchrow(
        "SELECT phase, reason, generation, expires_at FROM sandboxes WHERE key = $1", key
    )
    assert row is not None
    return dict(row)


async def test_a_claim_with_a_ttl_is_warm_and_the_sandbox_expires_by_it(api: Api) -> None:
    """The claim's time to live is applied at the adoption, counted from it: warm (the member
    waited untimed in the pool), then stopped by its expiry like any sandbox with a TTL; the
    rows rebuilt from the log and the audit agree."""
    async with api.client() as c:
        template, pool, member = await pooled(api, c, SPEC)
        name = unique("agent")
        before = datetime.now(UTC)
        body = {"name": name, "template": {"name": template}, "ttl_seconds": 3}
        r = await c.post("/v1/sandboxes", json=body)
        after = datetime.now(UTC)
        assert r.status_code == 201, r.text
        assert r.json()["claim"]["warm"] is True and r.json()["claim"]["member"] == member, r.text
        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200  # no refill needed
        expires = (await row_of(api, member))["expires_at"]
        assert expires is not None
        assert before + timedelta(seconds=3) <= expires <= after + timedelta(seconds=3)
        got = (await c.get(f"/v1/sandboxes/{name}")).json()
        assert datetime.fromisoformat(got["expires_at"]) == expires

        expired = await eventually(
            lambda: row_of(api, member),
            lambda row: row["phase"] == "Stopped",
            timeout=60,
            what="the claimed sandbox stopped by its time to live",
        )
        assert expired["expires_at"] is None and expired["generation"] == 1
        history = (await c.get(f"/v1/sandboxes/{name}/history", params={"limit": 100})).json()
        kinds = [e for h in history["items"] for e in h.get("events") or []]
        assert kinds.index("SandboxAdopted") < kinds.index("SandboxExpired"), kinds
        report = await verify(api.env.settings)
        assert report.divergences == [] and report.ok, report.divergences
        await eventually(lambda: rebuild_and_compare(api.env.settings), lambda r: r.equal,
                         timeout=30, what="the rows rebuilt from the events topic")  # fmt: skip
        assert (await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})).is_success
