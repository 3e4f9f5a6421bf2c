"""The SDK and the CLI where a suspend meets another call (a review found each):

- ``resume()`` (so ``connect()``) on a Suspending sandbox waited for Suspended only: a suspend
  that failed with the runtime running (Ready again) made it wait out its whole bound and
  raise TimeoutError; now it returns once Ready, sending no resume.
- ``stop()`` on a Suspended sandbox waited for Stopped, which never comes (the server answers
  "nothing to do"): TimeoutError; the CLI's ``sandbox stop`` failed with exit 1.
- ``connect()`` brought back a sandbox whose time to live ended while it was suspended (an
  ordinary resume is allowed), which then ran with no time to live: refused now, as the
  server's wake on access refuses it.
- A 504 ``DEADLINE_EXCEEDED`` (a wake longer than the server's bound) was a bare
  SandstreamError, not the TimeoutError the README promises.
"""

from __future__ import annotations

import asyncio
import sys

import apikit
import pytest
from apikit import ADMIN, unique
from harness import eventually
from typer.testing import CliRunner

from drivers.fake import FakeDriver
from services.cli.main import app
from services.common.settings import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "sdk" / "python"))  # the SDK as a user has it

from sandstream_sdk import AsyncSandbox
from sandstream_sdk.errors import NotReadyError, TimeoutError, error_of

WAIT = 10.0  # the SDK's wait bound here: the old code raised TimeoutError after it


async def test_resume_of_a_suspend_that_fails_with_the_runtime_running_returns_ready() -> None:
    driver = FakeDriver()
    async with apikit.running_api(driver) as api, api.client() as c:
        name = unique("sdkfailsusp")
        r = await c.post("/v1/sandboxes", json=apikit.create_body(name), params={"wait": 30})
        assert r.status_code == 201, r.text
        await apikit.phase_is(api, name, "Ready", 1)
        held = driver.block("suspend", name)
        driver.fail("suspend", name, "the runtime would not stop", False, observed="running")
        r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
        assert r.status_code == 200, r.text
        sb = await AsyncSandbox.connect(name, auto_resume=False, api_url=api.url, token=ADMIN,
                                        wait_timeout=WAIT)  # fmt: skip
        try:
            assert sb.info.phase == "Suspending"
            resuming = asyncio.ensure_future(sb.resume())
            await held.entered(timeout=30)
            done, _ = await asyncio.wait({resuming}, timeout=1.0)  # Suspending meanwhile
            assert not done, resuming
            held.release()
            await resuming  # old code: TimeoutError "is Ready, not Suspended"
            assert (sb.info.phase, sb.info.generation) == ("Ready", 1)  # no resume was sent
        finally:
            await sb.close()


async def test_stop_of_a_suspended_sandbox_returns_and_the_cli_says_so() -> None:
    async with apikit.running_api(FakeDriver()) as api, api.client() as c:
        name = unique("sdkstopsusp")
        await apikit.suspended(c, name)
        sb = await AsyncSandbox.connect(name, auto_resume=False, api_url=api.url, token=ADMIN,
                                        wait_timeout=WAIT)  # fmt: skip
        try:
            await sb.stop()  # old code: TimeoutError "is Suspended, not Stopped"
            assert sb.info.phase == "Suspended"
        finally:
            await sb.close()
        argv = ["--url", api.url, "--token", ADMIN, "sandbox", "stop", name]
        result = await asyncio.to_thread(CliRunner().invoke, app, argv)
        assert result.exit_code == 0, result.output  # old code: 1, "✗ sandbox … is Suspended"


async def test_connect_does_not_bring_back_a_sandbox_whose_time_to_live_ended() -> None:
    async with (
        apikit.running_api(FakeDriver(), with_scheduler=True) as api,
        api.client() as c,
    ):
        name = unique("sdkexpired")
        await apikit.suspended(c, name)
        r = await c.post(f"/v1/sandboxes/{name}:extend", json={"ttl_seconds": 1},
                         params={"wait": 30})  # fmt: skip
        assert r.status_code == 200, r.text
        await eventually(
            lambda: apikit.row(api, name),
            lambda v: (v["reason"] or "").startswith("Expired:"),
            what=f"{name}'s time to live ended while suspended",
            timeout=30,
        )
        with pytest.raises(NotReadyError, match="time to live ended"):
            await AsyncSandbox.connect(name, api_url=api.url, token=ADMIN, wait_timeout=WAIT)
        row = await apikit.row(api, name)
        assert (row["phase"], row["generation"]) == ("Suspended", 1)  # not resumed


def test_a_wake_past_the_servers_bound_is_a_timeout_error() -> None:
    body = {"code": "DEADLINE_EXCEEDED", "message": "sandbox x: not Ready within 60s"}
    assert isinstance(error_of(504, body, ""), TimeoutError)
    assert isinstance(error_of(504, None, "gateway timeout"), TimeoutError)
