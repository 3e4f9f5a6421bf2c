"""The restart policy from the command line: `sandbox create --restart-policy --restart-backoff
--max-restarts` and `sandbox restart-policy` take the same options and send the same fields. In
process, against the real API and pipeline (fake driver)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import apikit
from apikit import unique
from typer.testing import CliRunner

from drivers.fake import FakeDriver
from services.cli.main import app as cli


def words(output: str) -> str:
    """The text of a usage error, without the box rich draws around it and its line breaks."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())


async def test_create_and_restart_policy_set_the_same_spec_fields() -> None:
    async with apikit.running_api(FakeDriver()) as api:
        name = unique("rp")

        async def run(*args: str) -> Any:
            connect = ["--url", api.url, "--token", apikit.ADMIN, "sandbox"]
            return await asyncio.to_thread(CliRunner().invoke, cli, [*connect, *args])

        async def spec() -> dict[str, Any]:
            raw = await api.env.fetchval("SELECT spec FROM sandboxes WHERE key = $1", name)
            return dict(json.loads(raw))

        created = await run(
            "create", name, "--image", "img:1", "--restart-policy", "OnFailure",
            "--restart-backoff", "500ms:30s", "--max-restarts", "2", "--no-wait",
            "--", "sleep", "60",
        )  # fmt: skip
        assert created.exit_code == 0, created.output
        await api.wait_phase(name, "Ready")
        got = await spec()
        assert (got["restart_policy"], got["max_restarts"]) == ("OnFailure", 2)
        assert got["restart_backoff"] == {"initial_seconds": 0.5, "max_seconds": 30.0}

        changed = await run("restart-policy", name, "Always", "--restart-backoff", "2s")
        assert changed.exit_code == 0, changed.output
        assert f"Sandbox {name} restarts: Always" in changed.output
        got = await spec()
        assert (got["restart_policy"], got.get("max_restarts")) == ("Always", None)
        assert got["restart_backoff"] == {"initial_seconds": 2.0, "max_seconds": 300.0}

        # Bad input is refused by the CLI, naming the option, before anything is sent.
        for args, error in [
            (["--restart-backoff", "5s:1s"], "the cap must not be below the first delay"),
            (["--restart-backoff", "soon"], "expected a delay like 500ms"),
            (["--restart-backoff", "1ms"], "a delay must be from 10ms to 24h"),
            (["--max-restarts", "-1"], "--max-restarts"),
        ]:
            refused = await run("restart-policy", name, "OnFailure", *args)
            assert refused.exit_code == 2 and error in words(refused.output), (args, refused.output)
        refused = await run("create", unique("rp"), "--image", "i", "--restart-policy", "Sometimes")
        assert refused.exit_code == 2 and "--restart-policy" in words(refused.output)
        assert (await spec())["restart_policy"] == "Always"
