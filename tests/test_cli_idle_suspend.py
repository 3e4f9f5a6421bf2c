"""The idle timeout from the command line: `sandbox create --idle-suspend` and `sandbox
idle-suspend NAME AFTER|off` set the spec's idle_suspend_seconds. In process, against the real
API and pipeline (fake driver)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import apikit
from apikit import unique
from typer.testing import CliRunner

from drivers.fake import FakeDriver
from services.cli.main import app as cli


async def test_create_and_idle_suspend_set_and_clear_the_timeout() -> None:
    async with apikit.running_api(FakeDriver()) as api:
        name = unique("idle")

        async def run(*args: str) -> Any:
            connect = ["--url", api.url, "--token", apikit.ADMIN, "sandbox"]
            return await asyncio.to_thread(CliRunner().invoke, cli, [*connect, *args])

        async def spec() -> dict[str, Any]:
            raw = await api.env.fetchval("SELECT spec FROM sandboxes WHERE key = $1", name)
            return dict(json.loads(raw))

        created = await run(
            "create", name, "--image", "img:1", "--idle-suspend", "15m", "--no-wait",
            "--", "sleep", "60",
        )  # fmt: skip
        assert created.exit_code == 0, created.output
        await api.wait_phase(name, "Ready")
        assert (await spec())["idle_suspend_seconds"] == 900

        changed = await run("idle-suspend", name, "2h")
        assert changed.exit_code == 0, changed.output
        assert f"Sandbox {name} is suspended after 2h unused" in changed.output
        assert (await spec())["idle_suspend_seconds"] == 7200
        shown = await run("get", name)
        assert shown.exit_code == 0 and "suspended after 7200s unused" in shown.output, shown.output

        off = await run("idle-suspend", name, "off")
        assert off.exit_code == 0, off.output
        assert "idle_suspend_seconds" not in await spec()

        bad = await run("idle-suspend", name, "soon")
        assert bad.exit_code != 0 and "expected a positive duration" in bad.output
