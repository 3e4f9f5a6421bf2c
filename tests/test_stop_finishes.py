"""A decided stop finishes, through the real pipeline (Kafka, PostgreSQL, the processor, the
scheduler, the executor and its reconcile loop) over the fake driver's fault injection: a
time to live with ``on_expiry: stop`` whose stop (and the escalation's kill) keeps failing
with the runtime running stays Stopping, every failure and retry in its history, and is
Stopped once a retry succeeds. It used to go back to Ready, the expiry consumed: the sandbox
ran for good.

On real Podman: the stops of a running container go to a Podman service that cannot be reached
(the usual way a stop fails there), and the container keeps running until the service is back.

The windows are scaled through the settings; tests/test_stop_finishes_rules.py decides the
same timeline at these windows and at the defaults and finds the same events in the same
order. The rules alone: tests/test_stop_finishes_rules.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import factories as f
from harness import Env, eventually, isolated_env
from pipeline_support import (
    SLEEPER,
    command,
    phase,
    podman_env,
    running_plane,
    sandbox_spec,
    status_of,
    wait_phase,
    wait_row,
)
from podman import PodmanClient
from test_stop_finishes_rules import SCALED_GRACE, SCALED_STOP_WINDOWS

from drivers.fake import FakeDriver
from drivers.podman import PodmanDriver, container_name
from drivers.protocol import OpResult
from events.publisher import CommandPublisher, now
from services.up.control_plane import ControlPlane

# The stop timeline's windows, scaled (the defaults: 600 s of executor retries, 30 s of stop
# margin, 120 s to 1800 s of back-off, a 10 s grace); the sandboxes here stop with the same
# grace (SCALED_GRACE) through their spec or the driver's default.
SCALED = {
    **SCALED_STOP_WINDOWS,
    "stop_timeout_seconds": SCALED_GRACE,
    "scheduler_poll_seconds": 0.2,
}


@asynccontextmanager
async def plane_over(driver: FakeDriver, **update: Any) -> AsyncIterator[tuple[Env, Any]]:
    async with isolated_env() as env:
        env.settings = env.settings.model_copy(update={**SCALED, **update})
        plane = ControlPlane(
            env.settings, driver, env.pool, with_scheduler=True, reconcile_interval=0.5
        )
        await plane.start()
        try:
            async with await env.publisher() as pub:
                yield env, pub
        finally:
            await plane.stop()


Decided = tuple[list[dict[str, Any]], list[str]]


async def decided(env: Env, key: str) -> Decided:
    """The sandbox's history, and the types of the events it decided, in order."""
    rows = await env.fetch(
        "SELECT message_type, disposition, reason, phase, message, event_types FROM history "
        "WHERE key = $1 ORDER BY id",
        key,
    )
    items = [dict(r) for r in rows]
    for h in items:
        if isinstance(h["message"], str):
            h["message"] = json.loads(h["message"])
    return items, [t for h in items for t in h["event_types"] or []]


def failed_stops(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        h
        for h in items
        if h["message_type"] == "DriverOperationResult"
        and (h["message"]["operation"], h["message"]["outcome"]) == ("stop", "failed")
    ]


def failed_once(found: Decided) -> bool:
    return bool(failed_stops(found[0]))


async def running(driver: FakeDriver, key: str) -> bool:
    return any(r.state == "running" for r in await driver.get(key))


async def ttl_stop_that_fails(env: Env, pub: CommandPublisher, driver: FakeDriver) -> None:
    """A sandbox whose time to live ends at once with on_expiry: stop, every stop and kill of
    it failing transiently with the runtime left running."""
    await command(env, pub, f.create("t", ttl_seconds=1, on_expiry="stop", occurred_at=now()))
    await wait_phase(env, "t", "Ready")
    driver.fail("stop", "t", "podman: timeout", retryable=True, times=None)
    driver.fail("kill", "t", "podman: timeout", retryable=True, times=None)


async def test_a_failing_ttl_stop_stays_stopping_with_its_retries_until_one_stops_it() -> None:
    driver = FakeDriver()
    async with plane_over(driver) as (env, pub):
        await ttl_stop_that_fails(env, pub, driver)

        # Two failed stops, the second after a retry the deadline asked for.
        def retried(found: Decided) -> bool:
            return len(failed_stops(found[0])) >= 2 and "SandboxStopRetried" in found[1]

        items, _ = await eventually(
            lambda: decided(env, "t"),
            retried,
            what="two failed stops and a retry recorded",
            timeout=60,
        )
        assert await phase(env, "t") == "Stopping"
        assert await running(driver, "t"), "the runtime is still running"
        for failure in failed_stops(items):  # never undone: no Ready, no Error
            assert (failure["disposition"], failure["phase"]) == ("applied", "Stopping")
            assert failure["reason"].endswith("Stopping -> Stopping"), failure["reason"]
        await wait_row(env, "t", lambda r: (r["reason"] or "").startswith("StopFailed: "), "why")
        (expiry,) = await env.fetch("SELECT expires_at FROM sandboxes WHERE key = 't'")
        assert expiry["expires_at"] is None  # the expiry was consumed: only the retries are left
        driver.clear_failures()  # the backend recovers: the next retry stops it
        await wait_phase(env, "t", "Stopped", timeout=60)
        assert not await running(driver, "t")
        _, types = await decided(env, "t")
        assert types.index("SandboxExpired") < types.index("SandboxStopping")
        # The path the scaled timeline proves the defaults take: the escalation's kill first.
        assert types.index("SandboxStopping") < types.index("SandboxStopEscalated")
        assert types.index("SandboxStopEscalated") < types.index("SandboxOperationFailed")
        assert types.index("SandboxOperationFailed") < types.index("SandboxStopRetried")
        assert "SandboxReady" not in types[types.index("SandboxStopping") :]
        assert types[-1] == "SandboxStopped"


async def test_a_restart_takes_over_a_failing_stop() -> None:
    """The user's later word wins over the retries: a restart starts a new generation (its
    launch removes the old runtime) and the stop's retries end with the phase."""
    driver = FakeDriver()
    async with plane_over(driver) as (env, pub):
        await ttl_stop_that_fails(env, pub, driver)
        await eventually(lambda: decided(env, "t"), failed_once, what="a failed stop")
        assert await phase(env, "t") == "Stopping"
        driver.clear_failures()
        await command(env, pub, f.restart("t", occurred_at=now()))
        row = await wait_phase(env, "t", "Ready")
        assert row["generation"] == 2
        assert [r.generation for r in await driver.get("t") if r.state == "running"] == [2]


class StopsUnreachable:
    """The real Podman driver, except that while ``away`` its stops and kills go to a Podman
    service that is not there (a socket nobody listens on): they fail as an outage does,
    retryable, the backend unread, while the container runs on."""

    def __init__(self, real: PodmanDriver, away: PodmanDriver) -> None:
        self.real, self.absent, self.away = real, away, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await (self.absent if self.away else self.real).stop(key, generation, timeout)

    async def kill(self, key: str, generation: int) -> OpResult:
        return await (self.absent if self.away else self.real).kill(key, generation)


async def test_on_podman_a_ttl_stop_that_cannot_reach_podman_stays_stopping_until_it_can(
    podman: PodmanClient, tmp_path: Any
) -> None:
    async with podman_env(podman, "stopfail") as (env, real, keys):
        env.settings = env.settings.model_copy(update={**SCALED, "launch_timeout_seconds": 60})
        absent = PodmanDriver(f"unix://{tmp_path}/no-podman.sock")
        driver = StopsUnreachable(real, absent)
        key = keys()
        name = container_name(key, 1)
        try:
            async with (
                running_plane(
                    env, driver, with_scheduler=True, removing=keys, reconcile_interval=0.5
                ),
                await env.publisher() as pub,
            ):
                spec = sandbox_spec(env.settings, SLEEPER, stop_timeout=SCALED_GRACE)
                # A TTL long enough for a busy machine's start (at a load of 10 a second was
                # not: the sandbox expired while Provisioning), read from the history, as a poll
                # of the row can miss a Ready that short
                create = f.create(
                    key, sandbox_spec=spec, ttl_seconds=5, on_expiry="stop", occurred_at=now()
                )
                await command(env, pub, create)
                await eventually(lambda: decided(env, key), lambda d: "SandboxReady" in d[1],
                                 timeout=60, what="the sandbox Ready")  # fmt: skip

                def retried(found: Decided) -> bool:
                    return len(failed_stops(found[0])) >= 2 and "SandboxStopRetried" in found[1]

                items, _ = await eventually(
                    lambda: decided(env, key), retried, timeout=60,
                    what="two failed stops and a retry recorded",
                )  # fmt: skip
                assert await phase(env, key) == "Stopping"
                assert status_of(podman, name) == "running"
                for failure in failed_stops(items):
                    assert failure["phase"] == "Stopping", failure["reason"]
                    assert failure["message"]["observed"] is None  # the backend unread
                driver.away = False  # Podman is back: the next retry stops the container
                await wait_phase(env, key, "Stopped", timeout=60)
                assert status_of(podman, name) == "exited"
        finally:
            await absent.close()
        _, types = await decided(env, key)
        assert types[:6] == [
            "SandboxCreated", "SandboxReady", "SandboxExpired", "SandboxStopping",
            "SandboxStopEscalated", "SandboxOperationFailed",
        ]  # fmt: skip
        assert "SandboxReady" not in types[3:] and types[-1] == "SandboxStopped"
