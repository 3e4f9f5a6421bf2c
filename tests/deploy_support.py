"""What the deployment tests (kube play of the chart, podman-compose) share: the image, free
ports, and the round trip through an API served from the image: a sandbox created, Ready as a
sibling container on the host's Podman, deleted."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import httpx
from harness import eventually
from podman import PodmanClient

from drivers.protocol import LABEL_KEY
from services.common.settings import Settings
from services.localstack import image

READY_TIMEOUT = 240.0  # the roles' first start on a shared, busy machine


async def current_image(settings: Settings) -> str:
    """The image of this checkout (`make image` built it; a no-op rebuild when current)."""
    return await asyncio.to_thread(image.build, settings, lambda _m: None)


async def wait_api_ready(api: httpx.AsyncClient) -> None:
    async def ready() -> int:
        try:
            return (await api.get("/readyz")).status_code
        except httpx.HTTPError:
            return 0

    await eventually(ready, lambda s: s == 200, timeout=READY_TIMEOUT, interval=1,
                     what=f"{api.base_url}/readyz")  # fmt: skip


def sandbox_containers(podman: PodmanClient, name: str) -> list[Any]:
    return list(podman.containers.list(all=True, filters={"label": f"{LABEL_KEY}={name}"}))


async def create_ready(
    api: httpx.AsyncClient, podman: PodmanClient, settings: Settings, name: str
) -> None:
    """The sandbox ``name`` created through ``api``; returns once it is Ready and its
    container runs on the host's Podman. Name it with a PodmanKeys whose ``cleanup()`` the
    test runs after stopping the deployment: a test that fails before its delete leaves the
    container running on the host's Podman otherwise."""
    body = {"name": name, "spec": {"image": settings.sandbox_image, "command": ["sleep", "600"]}}
    created = await api.post("/v1/sandboxes", params={"wait": 60}, json=body)
    assert created.status_code == 201, created.text
    assert created.json()["status"] == "accepted", created.json()

    async def phase() -> str | None:
        found = await api.get(f"/v1/sandboxes/{name}")
        return found.json().get("phase") if found.status_code == 200 else None

    await eventually(phase, lambda p: p == "Ready", timeout=120, interval=0.2,
                     what=f"{name} Ready")  # fmt: skip
    (container,) = sandbox_containers(podman, name)
    container.reload()  # a listed container's attributes are the list's summary
    assert container.status == "running"


async def delete_gone(api: httpx.AsyncClient, podman: PodmanClient, name: str) -> None:
    """Delete the sandbox through ``api``; returns once the API and Podman no longer have it."""
    deleted = await api.delete(f"/v1/sandboxes/{name}", params={"wait": 60})
    assert deleted.status_code == 200, deleted.text

    async def status() -> int:
        return (await api.get(f"/v1/sandboxes/{name}")).status_code

    # accepted, then Deleting until the runtime is gone: a deleted sandbox is a 404
    await eventually(status, lambda s: s == 404, timeout=120, interval=0.2,
                     what=f"{name} deleted")  # fmt: skip
    await eventually(lambda: sandbox_containers(podman, name), lambda found: not found,
                     timeout=60, what=f"{name}'s container removed")  # fmt: skip


def podman_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=image.podman_env(settings),
        check=False,
    )  # fmt: skip
