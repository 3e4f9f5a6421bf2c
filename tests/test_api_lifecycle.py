"""The operator lifecycle over HTTP on the real stack (fake driver): ttl and policies on create,
hold / release / extend, the attention counts and their metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta

import apikit
import pytest_asyncio
from apikit import Api, create_body, unique
from harness import eventually

from drivers.fake import FakeDriver


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    # A server default ttl of a day; the scheduler is off here (nothing falls due in a test).
    update = {"default_ttl_seconds": 86400, "expiring_soon_seconds": 3600}
    async with apikit.running_api(FakeDriver(), settings_update=update) as running:
        yield running


async def get(api: Api, name: str) -> dict[str, object]:
    async with api.client() as c:
        r = await c.get(f"/v1/sandboxes/{name}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_create_takes_ttl_and_policies_and_get_shows_them(api: Api) -> None:
    name = unique("ttl")
    async with api.client() as c:
        body = {**create_body(name), "ttl_seconds": 600, "on_expiry": "delete", "on_exit": "delete"}
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
    row = await get(api, name)
    assert (row["on_expiry"], row["on_exit"], row["hold"]) == ("delete", "delete", None)
    created = datetime.fromisoformat(str(row["created_at"]))
    expires = datetime.fromisoformat(str(row["expires_at"]))
    assert expires - created == timedelta(seconds=600)
    deadline = row["deadline"]
    assert deadline is None or deadline["kind"] == "launch"  # type: ignore[index]


async def test_without_a_ttl_the_server_default_applies(api: Api) -> None:
    name = unique("dflt")
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
        assert r.status_code == 201, r.text
    row = await get(api, name)
    created = datetime.fromisoformat(str(row["created_at"]))
    expires = datetime.fromisoformat(str(row["expires_at"]))
    assert expires - created == timedelta(days=1)
    assert (row["on_expiry"], row["on_exit"]) == ("stop", "keep")


async def test_extend_sets_the_expiry_from_now(api: Api) -> None:
    name = unique("ext")
    async with api.client() as c:
        await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
        r = await c.post(f"/v1/sandboxes/{name}:extend", params={"wait": 30},
                         json={"ttl_seconds": 7200})  # fmt: skip
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
    row = await get(api, name)
    assert datetime.fromisoformat(str(row["expires_at"])) > datetime.fromisoformat(
        str(row["created_at"])
    ) + timedelta(seconds=7000)


async def test_restart_policy_at_create_and_changed_with_expected_version(api: Api) -> None:
    name = unique("rpol")
    async with api.client() as c:
        body = create_body(name)
        body["spec"] |= {"restart_policy": "OnFailure", "max_restarts": 2,
                         "restart_backoff": {"initial_seconds": 1, "max_seconds": 60}}  # fmt: skip
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
        row = await eventually(lambda: get(api, name), lambda v: v["phase"] == "Ready",
                               timeout=30, what="Ready")  # fmt: skip
        spec = row["spec"]
        assert spec["restart_policy"] == "OnFailure" and spec["max_restarts"] == 2  # type: ignore[index]
        assert (row["restart_count"], row["next_restart_at"], row["last_exit"]) == (0, None, None)
        stale = {"restart_policy": "Always", "expected_version": int(str(row["version"])) + 5}
        r = await c.post(f"/v1/sandboxes/{name}:restart-policy", params={"wait": 30}, json=stale)
        assert r.status_code == 409, r.text
        fresh = {"restart_policy": "Always", "expected_version": row["version"]}
        r = await c.post(f"/v1/sandboxes/{name}:restart-policy", params={"wait": 30}, json=fresh)
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
        r = await c.post(
            f"/v1/sandboxes/{name}:restart-policy", json={"restart_policy": "Sometimes"}
        )
        assert r.status_code == 422 and "restart_policy" in r.text
    assert (await get(api, name))["spec"]["restart_policy"] == "Always"  # type: ignore[index]


async def test_hold_refuses_start_and_restart_with_who_and_why_until_released(api: Api) -> None:
    name = unique("hold")
    async with api.client() as c:
        await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
        await api.wait_phase(name, "Ready")
        r = await c.post(f"/v1/sandboxes/{name}:hold", params={"wait": 30},
                         json={"reason": "forensics, ticket 12"})  # fmt: skip
        assert r.status_code == 200, r.text
        hold = (await get(api, name))["hold"]
        assert hold["by"] == "admin" and hold["reason"] == "forensics, ticket 12"  # type: ignore[index]

        refused = await c.post(f"/v1/sandboxes/{name}:restart", params={"wait": 30})
        assert refused.status_code == 412, refused.text
        message = refused.json()["message"]
        assert "held by admin" in message and "forensics, ticket 12" in message

        assert (await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30})).status_code == 200
        await api.wait_phase(name, "Stopped")
        assert (await c.post(f"/v1/sandboxes/{name}:start", params={"wait": 30})).status_code == 412

        again = await c.post(f"/v1/sandboxes/{name}:hold", params={"wait": 30},
                             json={"reason": "another"})  # fmt: skip
        assert again.status_code == 200 and again.json()["message"].startswith("nothing to do")

        r = await c.post(f"/v1/sandboxes/{name}:release", params={"wait": 30})
        assert r.status_code == 200, r.text
        assert (await get(api, name))["hold"] is None
        assert (await c.post(f"/v1/sandboxes/{name}:start", params={"wait": 30})).status_code == 200
        await api.wait_phase(name, "Ready")


async def test_bad_lifecycle_requests_are_422_naming_the_field(api: Api) -> None:
    name = unique("bad")
    async with api.client() as c:
        for body, field in (
            ({**create_body(name), "ttl_seconds": 0}, "ttl_seconds"),
            ({**create_body(name), "on_exit": "sometimes"}, "on_exit"),
            ({**create_body(name), "on_expiry": "explode"}, "on_expiry"),
        ):
            r = await c.post("/v1/sandboxes", json=body)
            assert r.status_code == 422, r.text
            assert field in r.json()["message"], r.json()
        r = await c.post(f"/v1/sandboxes/{name}:hold", json={})
        assert r.status_code == 422 and "reason" in r.json()["message"]
        r = await c.post(f"/v1/sandboxes/{name}:extend", json={"ttl_seconds": "1h"})
        assert r.status_code == 422 and "ttl_seconds" in r.json()["message"]
    assert await api.env.fetchval("SELECT count(*) FROM sandboxes WHERE key = $1", name) == 0


async def test_attention_counts_held_and_expiring_soon_and_metrics_show_them(api: Api) -> None:
    async with api.client() as c:
        before = (await c.get("/v1/attention")).json()
        soon, held = unique("soon"), unique("held")
        await c.post("/v1/sandboxes", params={"wait": 30},
                     json={**create_body(soon), "ttl_seconds": 60})  # fmt: skip
        await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(held))
        await c.post(f"/v1/sandboxes/{held}:hold", params={"wait": 30}, json={"reason": "r"})
        after = (await c.get("/v1/attention")).json()
        assert after["held"] == before["held"] + 1
        assert after["expiring_soon"] == before["expiring_soon"] + 1
        assert after["expiring_within_seconds"] == 3600
        metrics = await eventually(
            lambda: c.get("/metrics"),
            lambda r: f'sandstream_sandboxes_attention{{state="held"}} {after["held"]}.0' in r.text,
            what="the held gauge",
        )
    assert 'sandstream_sandboxes_attention{state="expiring_soon"}' in metrics.text
    assert 'sandstream_sandboxes_attention{state="past_deadline"}' in metrics.text
