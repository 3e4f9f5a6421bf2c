"""The whole pipeline with the fake driver: deterministic races on real Kafka and PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import factories as f
from harness import Env, eventually, isolated_env

from drivers.fake import FakeDriver
from services.runtime import ControlPlane


@asynccontextmanager
async def pipeline(driver: FakeDriver) -> AsyncIterator[tuple[Env, ControlPlane]]:
    async with isolated_env() as env:
        plane = ControlPlane(env.settings, driver, env.pool, reconcile_interval=3600)
        await plane.start()
        try:
            yield env, plane
        finally:
            await plane.stop()


async def phase(env: Env, key: str) -> str | None:
    return await env.fetchval("SELECT phase FROM sandboxes WHERE key = $1", key)


async def wait_phase(env: Env, key: str, expected: str, timeout: float = 30) -> None:
    await eventually(lambda: phase(env, key), lambda p: p == expected, timeout=timeout,
                     what=f"{key} to be {expected}")  # fmt: skip


async def test_a_blocked_delete_of_a_does_not_delay_b() -> None:
    driver = FakeDriver()
    async with pipeline(driver) as (env, _), await env.publisher() as pub:
        for key in ("a", "b"):
            await pub.publish(f.create(key))
        await wait_phase(env, "a", "Ready")
        await wait_phase(env, "b", "Ready")

        held = driver.block("delete", "a")
        await pub.publish(f.delete("a"))
        await held.entered()
        await pub.publish(f.stop("b", command_id="stop-b"))
        await wait_phase(env, "b", "Stopped")
        await pub.publish(f.delete("b"))
        await wait_phase(env, "b", "Deleted")
        # B went all the way to its tombstone while A's delete is still held in the driver.
        assert await phase(env, "a") == "Deleting"
        assert not held.released

        held.release()
        await wait_phase(env, "a", "Deleted")
        assert driver.calls_for("delete", "a") and not await driver.list()
