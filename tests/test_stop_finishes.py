"""A decided stop finishes, through the real pipeline (Kafka, PostgreSQL, the processor, the
scheduler, the executor and its reconcile loop) over the fake driver's fault injection: a
time to live with ``on_expiry: stop`` whose stop (and the escalation's kill) keeps failing
with the runtime running stays Stopping, every failure and retry in its history, and is
Stopped once a retry succeeds. It used to go back to Ready, the expiry consumed: the sandbox
ran for good.

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
from pipeline_support import command, phase, wait_phase, wait_row

from drivers.fake import FakeDriver
from events.publisher import CommandPublisher, now
from services.up.control_plane import ControlPlane

# The stop timeline's windows, scaled (the defaults: 600 s of executor retries, 30 s of stop
# margin, 120 s to 1800 s of back-off).
SCALED = {
    "executor_retry_seconds": 1.0,
    "stop_margin_seconds": 0.3,
    "stop_timeout_seconds": 0,
    "delete_retry_seconds": 0.5,
    "delete_retry_max_seconds": 2.0,
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
        assert types.index("SandboxStopping") < types.index("SandboxOperationFailed")
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
