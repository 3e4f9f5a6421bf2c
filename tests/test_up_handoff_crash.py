"""`sandstream up` killed while its processor's hand-over has launches in flight: docs say a
handed event's offset is committed only once its item ended, so a crash redelivers it. The real
console script, real Kafka, PostgreSQL and Podman: `up` is SIGKILLed as soon as the first
container of a burst exists, started again on the same topics and schema, and every sandbox
ends Ready with exactly one container and one volume."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from harness import eventually, isolated_env
from pipeline_support import containers_of, volumes_of
from podman import PodmanClient
from test_up_api_process import phase
from upkit import running_up

from drivers.podman import container_name
from drivers.protocol import LABEL_KEY
from services.common.settings import load_settings

IMAGE = load_settings().sandbox_image
# One driver call at a time: when the burst's first container exists, the others' handed
# launches are still queued in `up` or running, their offsets not committed.
HANDOFF = {
    "SANDSTREAM_UP_HANDOFF": "true",
    "SANDSTREAM_EXECUTOR_CONCURRENCY": "1",
    "SANDSTREAM_OPENSHELL_ENABLED": "false",
}
# Enough launches, one at a time, that the poll for the first container returns long before
# the last: with 8, a loaded CI machine had them all Ready before the kill.
BURST = 24


def containers_made(podman: PodmanClient, names: list[str]) -> int:
    """How many containers of ``names`` Podman holds (one listing for all)."""
    found = podman.containers.list(all=True, filters=[f"label={LABEL_KEY}"])
    return sum(1 for c in found if c.labels.get(LABEL_KEY) in names)


async def test_up_killed_with_handed_launches_in_flight_ends_with_one_container_each(
    podman: PodmanClient, tmp_path: Path
) -> None:
    runs = [tmp_path / "first", tmp_path / "second"]
    for run in runs:
        run.mkdir()
    async with isolated_env() as env, running_up(runs[0], HANDOFF, env) as first:
        names = [first.name("handkill") for _ in range(BURST)]
        headers = {"Authorization": f"Bearer {first.admin_token()}"}
        async with httpx.AsyncClient(base_url=first.url, headers=headers, timeout=60) as client:
            for name in names:
                body = {"name": name, "spec": {"image": IMAGE, "command": ["sleep", "3600"]}}
                created = await client.post("/v1/sandboxes", json=body)
                assert created.status_code in (200, 201, 202), created.text
        await eventually(
            lambda: asyncio.to_thread(containers_made, podman, names),
            lambda made: made >= 1, timeout=120, what="the burst's first container",
        )  # fmt: skip
        first.proc.kill()
        await first.proc.wait()
        rows = await env.fetch("SELECT phase FROM sandboxes WHERE key = ANY($1::text[])", names)
        assert [r["phase"] for r in rows].count("Ready") < len(names), "all done before the kill"

        async with running_up(runs[1], HANDOFF, env) as second:
            headers = {"Authorization": f"Bearer {second.admin_token()}"}
            async with httpx.AsyncClient(
                base_url=second.url, headers=headers, timeout=60
            ) as client:
                await eventually(
                    lambda: asyncio.gather(*(phase(client, n) for n in names)),
                    lambda phases: set(phases) == {"Ready"}, timeout=120,
                    what="every sandbox Ready after the restart",
                )  # fmt: skip
            for name in names:
                found = [(c["name"], c["status"]) for c in containers_of(podman, name)]
                assert found == [(container_name(name, 1), "running")], (name, found)
                assert len(volumes_of(podman, name)) == 1, name
            assert "Traceback" not in second.log.read_text()
