"""The provider-sync controller on the real stack (Kafka, PostgreSQL, Podman), and a rotation
restart that meets a transient driver failure.

The controller sends one update for every changed provider (a sandbox attached to both restarts
once), a restarted controller re-sends nothing, and its loop picks up a changed file. The
restart's first launch fails with a retryable driver error (injected in front of the real
Podman driver): the executor retries it and the agent comes up on the new values; one that
keeps failing is retried for the retry window, then reported: AgentRestartFailed, Error.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import apikit
import pytest
from apikit import create_body, unique
from harness import eventually
from pydantic import SecretStr

from drivers.fake import FakeDriver
from drivers.podman import PodmanDriver
from drivers.protocol import DriverError, LaunchResult, LaunchSpec, OpResult, RuntimeInfo
from services.common import metrics
from services.common.settings import load_settings
from services.executor.backends import podman_driver
from services.provider_sync.controller import ProviderSync
from services.provider_sync.sources import DirectorySource

KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
AGENT = ["sh", "-c", "env > /tmp/agent.env; exec sleep 3600"]


class FlakyLaunches:
    """The Podman driver, except that the next ``fail`` launches raise a retryable error."""

    def __init__(self, inner: PodmanDriver) -> None:
        self.inner = inner
        self.fail = 0
        self.attempts: list[tuple[str, int]] = []

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        self.attempts.append((spec.key, spec.generation))
        if self.fail > 0:
            self.fail -= 1
            raise DriverError("podman unavailable (injected)", retryable=True)
        return await self.inner.launch(spec)

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self.inner.stop(key, generation, timeout)

    async def delete(self, key: str, sandbox_id: Any = None) -> bool:
        return await self.inner.delete(key, sandbox_id)

    async def get(self, key: str) -> list[RuntimeInfo]:
        return await self.inner.get(key)

    async def list(self) -> list[RuntimeInfo]:
        return await self.inner.list()

    def watch(self) -> AsyncIterator[Any]:
        return self.inner.watch()

    async def close(self) -> None:
        await self.inner.close()


async def agent_env(driver: PodmanDriver, name: str, generation: int) -> dict[str, str]:
    code, out = await asyncio.wait_for(driver.exec(name, generation, ["cat", "/tmp/agent.env"]), 30)
    assert code == 0, out
    return dict(line.split("=", 1) for line in str(out).splitlines() if "=" in line)


def write(root: Path, provider: str, key: str, value: str) -> None:
    (root / provider).mkdir(exist_ok=True)
    (root / provider / key).write_text(value)


async def test_sync_sends_one_update_a_restarted_controller_nothing_and_a_retry_recovers(
    tmp_path: Path,
) -> None:
    podman = podman_driver(load_settings(), stop_timeout=5)
    driver = FlakyLaunches(podman)
    p, q, name = unique("sync-p"), unique("sync-q"), unique("synced")
    write(tmp_path, p, "API_KEY", "p-one")
    write(tmp_path, q, "TOKEN", "q-one")
    (tmp_path / ".hidden").mkdir()  # a mounted Secret's bookkeeping: skipped
    try:
        async with apikit.running_api(driver, settings_update={"credentials_key": KEY}) as api:
            service = api.app.state.providers
            first = await ProviderSync(service, DirectorySource(tmp_path)).reconcile()
            assert first is not None
            assert {a.change.provider for a in first.applied} == {p, q}
            assert all(a.created and not a.change.rotated for a in first.applied)
            assert first.sandboxes == []

            async with api.client() as c:
                body = create_body(name, command=AGENT)
                body["spec"]["image"] = api.env.settings.sandbox_image
                body["providers"] = [p, q]
                r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
                assert r.status_code == 201, r.text
                await api.wait_phase(name, "Ready")
                seen = await agent_env(podman, name, 1)
                assert (seen["API_KEY"], seen["TOKEN"]) == ("p-one", "q-one")

                # A restarted controller: nothing changed, nothing sent.
                assert await ProviderSync(service, DirectorySource(tmp_path)).reconcile() is None

                # Both rotate; the restart's first launch fails transiently.
                write(tmp_path, p, "API_KEY", "p-two")
                write(tmp_path, q, "TOKEN", "q-two")
                driver.fail = 1
                receipt = await ProviderSync(service, DirectorySource(tmp_path)).reconcile()
                assert receipt is not None
                assert sorted(a.change.provider for a in receipt.applied) == sorted([p, q])
                (line,) = receipt.sandboxes
                assert (line.sandbox, line.action, line.providers) == (
                    name, "restart", tuple(sorted([p, q])),
                )  # fmt: skip
                await eventually(
                    lambda: c.get(f"/v1/sandboxes/{name}"),
                    lambda resp: (resp.json()["phase"], resp.json()["generation"]) == ("Ready", 2),
                    what=f"{name} Ready at generation 2 after the retried launch",
                )
                assert driver.attempts.count((name, 2)) == 2  # failed once, then succeeded
                seen = await agent_env(podman, name, 2)
                assert (seen["API_KEY"], seen["TOKEN"]) == ("p-two", "q-two")
                history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
                restarts = [h for h in history if "AgentRestarted" in h["events"]]
                assert len(restarts) == 1

                # The controller's loop, with no restart: a changed file is picked up.
                stop = asyncio.Event()
                loop = ProviderSync(service, DirectorySource(tmp_path), restart=False, interval=0.1)
                task = asyncio.create_task(loop.run(stop))
                try:
                    write(tmp_path, p, "API_KEY", "p-three")
                    await eventually(
                        lambda: c.get(f"/v1/providers/{p}"),
                        lambda resp: resp.json()["revision"] == 3,
                        what=f"{p} at revision 3",
                    )
                finally:
                    stop.set()
                    await asyncio.wait_for(task, 10)
                await eventually(
                    lambda: c.get(f"/v1/sandboxes/{name}/history"),
                    lambda resp: any(
                        "AgentRestartSkipped" in h["events"] for h in resp.json()["items"]
                    ),
                    what="the no-restart rotation recorded as skipped",
                )
                row = (await c.get(f"/v1/sandboxes/{name}")).json()
                assert (row["phase"], row["generation"]) == ("Ready", 2)
                await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
                await api.wait_phase(name, "Deleted")
    finally:
        await podman.delete(name)
        await podman.close()


async def test_a_restart_that_keeps_failing_transiently_is_reported_failed_after_the_retries(
    tmp_path: Path,
) -> None:
    podman = podman_driver(load_settings(), stop_timeout=5)
    driver = FlakyLaunches(podman)
    p, name = unique("giveup-p"), unique("giveup")
    # The retry window (executor_retry_seconds, 600 s) and the launch timeout (300 s) scaled
    # down to 6 s and 3 s, keeping their relation, with the scheduler running: the launch
    # deadline must not fall due before the executor reports that it gave up.
    update = {
        "credentials_key": KEY,
        "executor_retry_seconds": 6.0,
        "launch_timeout_seconds": 3.0,
        "scheduler_poll_seconds": 0.5,
    }
    try:
        async with (
            apikit.running_api(driver, settings_update=update, with_scheduler=True) as api,
            api.client() as c,
        ):
            r = await c.post("/v1/providers", json={"name": p, "credentials": {"K": "one"}})
            assert r.status_code == 201, r.text
            body = create_body(name, command=AGENT)
            body["spec"]["image"] = api.env.settings.sandbox_image
            body["providers"] = [p]
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await api.wait_phase(name, "Ready")

            driver.fail = 10_000  # the backend stays unavailable
            r = await c.put(f"/v1/providers/{p}/credentials", json={"credentials": {"K": "two"}})
            assert r.status_code == 200, r.text
            await api.wait_phase(name, "Error", timeout=60)
            row = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert "podman unavailable (injected)" in row["reason"], row["reason"]
            assert "gave up after" in row["reason"]
            assert driver.attempts.count((name, 2)) >= 2  # retried before giving up
            history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
            assert [h for h in history if "AgentRestartFailed" in h["events"]]
            driver.fail = 0
            await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
            await api.wait_phase(name, "Deleted")
    finally:
        await podman.delete(name)
        await podman.close()


async def test_a_value_file_caught_half_written_keeps_the_stored_value_and_restarts_no_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A value file that is not UTF-8 (a write caught half-way through a multi-byte character)
    is reported by name and its stored value kept: the update does not take the key as
    removed, so no attached agent restarts. A rotation of another key in the same pass still
    goes through (keeping the unreadable one); the finished write rotates it."""
    caplog.set_level(logging.WARNING, logger="sandstream.provider-sync")
    p, name = unique("half-p"), unique("half")
    write(tmp_path, p, "TOKEN", "t-one")
    write(tmp_path, p, "OTHER", "o-one")
    async with (
        apikit.running_api(FakeDriver(), settings_update={"credentials_key": KEY}) as api,
        api.client() as c,
    ):
        sync = ProviderSync(api.app.state.providers, DirectorySource(tmp_path))
        assert await sync.reconcile() is not None
        body = create_body(name)
        body["providers"] = [p]
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
        await api.wait_phase(name, "Ready")
        before = (await c.get(f"/v1/providers/{p}")).json()

        (tmp_path / p / "TOKEN").write_bytes("t-twö".encode()[:-1])  # cut inside the ö
        assert await sync.reconcile() is None  # nothing changed: nothing sent
        assert "keeping the stored value of " + f"{p}/TOKEN" in caplog.text
        assert "t-tw" not in caplog.text  # the bytes are never logged
        assert metrics.PROVIDER_SYNC_UNREADABLE._value.get() == 1
        assert (await c.get(f"/v1/providers/{p}")).json() == before

        write(tmp_path, p, "OTHER", "o-two")  # rotated while TOKEN is still unreadable
        receipt = await sync.reconcile()
        assert receipt is not None
        (applied,) = receipt.applied
        assert (applied.change.of("rotated"), applied.change.of("removed")) == (["OTHER"], [])
        after = (await c.get(f"/v1/providers/{p}")).json()
        assert [k["name"] for k in after["keys"]] == ["OTHER", "TOKEN"]
        token = [k for k in after["keys"] if k["name"] == "TOKEN"]
        assert token == [k for k in before["keys"] if k["name"] == "TOKEN"]

        await eventually(
            lambda: c.get(f"/v1/sandboxes/{name}"),
            lambda resp: (resp.json()["phase"], resp.json()["generation"]) == ("Ready", 2),
            what=f"{name} restarted for the rotation of OTHER",
        )

        write(tmp_path, p, "TOKEN", "t-twö")  # the write finished
        receipt = await sync.reconcile()
        assert receipt is not None
        (applied,) = receipt.applied
        assert (applied.change.of("rotated"), applied.change.of("removed")) == (["TOKEN"], [])
        assert metrics.PROVIDER_SYNC_UNREADABLE._value.get() == 0
        await eventually(
            lambda: c.get(f"/v1/sandboxes/{name}"),
            lambda resp: (resp.json()["phase"], resp.json()["generation"]) == ("Ready", 3),
            what=f"{name} restarted once per real rotation (generation 3), never for the cut",
        )
        history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
        assert len([h for h in history if "AgentRestarted" in h["events"]]) == 2
