"""Suspend on the real Podman service of the local stack: the runtime goes, the workspace
volume stays, and a newer generation finds the files written before (ten cycles)."""

from __future__ import annotations

from collections.abc import Callable

from podman import PodmanClient
from test_driver_podman import containers_of, driver, keys, spec_for, volumes_of

from drivers.podman import PodmanDriver, container_name, volume_name
from services.common.settings import Settings

__all__ = ["driver", "keys"]  # the fixtures this module uses

SLEEP = ["sh", "-c", "sleep 3600"]


async def test_ten_suspend_resume_cycles_keep_the_workspace(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    first = spec_for(settings, key, 1, SLEEP)
    volume = volume_name(key, first.sandbox_id)
    await driver.launch(first)
    for generation in range(1, 11):
        line = f"written by generation {generation}"
        code, _ = await driver.exec(key, generation, ["sh", "-c", f"echo '{line}' >> /workspace/f"])
        assert code == 0
        suspended = await driver.suspend(key, generation)
        assert suspended.outcome == "succeeded"
        assert containers_of(podman, key) == [] and await driver.get(key) == []
        assert volumes_of(podman, key) == [volume]
        resumed = spec_for(settings, key, generation + 1, SLEEP, first.sandbox_id)
        assert (await driver.launch(resumed)).started
        assert containers_of(podman, key) == [container_name(key, generation + 1)]
        code, out = await driver.exec(key, generation + 1, ["cat", "/workspace/f"])
        assert code == 0
        assert out.splitlines() == [f"written by generation {g}" for g in range(1, generation + 1)]


async def test_suspend_of_a_stopped_runtime_removes_it_and_of_nothing_finds_it_absent(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    spec = spec_for(settings, key, 1, SLEEP)
    await driver.launch(spec)
    await driver.stop(key, 1)
    assert containers_of(podman, key) == [container_name(key, 1)]
    assert (await driver.suspend(key, 1)).outcome == "succeeded"
    assert containers_of(podman, key) == []
    assert volumes_of(podman, key) == [volume_name(key, spec.sandbox_id)]
    assert (await driver.suspend(key, 1)).outcome == "already_absent"
    assert (await driver.suspend(keys(), 3)).outcome == "already_absent"
