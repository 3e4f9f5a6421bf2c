"""A CLI command whose answer is lost (a timeout after the API applied it) is sent again by
the CLI itself, unchanged; it never mints a second generation. In process, against the real
API and pipeline (fake driver): the lost answer is the only thing simulated."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import apikit
import httpx
from apikit import create_body, unique
from typer.testing import CliRunner

from drivers.fake import FakeDriver
from services.cli.client import Client, Connection
from services.cli.main import app as cli
from services.cli.sandbox import _command_body, _submit


class LosesTheFirstAnswer(Client):
    """The first request of ``method`` is delivered and applied, but its answer never
    arrives."""

    method = "POST"
    lost = 0

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = super().request(method, path, **kwargs)
        if method == self.method and not self.lost:
            self.lost += 1
            raise httpx.ReadTimeout("the answer was lost")
        return response


async def test_a_restart_whose_answer_is_lost_is_retried_without_a_second_generation() -> None:
    async with apikit.running_api(FakeDriver()) as api:
        name = unique("retry")
        async with api.client() as c:
            created = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
            assert created.status_code == 201, created.text
            await api.wait_phase(name, "Ready")
            version = (await c.get(f"/v1/sandboxes/{name}")).json()["version"]

        client = LosesTheFirstAnswer(api.env.settings, Connection(api.url, apikit.ADMIN, None))
        body = _command_body(None, version)  # what `sandstream sandbox restart` sends
        outcome = await asyncio.to_thread(
            _submit, client, "POST", f"/v1/sandboxes/{name}:restart", body, name,
            time.monotonic() + 60,
        )  # fmt: skip
        assert client.lost == 1  # the first answer was lost, the retry got the outcome
        assert (outcome["status"], outcome["generation"]) == ("accepted", 2)
        await api.wait_phase(name, "Ready")

        # Run again from scratch with the version read before (a new command id): ABORTED.
        async with api.client() as c:
            again = await c.post(
                f"/v1/sandboxes/{name}:restart",
                params={"wait": 30},
                json={"expected_version": version},
            )
            assert again.status_code == 409 and again.json()["code"] == "ABORTED", again.text
            row = (await c.get(f"/v1/sandboxes/{name}")).json()
            history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
        assert row["generation"] == 2
        restarts = [h for h in history if h["message_type"] == "RestartSandbox"]
        assert [h["disposition"] for h in restarts] == ["applied", "rejected"]
        assert restarts[0]["command_id"] == body["command_id"]
        assert restarts[0]["command_id"].startswith("cli-")


async def test_sandbox_restart_sends_the_version_it_read_as_expected_version() -> None:
    """`sandstream sandbox restart NAME` (in process, against the real API): the command
    carries the version the CLI read first, and a CLI-chosen command id."""
    async with apikit.running_api(FakeDriver()) as api:
        name = unique("restart")
        async with api.client() as c:
            created = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
            assert created.status_code == 201, created.text
        await api.wait_phase(name, "Ready")
        version = await api.env.fetchval("SELECT version FROM sandboxes WHERE key = $1", name)

        args = ["--url", api.url, "--token", apikit.ADMIN, "sandbox", "restart", name]
        result = await asyncio.to_thread(CliRunner().invoke, cli, [*args, "--no-wait"])
        assert result.exit_code == 0, result.output
        sent = await api.env.fetch(
            "SELECT message FROM history WHERE key = $1 AND message_type = 'RestartSandbox'", name
        )
        [message] = [json.loads(r["message"]) for r in sent]
        assert message["expected_version"] == version
        assert message["command_id"].startswith("cli-")
