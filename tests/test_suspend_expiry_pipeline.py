"""A time to live that ends while a suspend is under way, through the real pipeline (Kafka,
PostgreSQL, the scheduler, the processor, the executor, the API; the fake driver, whose
suspend the tests hold). The rules are in tests/test_suspend_expiry_races.py.

- The suspend then fails with the runtime still running: the stop the expiry owes follows
  (Stopping, then Stopped). It was Ready, without a time to live: it ran on for ever.
- An exec that found the sandbox Suspending before the expiry waits the suspend out, then is
  refused (409) and resumes nothing. It woke the sandbox, which then ran without a time to live.
"""

from __future__ import annotations

import asyncio
from typing import Any

import apikit
import pytest
from apikit import Api, create_body, unique
from harness import eventually
from pipeline_support import history

from drivers.fake import FakeDriver
from services.api import wake

SCALED = {"scheduler_poll_seconds": 0.5}


async def row(api: Api, name: str) -> dict[str, Any]:
    async with api.client() as c:
        r = await c.get(f"/v1/sandboxes/{name}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def suspending_then_expired(api: Api, driver: FakeDriver, name: str) -> Any:
    """``name`` Ready, then Suspending with its suspend held: the held suspend's handle
    (``expire`` then ends its time to live)."""
    suspends = driver.block("suspend", name)
    body = create_body(name)
    body["ttl_seconds"] = 3600
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
        await eventually(lambda: row(api, name), lambda v: v["phase"] == "Ready", what="Ready")
        r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
        assert r.status_code == 200, r.text
        await suspends.entered(timeout=60)
    return suspends


async def expire(api: Api, name: str) -> dict[str, Any]:
    async with api.client() as c:
        r = await c.post(
            f"/v1/sandboxes/{name}:extend", params={"wait": 30}, json={"ttl_seconds": 1}
        )
        assert r.status_code == 200, r.text
    return dict(
        await eventually(
            lambda: row(api, name),
            lambda v: (v["reason"] or "").startswith("Expired"),
            what=f"{name} expired",
            timeout=30,
        )
    )


async def test_a_suspend_that_fails_with_the_runtime_running_after_an_expiry_stops_it() -> None:
    driver = FakeDriver()
    async with apikit.running_api(driver, settings_update=SCALED, with_scheduler=True) as api:
        name = unique("owedstop")
        suspends = await suspending_then_expired(api, driver, name)
        expired = await expire(api, name)
        assert (expired["phase"], expired["expires_at"]) == ("Suspending", None), expired
        driver.fail("suspend", name, "busy", retryable=False, observed="running")
        suspends.release()
        settled = await eventually(
            lambda: row(api, name), lambda v: v["phase"] != "Suspending", what="suspend ended"
        )
        assert settled["phase"] in ("Stopping", "Stopped"), settled
        stopped = await eventually(
            lambda: row(api, name), lambda v: v["phase"] == "Stopped", what="Stopped", timeout=60
        )
        assert (stopped["generation"], stopped["expires_at"]) == (1, None), stopped
        assert [c.op for c in driver.calls_for("stop", name)], driver.calls_for(key=name)


async def test_an_exec_that_waited_out_a_suspend_in_which_the_sandbox_expired_wakes_nothing() -> (
    None
):
    driver = FakeDriver()
    async with apikit.running_api(driver, settings_update=SCALED, with_scheduler=True) as api:
        name = unique("wakeexp")
        suspends = await suspending_then_expired(api, driver, name)
        waiting = asyncio.Event()
        wait_out = wake._suspended

        async def seen_waiting(*args: Any) -> Any:
            waiting.set()  # the call read the row Suspending, not expired, and waits
            return await wait_out(*args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(wake, "_suspended", seen_waiting)
            async with api.client() as c:
                call = asyncio.ensure_future(
                    c.post(f"/v1/sandboxes/{name}/exec", json={"command": ["true"]})
                )
                async with asyncio.timeout(30):
                    await waiting.wait()
                await expire(api, name)
                assert not call.done()
                suspends.release()
                r = await call
        assert r.status_code == 409, r.text
        assert "time to live has ended" in r.json()["message"], r.text
        after = await row(api, name)
        assert (after["phase"], after["generation"], after["expires_at"]) == ("Suspended", 1, None)
        assert after["reason"].startswith("Expired"), after
        entries = await history(api.env, name)
        assert "ResumeSandbox" not in [h["message_type"] for h in entries]
