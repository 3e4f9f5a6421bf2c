"""`sandstream sandbox files ...` on a suspended sandbox whose wake takes longer than the CLI's
own request timeout (30 s): the CLI waits the wake bound on top (SANDSTREAM_WAKE_TIMEOUT_SECONDS,
60 s by default). Before, it gave up at 30 s and said it could not reach the API ("is
`sandstream up` running?"). At the real scale: the wake is held 35 s (the resumed
generation's launch held in the fake driver), the CLI in-process through typer's runner."""

from __future__ import annotations

import asyncio

import apikit
from apikit import unique
from typer.testing import CliRunner

from drivers.fake import FakeDriver
from services.cli.client import REQUEST_SECONDS
from services.cli.main import app

HELD = REQUEST_SECONDS + 5  # the wake: longer than one request may take


async def test_a_files_command_waits_out_a_wake_longer_than_its_request_timeout() -> None:
    driver = FakeDriver()
    async with apikit.running_api(driver) as api, api.client() as c:
        name = unique("cliwake")
        await apikit.suspended(c, name)
        argv = ["--url", api.url, "--token", apikit.ADMIN, "sandbox", "files", "stat", name, "f"]
        stat = asyncio.to_thread(CliRunner().invoke, app, argv)
        result = await apikit.during_a_held_wake(driver, name, stat, HELD)
        said = result.output + (str(result.exception) if result.exception else "")
        assert "cannot reach the API" not in said, said
        # Past the wake, at the runtime (the fake driver's sandboxes have none for the API's
        # files door).
        assert result.exit_code == 1 and "runtime is not running" in said, said
