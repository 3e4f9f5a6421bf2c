"""Warm pools on the real stack (Kafka, PostgreSQL; the fake driver): the /v1/pools store and
its refusals, and the pool controller keeping a pool at size through ordinary commands: fill,
replace a failed member, scale up and down, roll on a template change (Recreate never below
what the pool serves; OnReplenish not at all), delete."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import apikit
import pytest_asyncio
from apikit import ADMIN, READER, Api, unique
from harness import eventually
from prometheus_client import REGISTRY
from typer.testing import CliRunner, Result

from drivers.fake import FakeDriver
from services.cli.main import app
from services.common import pools as pools_store
from services.scheduler.pool_controller import delete_command

SPEC = {"image": "registry.example/agent:1", "command": ["sleep", "3600"]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    async with apikit.running_api(
        FakeDriver(), with_scheduler=True, settings_update={"pool_poll_seconds": 0.5}
    ) as running:
        yield running


async def make_template(api: Api, name: str, spec: dict[str, Any] | None = None) -> None:
    async with api.client() as c:
        r = await c.post("/v1/templates", json={"name": name, "spec": spec or SPEC})
    assert r.status_code == 201, r.text


async def members(api: Api, pool: str) -> list[dict[str, Any]]:
    """The pool's unclaimed live members: key, phase, template revision."""
    rows = await api.env.pool.fetch(
        "SELECT key, phase, (template->>'revision')::int AS revision, generation FROM sandboxes "
        "WHERE pool = $1 AND phase <> 'Deleted' AND adopted_as IS NULL ORDER BY key",
        pool,
    )
    return [dict(r) for r in rows]


def ready(rows: list[dict[str, Any]], revision: int | None = None) -> int:
    return sum(r["phase"] == "Ready" and revision in (None, r["revision"]) for r in rows)


async def settled(api: Api, pool: str, size: int, revision: int = 1) -> list[dict[str, Any]]:
    """Wait until the pool holds exactly ``size`` members, all Ready, of ``revision``."""
    return await eventually(
        lambda: members(api, pool),
        lambda rows: len(rows) == size and ready(rows, revision) == size,
        timeout=60,
        what=f"pool {pool} at {size} Ready members of revision {revision}",
    )


async def test_pool_writes_refuse_bad_input_naming_the_field(api: Api) -> None:
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        r = await c.post("/v1/pools", json={"name": pool, "template": "nope", "size": 1})
        assert (r.status_code, r.json()["code"]) == (404, "NOT_FOUND"), r.text
        assert "field 'template'" in r.json()["message"]
        r = await c.post("/v1/pools", json={"name": "p" * 55, "template": template, "size": 1})
        assert r.status_code == 422 and "name" in r.json()["message"], r.text
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": -1})
        assert r.status_code == 422 and "size" in r.json()["message"], r.text
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 0,
                                            "strategy": "Sometimes"})  # fmt: skip
        assert r.status_code == 422 and "strategy" in r.json()["message"], r.text
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 0})
        assert r.status_code == 201, r.text
        assert r.headers["location"] == f"/v1/pools/{pool}"
        created = r.json()
        assert (created["revision"], created["strategy"], created["status"]["ready"]) == (
            1, "Recreate", 0,
        )  # fmt: skip
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 0})
        assert (r.status_code, r.json()["code"]) == (409, "ALREADY_EXISTS"), r.text
        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1})
        assert r.status_code == 422 and "size" in r.json()["message"], r.text
        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1, "size": 0})
        assert r.status_code == 200 and r.json()["revision"] == 2, r.text
        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1, "size": 1})
        assert (r.status_code, r.json()["code"]) == (409, "ABORTED"), r.text
        assert "expected_revision" in r.json()["message"]
        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 2, "template": "nope"})
        assert r.status_code == 404 and "field 'template'" in r.json()["message"], r.text
        r = await c.get(f"/v1/pools/{pool}")
        assert (r.json()["size"], r.json()["revision"]) == (0, 2), r.text
        assert pool in [p["name"] for p in (await c.get("/v1/pools")).json()["items"]]
        async with api.client(READER) as reader:
            assert (await reader.get(f"/v1/pools/{pool}")).status_code == 200
            denied = await reader.delete(f"/v1/pools/{pool}")
            assert denied.status_code == 403, denied.text
        r = await c.delete(f"/v1/pools/{pool}", params={"expected_revision": 1})
        assert (r.status_code, r.json()["code"]) == (409, "ABORTED"), r.text
        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200
        assert (await c.get(f"/v1/pools/{pool}")).status_code == 404
        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 404


async def test_a_pool_of_a_template_naming_providers_needs_provider_write(api: Api) -> None:
    """Its members get the providers' values, as a create attaching them does: a token
    without provider:write may not make the controller attach them (it could not directly)."""
    provider, template, pool = unique("prov"), unique("tpl"), unique("pool")
    async with api.client() as c:
        r = await c.post("/v1/providers", json={"name": provider, "credentials": {"T": "v"}})
        assert r.status_code == 201, r.text
        body = {"name": template, "spec": SPEC, "providers": [provider]}
        assert (await c.post("/v1/templates", json=body)).status_code == 201
        plain = unique("tpl")
        assert (
            await c.post("/v1/templates", json={"name": plain, "spec": SPEC})
        ).status_code == 201
    async with api.client(apikit.WRITER) as c:
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 0})
        assert r.status_code == 403 and "provider:write" in r.json()["message"], r.text
        r = await c.post("/v1/pools", json={"name": pool, "template": plain, "size": 0})
        assert r.status_code == 201, r.text
        update = {"template": template, "expected_revision": 1}
        r = await c.patch(f"/v1/pools/{pool}", json=update)
        assert r.status_code == 403 and "provider:write" in r.json()["message"], r.text


async def test_a_claim_adopts_only_a_member_its_token_could_create(api: Api) -> None:
    """A review found it: a claim was checked against the newest revision of the template it
    named, then adopted any Ready member of the pool. A token without provider:write removed
    the providers from a template whose outdated members still had them attached, and got one
    of those by a claim (its per-claim env reaches each exec, and the member's next start);
    and a pool pointed at another template served the first one's members to claims of the
    second. A claim now adopts only a member of the template it names, of a revision the
    token could create from itself."""
    provider, template, other, pool = unique("prov"), unique("tpl"), unique("tpl"), unique("pool")
    async with api.client() as c:
        r = await c.post("/v1/providers", json={"name": provider, "credentials": {"T": "v"}})
        assert r.status_code == 201, r.text
        body = {"name": template, "spec": SPEC, "providers": [provider]}
        assert (await c.post("/v1/templates", json=body)).status_code == 201
        body = {"name": pool, "template": template, "size": 1, "strategy": "OnReplenish"}
        assert (await c.post("/v1/pools", json=body)).status_code == 201
        [member] = await settled(api, pool, 1)
    async with api.client(apikit.WRITER) as c:
        plain = {"spec": SPEC, "providers": [], "expected_revision": 1}
        assert (await c.put(f"/v1/templates/{template}", json=plain)).status_code == 200
        name = unique("agent")
        made = await claim(api, name, template, token=apikit.WRITER)
        assert made["claim"]["warm"] is False, made
        assert f"revision 1: it attaches providers ({provider})" in made["claim"]["reason"]
    async with api.client() as c:
        got = (await c.get(f"/v1/sandboxes/{name}")).json()
        assert (got["providers"], got["template"]["revision"]) == ([], 2), got
    assert member["key"] in {m["key"] for m in await members(api, pool)}  # not spent

    async with api.client() as c:
        assert (
            await c.post("/v1/templates", json={"name": other, "spec": SPEC})
        ).status_code == 201
        r = await c.patch(f"/v1/pools/{pool}", json={"template": other, "expected_revision": 1})
        assert r.status_code == 200, r.text
    for revision in (None, 1):  # the other template's revision 1 is not the first one's
        made = await claim(api, unique("agent"), other, revision)
        assert made["claim"]["warm"] is False, made  # its only member is the first one's
    assert member["key"] in {m["key"] for m in await members(api, pool)}


async def test_the_controller_fills_replaces_scales_and_deletes_a_pool(api: Api) -> None:
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 3})
        assert r.status_code == 201, r.text
        rows = await settled(api, pool, 3)
        assert all(r["key"].startswith(f"{pool}-") and len(r["key"]) == len(pool) + 9
                   for r in rows)  # fmt: skip

        failed = rows[0]
        assert api.plane is not None and isinstance(api.plane.driver, FakeDriver)
        api.plane.driver.runtime_exited(failed["key"], failed["generation"], exit_code=1)
        rows = await eventually(
            lambda: members(api, pool),
            lambda rows: failed["key"] not in {r["key"] for r in rows} and ready(rows) == 3,
            timeout=60,
            what="the failed member deleted and replaced",
        )
        history = await api.env.pool.fetch(
            "SELECT message_type FROM history WHERE key = $1 AND disposition = 'applied'",
            failed["key"],
        )
        assert "DeleteSandbox" in [h["message_type"] for h in history]

        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1, "size": 5})
        assert r.status_code == 200, r.text
        await settled(api, pool, 5)
        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 2, "size": 1})
        await settled(api, pool, 1)
        status = (await c.get(f"/v1/pools/{pool}")).json()["status"]
        assert (status["members"], status["ready"], status["outdated"]) == ({"Ready": 1}, 1, 0)
        ever = await api.env.pool.fetchval("SELECT count(*) FROM sandboxes WHERE pool = $1", pool)
        assert ever == 6  # 3, one replaced, 2 more: nothing created twice

        gauge = f'sandstream_pool_members{{phase="Ready",pool="{pool}"}}'
        await eventually(lambda: c.get("/metrics"), lambda r: f"{gauge} 1.0" in r.text,
                         what="the pool's gauge at 1 Ready")  # fmt: skip

        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200
        await eventually(lambda: members(api, pool), lambda rows: rows == [], timeout=60,
                         what="the deleted pool's members gone")  # fmt: skip
        await eventually(lambda: c.get("/metrics"), lambda r: gauge not in r.text,
                         what="the deleted pool's gauges gone")  # fmt: skip


def pool_produces() -> float:
    labels = {"client": "sandstream-pools", "request": "Produce"}
    return REGISTRY.get_sample_value("sandstream_kafka_requests_total", labels) or 0.0


async def test_a_rounds_creates_and_deletes_go_to_kafka_together(api: Api) -> None:
    """A pool filled (or scaled down) by ten asks Kafka once or twice (one request per round
    the controller needs), not once per member: each request costs the broker CPU."""
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        before = pool_produces()
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 10})
        assert r.status_code == 201, r.text
        await settled(api, pool, 10)
        assert pool_produces() - before <= 3
        before = pool_produces()
        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1, "size": 0})
        assert r.status_code == 200, r.text
        await settled(api, pool, 0)
        assert pool_produces() - before <= 3
        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200


async def test_recreate_rolls_members_without_dropping_below_the_pool_size(api: Api) -> None:
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 3})
        assert r.status_code == 201, r.text
        await settled(api, pool, 3)
        newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "expected_revision": 1}
        r = await c.put(f"/v1/templates/{template}", json=newer)
        assert r.status_code == 200, r.text
        lowest = 3

        async def watch() -> list[dict[str, Any]]:
            nonlocal lowest
            rows = await members(api, pool)
            lowest = min(lowest, ready(rows))
            return rows

        await eventually(watch, lambda rows: len(rows) == 3 and ready(rows, 2) == 3, timeout=60,
                         interval=0.02, what="every member rolled to revision 2")  # fmt: skip
        assert lowest >= 3


async def test_on_replenish_keeps_old_members_until_claimed(api: Api) -> None:
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        body = {"name": pool, "template": template, "size": 2, "strategy": "OnReplenish"}
        assert (await c.post("/v1/pools", json=body)).status_code == 201
        before = await settled(api, pool, 2)
        newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "expected_revision": 1}
        assert (await c.put(f"/v1/templates/{template}", json=newer)).status_code == 200
        assert api.plane is not None and api.plane.pools is not None
        rounds = api.plane.pools.rounds
        await eventually(lambda: api.plane.pools.rounds if api.plane and api.plane.pools else 0,
                         lambda n: n >= rounds + 3, what="three controller rounds")  # fmt: skip
        assert await members(api, pool) == before
        status = (await c.get(f"/v1/pools/{pool}")).json()["status"]
        assert (status["outdated"], status["template_revision"]) == (2, 2)
        # Scaling up fills with the current revision; the old members stay.
        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1, "size": 3})
        assert r.status_code == 200, r.text
        rows = await eventually(lambda: members(api, pool),
                                lambda rows: ready(rows) == 3 and ready(rows, 2) == 1,
                                timeout=60, what="one new member of revision 2")  # fmt: skip
        assert {r["key"] for r in before} <= {r["key"] for r in rows}


async def test_a_claim_pinning_the_newest_revision_adopts_no_outdated_member(api: Api) -> None:
    """An OnReplenish pool keeps serving its outdated members to claims that pin no revision;
    a claim pinning the newest one must not get one (it did: a member of revision 1 under a
    request for revision 2, its spec the older one)."""
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        body = {"name": pool, "template": template, "size": 1, "strategy": "OnReplenish"}
        assert (await c.post("/v1/pools", json=body)).status_code == 201
        [old] = await settled(api, pool, 1)
        newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "expected_revision": 1}
        assert (await c.put(f"/v1/templates/{template}", json=newer)).status_code == 200

        cold = await claim(api, unique("agent"), template, revision=2)
        assert cold["claim"]["warm"] is False, cold
        assert "of template revision 2" in cold["claim"]["reason"], cold
        assert [r["key"] for r in await members(api, pool)] == [old["key"]]  # not spent

        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1, "size": 2})
        assert r.status_code == 200, r.text
        rows = await eventually(lambda: members(api, pool), lambda rows: ready(rows, 2) == 1,
                                timeout=60, what="a member of revision 2")  # fmt: skip
        [fresh] = [row["key"] for row in rows if row["revision"] == 2]
        name = unique("agent")
        warm = await claim(api, name, template, revision=2)
        assert warm["claim"]["warm"] is True and warm["claim"]["member"] == fresh, warm
        got = (await c.get(f"/v1/sandboxes/{name}")).json()
        assert got["template"] == {"name": template, "revision": 2}, got


async def test_outdated_members_serve_claims_of_their_revision_with_its_time_to_live(
    api: Api,
) -> None:
    """A review found both. A claim pinning an older revision went cold at once, though Ready
    members of it were there to adopt. An unpinned claim adopting an outdated member got the
    newest revision's time to live with the older revision's member."""
    template, pool = unique("tpl"), unique("pool")
    async with api.client() as c:
        r = await c.post("/v1/templates", json={"name": template, "spec": SPEC,
                                                "ttl_seconds": 600})  # fmt: skip
        assert r.status_code == 201, r.text
        body = {"name": pool, "template": template, "size": 2, "strategy": "OnReplenish"}
        assert (await c.post("/v1/pools", json=body)).status_code == 201
        old = {row["key"] for row in await settled(api, pool, 2)}
        newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "ttl_seconds": 7200,
                 "expected_revision": 1}  # fmt: skip
        assert (await c.put(f"/v1/templates/{template}", json=newer)).status_code == 200

        async def expires_in(name: str) -> float:
            got = (await c.get(f"/v1/sandboxes/{name}")).json()
            expires = datetime.fromisoformat(got["expires_at"])
            return (expires - datetime.now(UTC)).total_seconds()

        unpinned = unique("agent")
        made = await claim(api, unpinned, template)  # only revision 1 is Ready yet
        assert made["claim"]["warm"] is True and made["claim"]["member"] in old, made
        first = made["claim"]["member"]
        assert 500 < await expires_in(unpinned) <= 600  # revision 1's, not 7200
        pinned = unique("agent")
        made = await claim(api, pinned, template, revision=1)
        assert made["claim"]["warm"] is True, made
        assert made["claim"]["member"] in old - {first}, made
        got = (await c.get(f"/v1/sandboxes/{pinned}")).json()
        assert got["template"] == {"name": template, "revision": 1}, got
        assert 500 < await expires_in(pinned) <= 600
        again = await claim(api, unique("agent"), template, revision=1)  # none of it left
        assert again["claim"]["warm"] is False, again
        assert "of template revision 1" in again["claim"]["reason"], again


async def claim(
    api: Api,
    name: str,
    template: str,
    revision: int | None = None,
    token: str = ADMIN,
    **more: Any,
) -> dict[str, Any]:
    named = {"name": template} | ({} if revision is None else {"revision": revision})
    async with api.client(token) as c:
        r = await c.post("/v1/sandboxes", json={"name": name, "template": named, **more},
                         params={"wait": 30})  # fmt: skip
    assert r.status_code == 201, r.text
    assert r.headers["location"] == f"/v1/sandboxes/{name}"
    return dict(r.json())


async def test_a_create_from_a_pooled_template_adopts_a_member_and_the_pool_refills(
    api: Api,
) -> None:
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        body = {"name": pool, "template": template, "size": 2}
        assert (await c.post("/v1/pools", json=body)).status_code == 201
        before = {r["key"] for r in await settled(api, pool, 2)}

        name, claim_id = unique("agent"), unique("claim")
        asked = {"overrides": {"labels": {"task": "t1"}}, "command_id": claim_id}
        warm = await claim(api, name, template, **asked)
        assert warm["claim"]["warm"] is True and warm["claim"]["pool"] == pool, warm
        assert warm["claim"]["member"] in before and warm["phase"] == "Ready"
        again = await claim(api, name, template, **asked)  # a retry: the same member, once
        assert again["claim"]["member"] == warm["claim"]["member"], again
        got = await c.get(f"/v1/sandboxes/{name}")
        assert got.status_code == 200, got.text
        assert got.json()["spec"]["labels"]["task"] == "t1"
        rows = await settled(api, pool, 2)  # refilled: the claimed member left the pool
        assert warm["claim"]["member"] not in {r["key"] for r in rows}

        serving = api.app.state.api
        api.app.state.api = dataclasses.replace(serving, exec_driver=None)
        try:  # an API that cannot exec cannot deliver a claim's env warm
            env = await claim(api, unique("agent"), template, overrides={"env": {"K": "v"}})
        finally:
            api.app.state.api = serving
        assert env["claim"]["warm"] is False and "this API cannot exec" in env["claim"]["reason"]
        assert env["status"] == "accepted" and env["command_type"] == "CreateSandbox"

        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1, "size": 0})
        assert r.status_code == 200, r.text
        await settled(api, pool, 0)
        empty = await claim(api, unique("agent"), template)
        assert empty["claim"]["warm"] is False and "no Ready member" in empty["claim"]["reason"]

        status = (await c.get(f"/v1/pools/{pool}")).json()["status"]
        claims = status["claims"]
        assert (claims["warm"]["count"], claims["cold"]["count"]) == (1, 2), claims
        assert abs(claims["hit_rate"] - 1 / 3) < 1e-9
        assert claims["warm"]["p50_seconds"] is not None and claims["warm"]["p50_seconds"] > 0
        assert status["claimed"] == 1

        assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200
        assert api.plane is not None and api.plane.pools is not None
        rounds = api.plane.pools.rounds
        await eventually(lambda: api.plane.pools.rounds if api.plane and api.plane.pools else 0,
                         lambda n: n >= rounds + 3, what="three controller rounds")  # fmt: skip
        kept = await c.get(f"/v1/sandboxes/{name}")  # the claimed sandbox outlives its pool
        assert kept.status_code == 200 and kept.json()["phase"] == "Ready", kept.text
        metrics = await c.get("/metrics")
        assert f'sandstream_pool_claims_total{{path="warm",pool="{pool}"}} 1.0' in metrics.text


async def test_with_a_default_time_to_live_a_claim_is_warm_and_expires_from_its_adoption() -> None:
    """SANDSTREAM_DEFAULT_TTL_SECONDS applies to a claim as to any create: at the adoption,
    counted from it (a claim with a TTL went cold before, so under a default none was warm)."""
    update = {"pool_poll_seconds": 0.5, "default_ttl_seconds": 3600}
    async with apikit.running_api(FakeDriver(), with_scheduler=True,
                                  settings_update=update) as api:  # fmt: skip
        template, pool = unique("tpl"), unique("pool")
        await make_template(api, template)
        async with api.client() as c:
            body = {"name": pool, "template": template, "size": 1}
            assert (await c.post("/v1/pools", json=body)).status_code == 201
            await settled(api, pool, 1)
            before = datetime.now(UTC)
            warm = await claim(api, unique("agent"), template)
            assert warm["claim"]["warm"] is True, warm
            expires = await api.env.fetchval(
                "SELECT expires_at FROM sandboxes WHERE key = $1", warm["claim"]["member"]
            )
            assert expires is not None
            assert (
                before + timedelta(seconds=3600)
                <= expires
                <= datetime.now(UTC) + timedelta(seconds=3600)
            )
            assert (await c.delete(f"/v1/pools/{pool}")).status_code == 200


async def test_a_create_from_a_template_without_a_pool_says_nothing_of_claims(api: Api) -> None:
    template = unique("tpl")
    await make_template(api, template)
    made = await claim(api, unique("agent"), template)
    assert "claim" not in made and made["command_type"] == "CreateSandbox", made


async def test_a_pool_whose_members_keep_failing_refills_after_a_doubling_pause() -> None:
    """A bad image must not turn the pool into a create-delete loop on the log: each round of
    failures pauses the refill (1 s, then 2 s, ...), and the status says why."""
    driver = FakeDriver()
    driver.fail("launch", None, "podman: image not known", retryable=False, times=None)
    async with apikit.running_api(
        driver, with_scheduler=True, settings_update={"pool_poll_seconds": 0.2}
    ) as api:
        template, pool = unique("tpl"), unique("pool")
        await make_template(api, template)
        async with api.client() as c:
            body = {"name": pool, "template": template, "size": 2}
            assert (await c.post("/v1/pools", json=body)).status_code == 201
            assert api.plane is not None and api.plane.pools is not None
            controller = api.plane.pools
            loop = asyncio.get_running_loop()

            def streak() -> int:
                return controller._failing.get(pool, (0, 0.0))[0]

            await eventually(streak, lambda n: n >= 1, timeout=30, what="a first failure")
            first = loop.time()
            await eventually(streak, lambda n: n >= 3, timeout=30, what="a third failure")
            assert loop.time() - first >= 1 + 2 - 0.1  # the two pauses in between
            ever = await api.env.fetchval("SELECT count(*) FROM sandboxes WHERE pool = $1", pool)
            assert ever <= 2 * 4, ever  # at most one pool's worth per round of failures
            status = (await c.get(f"/v1/pools/{pool}")).json()["status"]
            assert "members keep failing" in status["problem"], status
            assert "image not known" in status["problem"], status


async def test_a_held_member_is_replaced_and_an_operators_stop_is_no_failure(api: Api) -> None:
    """A review found both. A held member counted as serving, though no claim takes it: the
    pool quietly served one fewer. A member an operator stopped (or suspended) counted as a
    failure: the pool paused its creates and said its members keep failing."""
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        body = {"name": pool, "template": template, "size": 1}
        assert (await c.post("/v1/pools", json=body)).status_code == 201
        [held] = await settled(api, pool, 1)
        r = await c.post(f"/v1/sandboxes/{held['key']}:hold", params={"wait": 30},
                         json={"reason": "looking at it"})  # fmt: skip
        assert r.status_code == 200, r.text
        rows = await eventually(
            lambda: members(api, pool),
            lambda rows: ready(rows) == 2,
            timeout=30,
            what="a Ready member made in the held one's place",
        )
        status = (await c.get(f"/v1/pools/{pool}")).json()["status"]
        assert (status["ready"], status["held"]) == (1, 1), status
        [other] = [m for m in rows if m["key"] != held["key"]]
        made = await claim(api, unique("agent"), template)
        assert (made["claim"]["warm"], made["claim"]["member"]) == (True, other["key"]), made
        await eventually(
            lambda: members(api, pool),
            lambda rows: ready(rows) == 2,
            timeout=30,
            what="the claimed member replaced",
        )
        stopped = next(m for m in await members(api, pool) if m["key"] != held["key"])
        r = await c.post(f"/v1/sandboxes/{stopped['key']}:stop", params={"wait": 30})
        assert r.status_code == 200, r.text
        await eventually(
            lambda: members(api, pool),
            lambda rows: stopped["key"] not in {m["key"] for m in rows} and ready(rows) == 2,
            timeout=30,
            what="the stopped member deleted and replaced",
        )
        assert api.plane is not None and api.plane.pools is not None
        assert pool not in api.plane.pools._failing
        status = (await c.get(f"/v1/pools/{pool}")).json()["status"]
        assert status["problem"] is None, status
        r = await c.post(f"/v1/sandboxes/{held['key']}:release", params={"wait": 30})
        assert r.status_code == 200, r.text
        await settled(api, pool, 1)  # released: an extra, deleted


async def test_the_pool_commands_create_show_scale_and_delete(api: Api) -> None:
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)

    def said(result: Result) -> str:  # what it printed, and the error main() would print
        return result.output + (str(result.exception) if result.exception else "")

    async def cli(*args: str) -> Result:
        argv = ["--url", api.url, "--token", ADMIN, *args]
        return await asyncio.to_thread(CliRunner().invoke, app, argv)

    made = await cli("pool", "create", pool, "--template", template, "--size", "1")
    assert made.exit_code == 0, made.output
    assert f"pool {pool} (revision 1): template {template}" in made.output
    await settled(api, pool, 1)
    scaled = await cli("pool", "scale", pool, "2")
    assert scaled.exit_code == 0 and "size 2" in scaled.output, scaled.output
    await settled(api, pool, 2)
    stale = await cli("pool", "scale", pool, "3", "--revision", "1")
    assert stale.exit_code == 1 and "revision 2, not 1" in said(stale), said(stale)
    name = unique("agent")
    claimed = await cli("sandbox", "create", name, "--template", template)
    assert claimed.exit_code == 0, claimed.output
    assert f"warm (pool {pool}): adopted" in claimed.output, claimed.output
    shown = await cli("pool", "get", pool)
    members = next(line for line in shown.output.splitlines() if line.startswith("members: "))
    # the refill's new member may still be Provisioning beside the Ready one
    assert "Ready " in members and "hit rate 100%" in shown.output, shown.output
    listed = await cli("pool", "list", "-o", "json")
    assert pool in [p["name"] for p in json.loads(listed.output)], listed.output
    deleted = await cli("pool", "delete", pool)
    assert deleted.exit_code == 0 and "deleted" in deleted.output, deleted.output
    missing = await cli("pool", "get", pool)
    assert missing.exit_code == 1 and "not found" in said(missing), said(missing)


async def test_a_delete_read_before_a_claim_adopted_the_member_is_refused(api: Api) -> None:
    """The race the row version closes: the controller reads a member, a claim adopts it, then
    the controller's delete of what it read (a scale-down) arrives. It must be refused, never
    delete the claimant's sandbox."""
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        body = {"name": pool, "template": template, "size": 1}
        assert (await c.post("/v1/pools", json=body)).status_code == 201
        await settled(api, pool, 1)
        async with api.env.pool.acquire() as conn:
            [read] = await pools_store.members(conn, [pool])
        name = unique("agent")
        warm = await claim(api, name, template)
        assert warm["claim"]["member"] == read.key, warm
        assert api.plane is not None and api.plane.pools is not None
        await api.plane.pools._delete((read,))  # what the controller read before the claim
        command_id = delete_command(read, datetime.now(UTC)).command_id
        outcome = await eventually(
            lambda: c.get(f"/v1/commands/{command_id}"),
            lambda r: r.status_code == 200 and r.json()["status"] != "pending",
            what="the stale delete decided",
        )
        assert (outcome.json()["status"], outcome.json()["code"]) == ("rejected", "ABORTED")
        kept = await c.get(f"/v1/sandboxes/{name}")
        assert kept.status_code == 200 and kept.json()["phase"] == "Ready", kept.text


async def test_claim_figures_count_every_claim_and_keep_only_the_newest(api: Api) -> None:
    """A pool's claims are counted forever but kept (for the latency figures) only as the
    newest 1,000 or so per path: the table must not grow by a row per claim for good."""
    pool = unique("pool")
    async with api.env.pool.acquire() as conn:
        for i in range(1250):
            await pools_store.record_claim(conn, pool, f"id{i}", f"c{i}", True, "adopted", i / 1000)
        await pools_store.record_claim(conn, pool, "x", "cold", False, "no Ready member", 2.0)
        again = await pools_store.record_claim(conn, pool, "x", "cold", False, "retried", 2.0)
        assert again is False  # a retried request's claim id is counted once
        stats = await pools_store.claim_stats(conn, pool)
        kept = await conn.fetchval(
            "SELECT count(*) FROM pool_claims WHERE pool = $1 AND warm", pool
        )
    assert (stats[True].count, stats[False].count) == (1250, 1)
    assert 1000 <= kept <= 1000 + pools_store.PRUNE_EVERY, kept
    assert stats[True].p50 is not None  # over the newest 1,000 (0.250 to 1.249 s) only
    assert abs(stats[True].p50 - 0.7495) < 1e-9, stats[True]
    assert stats[False].p50 == 2.0


async def test_a_claim_of_a_taken_name_is_refused_and_not_counted(api: Api) -> None:
    template, pool = unique("tpl"), unique("pool")
    await make_template(api, template)
    async with api.client() as c:
        body = {"name": pool, "template": template, "size": 1}
        assert (await c.post("/v1/pools", json=body)).status_code == 201
        await settled(api, pool, 1)
        name = unique("agent")
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=apikit.create_body(name))
        assert r.status_code == 201, r.text
        r = await c.post("/v1/sandboxes", params={"wait": 30},
                         json={"name": name, "template": {"name": template}})  # fmt: skip
        assert (r.status_code, r.json()["code"]) == (409, "ALREADY_EXISTS"), r.text
        assert len(await members(api, pool)) == 1  # no member spent on it
        claims = (await c.get(f"/v1/pools/{pool}")).json()["status"]["claims"]
        assert (claims["warm"]["count"], claims["cold"]["count"]) == (0, 0), claims


async def test_a_roll_to_a_revision_that_fails_keeps_the_old_members_serving() -> None:
    """Recreate onto a template whose members cannot start: the old Ready members keep serving
    (nothing old goes before something new is Ready), and the refill's pause keeps doubling
    although old members are Ready (only a member of the new revision Ready ends it)."""
    driver = FakeDriver()
    async with apikit.running_api(
        driver, with_scheduler=True, settings_update={"pool_poll_seconds": 0.2}
    ) as api:
        template, pool = unique("tpl"), unique("pool")
        await make_template(api, template)
        async with api.client() as c:
            body = {"name": pool, "template": template, "size": 2}
            assert (await c.post("/v1/pools", json=body)).status_code == 201
            old = {r["key"] for r in await settled(api, pool, 2)}
            driver.fail("launch", None, "podman: image not known", retryable=False, times=None)
            newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "expected_revision": 1}
            assert (await c.put(f"/v1/templates/{template}", json=newer)).status_code == 200
            assert api.plane is not None and api.plane.pools is not None
            controller = api.plane.pools
            loop = asyncio.get_running_loop()

            def streak() -> int:
                return controller._failing.get(pool, (0, 0.0))[0]

            await eventually(streak, lambda n: n >= 1, timeout=30, what="a first failure")
            first = loop.time()
            await eventually(streak, lambda n: n >= 3, timeout=30, what="a third failure")
            assert loop.time() - first >= 1 + 2 - 0.1
            rows = await members(api, pool)
            assert {r["key"] for r in rows if r["phase"] == "Ready"} == old
