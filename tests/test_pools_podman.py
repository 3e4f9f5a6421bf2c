"""A warm pool on Podman (real containers; Kafka, PostgreSQL): the pool controller keeps
members running, a create from the pooled template adopts one whose container answers an exec
at once under the claimant's name, and the pool refills with a new container. A claim's time
to live, env and providers are applied warm: the member expires by the claim's TTL, and every
exec gets the claim's env and its providers' values (rotated ones without a restart), which
never reach the log."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import apikit
import pytest
import pytest_asyncio
from apikit import Api, unique
from harness import eventually
from podman import PodmanClient
from pydantic import SecretStr
from typer.testing import CliRunner

from drivers.podman import container_name
from services.api.readmodel import get_sandbox
from services.audit.verify import verify
from services.cli.main import app
from services.common.credentials import CredentialKeyError, Vault
from services.common.exec_env import ExecEnvUnavailable, exec_environment
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


def secret(tag: str) -> str:
    return f"sekrit-{tag}-{secrets.token_hex(8)}"


async def run(c: Any, name: str, script: str) -> str:
    r = await c.post(f"/v1/sandboxes/{name}/exec", json={"command": ["sh", "-c", script]})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    out: str = r.json()["stdout"]
    return out


async def everything_on_the_log(api: Api) -> tuple[bytes, list[str]]:
    """Every record of every topic, and every row of every table, as text."""
    env = api.env
    records = [r.value or b"" for t in env.settings.topics for r in await env.read_topic(t)]
    tables = await env.fetch(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = $1",
        env.settings.pg_schema,
    )
    rows = [
        str(r[0])
        for t in tables
        for r in await env.fetch(f'SELECT t::text FROM "{t["table_name"]}" t')
    ]
    return b"\n".join(records), rows


async def test_a_claims_env_and_provider_reach_every_exec_warm_and_never_the_log(
    api: Api, podman: PodmanClient
) -> None:
    """Warm on Podman: the member's container is not restarted; every exec gets the claim's
    env and its provider's values (a rotation's at the next exec, without a restart; after an
    idle suspend's wake as before); the member's own container keeps the template's env; no
    value reaches a topic, a table (history included), an API answer or ``podman inspect``."""
    provider, values = unique("prov"), [secret("v1"), secret("v2")]
    answers: list[str] = []
    async with api.client() as c:
        r = await c.post(
            "/v1/providers", json={"name": provider, "credentials": {"TOKEN": values[0]}}
        )
        assert r.status_code == 201, r.text
        spec = {**SPEC, "env": {"MODE": "template", "KEEP": "1"}, "idle_suspend_seconds": 3600}
        template, pool, member = await pooled(api, c, spec)
        container = podman.containers.get(container_name(member, 1))
        name = unique("agent")
        body = {
            "name": name,
            "template": {"name": template},
            "overrides": {"env": {"MODE": "claim", "CLAIM_VAR": "x"}},
            "providers": [provider],
            "command_id": unique("claim"),
        }
        for _ in range(2):  # a retry (its command id) is the same claim, saying the same
            r = await c.post("/v1/sandboxes", json=body)
            answers.append(r.text)
            assert r.status_code == 201, r.text
            claim = r.json()["claim"]
            assert claim["warm"] is True and claim["member"] == member, claim
            assert "reach every exec" in claim["reason"], claim
            assert "template's environment" in claim["reason"], claim
        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200

        script = 'echo "$MODE $KEEP $CLAIM_VAR $TOKEN"'
        assert await run(c, name, script) == f"claim 1 x {values[0]}\n"
        container.reload()  # the same container, never restarted, its own env the template's
        assert container.status == "running" and container.attrs["RestartCount"] == 0
        env = container.attrs["Config"]["Env"]
        assert "MODE=template" in env and not [e for e in env if "CLAIM_VAR" in e], env
        view = (await c.get(f"/v1/sandboxes/{name}")).json()
        answers.append(json.dumps(view))
        assert view["spec"]["env"] == {"MODE": "claim", "KEEP": "1", "CLAIM_VAR": "x"}, view
        assert provider in view["providers"] and view["generation"] == 1
        # The views say which providers the claim attached (names: they reach its execs).
        assert view["claim_providers"] == [provider], view
        listed = (await c.get("/v1/sandboxes", params={"limit": 500})).json()["items"]
        assert [s["claim_providers"] for s in listed if s["name"] == name] == [[provider]]
        argv = ["--url", api.url, "--token", apikit.ADMIN, "sandbox", "get", name]
        shown = await asyncio.to_thread(CliRunner().invoke, app, argv)
        assert f"attached by its claim, reaching each exec: {provider}" in shown.output, shown

        # A rotation reaches the next exec, without a restart (the process never read it).
        r = await c.put(f"/v1/providers/{provider}/credentials",
                        json={"credentials": {"TOKEN": values[1]}})  # fmt: skip
        answers.append(r.text)
        assert r.status_code == 200, r.text
        [line] = [x for x in r.json()["sandboxes"] if x["sandbox"] == member]
        assert line["action"] == "skip" and "attached at its claim" in line["reason"], line
        await eventually(lambda: api.env.fetch("SELECT reason FROM history WHERE key = $1", member),
                         lambda rows: any("never read it" in (r["reason"] or "") for r in rows),
                         timeout=30, what="the rotation decided")  # fmt: skip
        assert await run(c, name, script) == f"claim 1 x {values[1]}\n"
        assert (await row_of(api, member))["generation"] == 1

        # Suspended, then woken by an exec: the new generation's exec gets them all the same.
        r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
        assert r.status_code == 200, r.text
        await api.wait_phase(member, "Suspended", timeout=60)
        assert await run(c, name, script) == f"claim 1 x {values[1]}\n"
        assert (await row_of(api, member))["generation"] == 2

        async def no_key() -> Vault:
            raise CredentialKeyError("no key here")

        with pytest.raises(ExecEnvUnavailable, match="cannot be read: no key here"):
            claim = (await get_sandbox(api.env.pool, member)).claim_part  # type: ignore[union-attr]
            await exec_environment(api.env.pool, no_key, member, claim, {})  # refused, not bare

        inspected = [json.dumps(podman.containers.get(container_name(member, 2)).attrs)]
        records, rows = await everything_on_the_log(api)
        assert b"CLAIM_VAR" in records and provider.encode() in records  # names are there
        for value in values:
            assert value.encode() not in records, "a value on a topic"
            assert not [row for row in rows if value in row], "a value in a table"
            assert not [a for a in answers if value in a], "a value in an API answer"
            assert not [i for i in inspected if value in i], "a value in podman inspect"
        # Deleted with force, the provider is detached: it leaves both lists and the execs.
        r = await c.delete(
            f"/v1/providers/{provider}", params={"force": "true", "no_restart": "true"}
        )
        assert r.status_code == 200 and r.json()["detached"] == [member], r.text
        view = await eventually(lambda: c.get(f"/v1/sandboxes/{name}"),
                                lambda r: r.json()["claim_providers"] == [], timeout=30,
                                what="the forced delete's detach decided")  # fmt: skip
        assert provider not in view.json()["providers"], view.text
        assert await run(c, name, script) == "claim 1 x \n"
        assert (await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})).is_success
        await api.wait_phase(member, "Deleted", timeout=60)
