"""PodmanKeys, the names and the cleanup every Podman test relies on, on real Podman: what a
failed test leaves behind (a runtime with provider values the plane never deleted) is gone
after ``cleanup()``, its secrets included, so the shared Podman does not collect them."""

from __future__ import annotations

import uuid

from pipeline_support import (
    SLEEPER,
    PodmanKeys,
    containers_of,
    sandbox_spec,
    secrets_of,
    volumes_of,
)
from podman import PodmanClient

from drivers.protocol import LaunchSpec
from services.common.settings import Settings
from services.executor.backends import podman_driver


async def test_cleanup_removes_the_container_workspace_and_secrets_a_failed_test_left(
    settings: Settings, podman: PodmanClient
) -> None:
    keys = PodmanKeys(podman, "keys")
    key = keys()
    driver = podman_driver(settings, stop_timeout=1)
    try:
        spec = sandbox_spec(settings, SLEEPER)
        await driver.launch(LaunchSpec(key, uuid.uuid4(), 1, "rid-k", spec, secrets={"T": "v"}))
    finally:
        await driver.close()
    assert secrets_of(podman, key) == [f"sandstream-{key}-g1--T"]
    keys.cleanup()
    assert (containers_of(podman, key), volumes_of(podman, key), secrets_of(podman, key)) == (
        [], [], []
    )  # fmt: skip
