"""The API forgets command ids after SANDSTREAM_API_COMMAND_RETENTION_HOURS (30 days), on real
PostgreSQL and Kafka with the fake driver.

At the real retention: an id recorded 31 days ago is forgotten by the sweep, one of 29 days is
kept. A retry of a forgotten create is published again and the processor's own de-duplication
(command_outcomes, per sandbox and id, never forgotten) answers it with the first outcome:
nothing is decided twice. A different request under a forgotten id is no longer refused: on
the same sandbox the processor answers it with the first outcome too and does nothing. The
sweep every API process runs is the same code with a retention scaled to a second.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import apikit
import httpx
import pytest
from apikit import create_body, unique
from harness import eventually, isolated_env
from pydantic import SecretStr

from drivers.fake import FakeDriver
from services.api import idempotency
from services.common.tokens import ensure_tokens


async def age(api: apikit.Api, command_id: str, days: int) -> None:
    """Make ``command_id``'s record as old as ``days`` (the real retention is in days)."""
    await api.env.fetchval(
        "UPDATE api_commands SET recorded_at = now() - make_interval(days => $2) "
        "WHERE command_id = $1",
        command_id,
        days,
    )


async def test_ids_older_than_the_retention_are_forgotten_and_a_retry_decides_nothing_twice() -> (
    None
):
    driver = FakeDriver()
    name, kept = unique("forgot"), unique("kept")
    async with apikit.running_api(driver) as api, api.client() as c:
        retention = api.env.settings.api_command_retention_hours
        assert retention == 30 * 24
        first = await c.post("/v1/sandboxes", params={"wait": 30},
                             json={**create_body(name), "command_id": "c-old"})  # fmt: skip
        assert first.status_code == 201, first.text
        other = await c.post("/v1/sandboxes", params={"wait": 30},
                             json={**create_body(kept), "command_id": "c-new"})  # fmt: skip
        assert other.status_code == 201, other.text
        await age(api, "c-old", 31)
        await age(api, "c-new", 29)
        assert await idempotency.forget_expired(api.env.pool, retention) == 1
        assert await idempotency.recorded(api.env.pool, "c-old") is None
        assert await idempotency.recorded(api.env.pool, "c-new") is not None
        status = await c.get("/v1/commands/c-old")  # the processor's outcome still answers
        assert (status.status_code, status.json()["status"]) == (200, "accepted")

        async def forgotten_then(path: str, body: dict[str, object]) -> httpx.Response:
            await age(api, "c-old", 31)  # a request records the id anew: forget it again
            await idempotency.forget_expired(api.env.pool, retention)
            assert await idempotency.recorded(api.env.pool, "c-old") is None
            return await c.post(path, params={"wait": 30}, json={**body, "command_id": "c-old"})

        # The same request: answered from the processor's outcome, nothing published.
        again = await forgotten_then("/v1/sandboxes", create_body(name))
        assert (again.status_code, again.json()) == (first.status_code, first.json())
        # Another command type on the same sandbox: still a conflict (the outcome's type).
        stop = await forgotten_then(f"/v1/sandboxes/{name}:stop", {})
        assert stop.status_code == 409, stop.text
        # The same type with another body: the first outcome, and nothing done.
        changed = await forgotten_then("/v1/sandboxes", create_body(name, image="other:2"))
        assert (changed.status_code, changed.json()) == (first.status_code, first.json())
        row = (await c.get(f"/v1/sandboxes/{name}")).json()
        assert (row["phase"], row["generation"]) == ("Ready", 1)
        assert len(driver.calls_for("launch", name)) == 1
        history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
        assert [h["disposition"] for h in history if h["command_id"] == "c-old"] == ["applied"]
        # Another sandbox: no longer refused; the id is free for it.
        elsewhere = unique("elsewhere")
        new = await forgotten_then("/v1/sandboxes", create_body(elsewhere))
        assert new.status_code == 201, new.text
        await api.wait_phase(elsewhere, "Ready")


async def test_a_command_still_undecided_past_the_retention_is_published_again_once_decided() -> (
    None
):
    """Published but not decided (no processor runs: as when its partition is stopped) when
    its id is forgotten: a retry publishes it again, and once a processor runs the repeat is
    recorded as a duplicate; it is decided once."""
    async with apikit.running_api(None) as api, api.client() as c:
        retention = api.env.settings.api_command_retention_hours
        name = unique("undecided")
        body = {**create_body(name), "command_id": "c-late"}
        first = await c.post("/v1/sandboxes", json=body)
        assert first.status_code == 202, first.text
        await age(api, "c-late", 31)
        await idempotency.forget_expired(api.env.pool, retention)
        assert (await c.get("/v1/commands/c-late")).status_code == 404  # pending and forgotten
        again = await c.post("/v1/sandboxes", json=body)
        assert again.status_code == 202, again.text
        assert await api.commands_published() == 2
        await api.env.start_processor()
        history = await eventually(
            lambda: api.env.fetch(
                "SELECT disposition FROM history WHERE command_id = 'c-late' ORDER BY id"
            ),
            lambda rows: len(rows) == 2,
            what="both copies decided",
        )
        assert [r["disposition"] for r in history] == ["applied", "duplicate"]


async def test_a_provider_write_retried_after_the_retention_is_a_new_write() -> None:
    """A provider write has no processor record to fall back on: retried after its id was
    forgotten, it is judged as a write without an id. The same values again change nothing
    (no revision, no restart); a retried create of a provider that exists is refused."""
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    p = unique("late-p")
    async with (
        apikit.running_api(FakeDriver(), settings_update={"credentials_key": SecretStr(key)})
        as api,
        api.client() as c,
    ):  # fmt: skip
        retention = api.env.settings.api_command_retention_hours
        create = {"name": p, "credentials": {"K": "one"}, "command_id": "pc-" + p}
        assert (await c.post("/v1/providers", json=create)).status_code == 201
        put = {"credentials": {"K": "two"}, "command_id": "pu-" + p}
        path = f"/v1/providers/{p}/credentials"
        first = await c.put(path, json=put)
        assert [x["revision"] for x in first.json()["providers"]] == [2], first.text
        for command_id in (create["command_id"], put["command_id"]):
            await age(api, command_id, 31)
        assert await idempotency.forget_expired(api.env.pool, retention) == 2

        again = await c.put(path, json=put)
        assert again.status_code == 200, again.text
        assert [(x["revision"], x["rotated"]) for x in again.json()["providers"]] == [(2, [])]
        assert (await c.get(f"/v1/providers/{p}")).json()["revision"] == 2
        created = await c.post("/v1/providers", json=create)
        assert created.status_code == 409, created.text
        assert created.json()["code"] == "ALREADY_EXISTS"


async def test_every_api_process_sweeps_expired_ids() -> None:
    """The retention scaled to one second (the sweep then runs every quarter second): the
    record of a command disappears without a call, through the same ``forget_expired``."""
    async with (
        apikit.running_api(
            FakeDriver(), settings_update={"api_command_retention_hours": 1 / 3600}
        ) as api,
        api.client() as c,
    ):
        assert idempotency.sweep_seconds(1 / 3600) == 0.25
        assert idempotency.sweep_seconds(720) == idempotency.SWEEP_MAX_SECONDS
        body = {**create_body(unique("swept")), "command_id": "c-swept"}
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
        await eventually(
            lambda: idempotency.recorded(api.env.pool, "c-swept"),
            lambda found: found is None,
            timeout=15,
            what="the API's sweep to forget c-swept",
        )


class ForgottenBetween:
    """A connection on which the id is taken at the insert, then forgotten by the sweep before
    it is read (the race, set up exactly)."""

    def __init__(self) -> None:
        self.inserts = 0

    async def fetchval(self, query: str, *args: object) -> object:
        self.inserts += 1
        return None if self.inserts == 1 else True  # taken at first, free the second time

    async def fetchrow(self, query: str, *args: object) -> object:
        return None  # gone by the time it is read


async def test_a_claim_racing_the_sweep_claims_the_id_anew() -> None:
    conn = ForgottenBetween()
    assert await idempotency.claim(conn, "c-race", "k", "CreateSandbox", "admin", "f") is None
    assert conn.inserts == 2


def test_a_retention_of_almost_nothing_does_not_sweep_in_a_busy_loop() -> None:
    assert idempotency.sweep_seconds(1e-9) == idempotency.SWEEP_MIN_SECONDS


async def test_the_openshell_role_alone_forgets_expired_ids_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The OpenShell role run without the HTTP API records command ids as well: it sweeps them
    (at the real retention: a record of 31 days is forgotten at its start)."""
    from services.openshell import server

    async def started(settings: Any, **parts: Any) -> Any:  # stands in for the gRPC server
        async def no_server() -> None:
            return None

        return SimpleNamespace(address="-", stop=no_server)

    monkeypatch.setattr(server, "start_openshell", started)
    async with isolated_env(partitions=1, run_dir=tmp_path) as env:
        ensure_tokens(env.settings)
        await env.fetchval(
            "INSERT INTO api_commands (command_id, key, command_type, actor, fingerprint, "
            "recorded_at) VALUES ('c-grpc', 'k', 'CreateSandbox', 'admin', 'f', "
            "now() - interval '31 days')"
        )
        stop = asyncio.Event()
        role = asyncio.create_task(server.serve(env.settings, stop))
        try:
            await eventually(
                lambda: idempotency.recorded(env.pool, "c-grpc"),
                lambda found: found is None,
                what="the OpenShell role to forget c-grpc",
            )
        finally:
            stop.set()
            await asyncio.wait_for(role, 30)
