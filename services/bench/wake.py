"""Resume and wake-on-exec on real Podman, without and with memory (part of ``make bench``,
``drivers`` (e); figures printed, never asserted).

Per sandbox, one at a time, in one run beside a cold create: CreateSandbox → Ready, then
SuspendSandbox → Suspended and ResumeSandbox → Ready (a new container on the kept volume), then
SuspendSandbox again and an exec through the HTTP API (``POST /v1/sandboxes/{name}/exec``,
streamed) from the request being sent to its first stdout byte: the wake's resume, the wait
for Ready and the exec itself. The same with memory kept (the driver's checkpoint directory set,
as SANDSTREAM_PODMAN_SUSPEND_MEMORY does): the suspend checkpoints the agent with CRIU, the
resume restores it; how many resumes restored the memory (rather than starting afresh) is
printed from the history. The memory part runs on a Podman service of its own, started by the
stack's code with the CRIU it builds first on its PATH (a shared service started before CRIU was
built checkpoints nothing), on the machine's one container store.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from drivers.podman import PodmanDriver
from drivers.podman_memory import RESTORED
from events.commands import CreateSandbox, DeleteSandbox, ResumeSandbox, SuspendSandbox
from events.common import SandboxSpec
from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.server import start_api
from services.bench.drivers import Figures, Rows, _cmd, _force_remove, timed
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.common.tokens import SCOPES, TokenStore
from services.localstack import podman_service
from services.localstack.isolation import isolated
from services.up.control_plane import ControlPlane

TOKEN = "sst_bench-admin"
# An agent with something in memory: a counter written to the workspace ten times a second.
AGENT = ["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /workspace/n; sleep 0.1; done"]


async def first_output(client: httpx.AsyncClient, name: str) -> float:
    """Seconds from an exec's request to its first stdout event (streamed)."""
    began = time.perf_counter()
    body = {"command": ["echo", "awake"]}
    async with client.stream(
        "POST", f"/v1/sandboxes/{name}/exec", params={"stream": "true"}, json=body
    ) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"exec on {name}: {answer.status_code} {await answer.aread()!r}")
        event = ""
        async for line in answer.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "stdout":
                return time.perf_counter() - began
            elif line.startswith("data: ") and event in ("error", "exit"):
                raise RuntimeError(f"exec on {name}: {event} before any output: {line}")
    raise RuntimeError(f"exec on {name}: the stream ended without output")


async def restored(rows: Rows, keys: list[str]) -> int:
    """How many launches after a suspend restored the memory (the launch results' reason)."""
    found = await rows.pool.fetch(
        "SELECT message FROM history WHERE key = ANY($1) AND message_type = "
        "'DriverOperationResult'",
        keys,
    )
    messages = [json.loads(r["message"]) if isinstance(r["message"], str) else r["message"]
                for r in found]  # fmt: skip
    return sum(
        1
        for m in messages
        if m["operation"] == "launch" and (m["reason"] or "").startswith(RESTORED)
    )


async def measure(settings: Settings, driver: PodmanDriver, label: str, n: int) -> list[Figures]:
    keys = [f"bench-wake-{uuid.uuid4().hex[:6]}-{i}" for i in range(n)]
    spec = SandboxSpec(image=settings.sandbox_image, command=AGENT)
    created, resumed, woken = [], [], []
    async with isolated(settings, "benchw", kafka_partitions=4) as (s, pool):
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600)
        rows = await Rows.open(s, pool)
        await plane.start()
        pub = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
        await pub.__aenter__()
        app = create_app(s, pool, pub, TokenStore.of(admin=(TOKEN, *SCOPES)), exec_driver=driver)
        server = await start_api(app, "127.0.0.1", 0, access_log=False)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        try:
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=90) as http:
                for key in keys:
                    created.append(
                        await timed(pub, rows, _cmd(CreateSandbox, key, spec=spec), "Ready")
                    )
                    await asyncio.sleep(0.5)  # the agent counts: some memory to keep
                    await timed(pub, rows, _cmd(SuspendSandbox, key), "Suspended")
                    resumed.append(await timed(pub, rows, _cmd(ResumeSandbox, key), "Ready"))
                    await timed(pub, rows, _cmd(SuspendSandbox, key), "Suspended")
                    woken.append(await first_output(http, key))
                    await pub.publish(_cmd(DeleteSandbox, key))
                for key in keys:
                    await rows.until(key, "Deleted")
                kept = await restored(rows, keys)
        finally:
            await server.stop()
            await pub.__aexit__()
            await plane.stop()
            await rows.close()
            await driver.close()
            await asyncio.to_thread(_force_remove, s, keys)
    return [
        Figures(f"{label}: cold create → Ready", created),
        Figures(f"{label}: resume → Ready", resumed),
        Figures(f"{label}: wake-on-exec → first output", woken),
        Figures(f"{label}: resumes that restored memory: {kept} of {2 * n}", []),
    ]


async def with_memory(settings: Settings, n: int) -> list[Figures]:
    """The same on a Podman service of this run's own, the driver keeping memory."""
    with tempfile.TemporaryDirectory(prefix="sst-wake-") as state:
        own = Settings(
            state_dir=Path(state),
            podman_socket=Path(state) / "podman.sock",
            kube_home=settings.kube_home_path,
        )
        await asyncio.to_thread(podman_service.up, own)
        try:
            driver = PodmanDriver(own.podman_url, checkpoint_dir=Path(state) / "checkpoints")
            return await measure(settings, driver, "with memory (CRIU)", n)
        finally:
            await asyncio.to_thread(podman_service.stop, own)


async def main(settings: Settings, n: int = 5) -> None:
    from services.executor.backends import podman_driver

    print("(e) resume and wake-on-exec (HTTP exec → first stdout), real Podman, one at a time")
    plain = await measure(settings, podman_driver(settings), "storage only", n)
    for figures in plain + await with_memory(settings, n):
        print(figures.line("s") if figures.samples else f"  {figures.label}")


if __name__ == "__main__":
    asyncio.run(main(Settings()))  # python -m services.bench.wake: this part alone
