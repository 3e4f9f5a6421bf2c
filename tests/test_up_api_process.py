"""`sandstream up` with its HTTP API in a child process of its own (SANDSTREAM_UP_API_PROCESS):
the real console script, the real Podman driver, the API served by the child on the port `up`
printed; `up`'s shutdown stops the child, and a child that dies stops `up` loudly."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
from harness import eventually
from upkit import Up, running_up

from services.common.settings import load_settings

IMAGE = load_settings().sandbox_image
MODE = {"SANDSTREAM_UP_API_PROCESS": "true", "SANDSTREAM_OPENSHELL_ENABLED": "false"}


def children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(p) for p in found]


def api_child(up: Up) -> int:
    """The one child of `up` serving the API (its command line names the module)."""
    found = [
        pid
        for pid in children(up.proc.pid)
        if b"services.up.api_process" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(found) == 1, found
    return found[0]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def phase(client: httpx.AsyncClient, name: str) -> str | None:
    response = await client.get(f"/v1/sandboxes/{name}")
    return None if response.status_code == 404 else str(response.json()["phase"])


async def test_up_serves_create_and_delete_from_its_api_process_and_stops_it(
    tmp_path: Path,
) -> None:
    async with running_up(tmp_path, MODE) as up:
        child = api_child(up)
        assert "the API serves in a process of its own" in up.log.read_text()
        headers = {"Authorization": f"Bearer {up.admin_token()}"}
        async with httpx.AsyncClient(base_url=up.url, headers=headers, timeout=60) as client:
            name = up.name("apiproc")
            body = {"name": name, "spec": {"image": IMAGE, "command": ["sleep", "3600"]}}
            created = await client.post("/v1/sandboxes", json=body)
            assert created.status_code in (200, 201, 202), created.text
            await eventually(lambda: phase(client, name), lambda p: p == "Ready", timeout=120)
            deleted = await client.delete(f"/v1/sandboxes/{name}")
            assert deleted.status_code in (200, 202), deleted.text
            await eventually(
                lambda: phase(client, name), lambda p: p in (None, "Deleted"), timeout=120
            )
        up.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.proc.wait(), 90) == 0
        assert not alive(child)
        assert "Traceback" not in up.log.read_text()


async def test_an_api_process_that_dies_stops_up_with_an_error(tmp_path: Path) -> None:
    async with running_up(tmp_path, MODE) as up:
        os.kill(api_child(up), signal.SIGKILL)
        assert await asyncio.wait_for(up.proc.wait(), 90) == 1
        assert "the API process stopped unexpectedly; stopping everything" in up.log.read_text()


async def test_the_api_process_stops_when_up_is_killed(tmp_path: Path) -> None:
    async with running_up(tmp_path, MODE) as up:
        child = api_child(up)
        up.proc.kill()  # no shutdown of up's: the child sees its pipe from up end
        await up.proc.wait()
        await eventually(lambda: alive(child), lambda a: not a, timeout=60)
