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
built checkpoints nothing), on the machine's one container store. Then the same (without
memory: the Kubernetes driver keeps storage only) on the local cluster's real node, the
workspace a claim of the cluster's storage class; left out, saying why, when there is no such
node.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from drivers.podman import PodmanDriver
from drivers.podman_memory import RESTORED
from drivers.protocol import Driver
from events.commands import CreateSandbox, DeleteSandbox, ResumeSandbox, SuspendSandbox
from events.common import SandboxSpec
from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.server import start_api
from services.bench.drivers import Figures, Rows, _cmd, _force_remove, timed
from services.bench.kube import NoCluster, bench_namespace
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
    """Seconds from an exec's request to its first stdout event (streamed); the stream is read
    to its exit event."""
    began = time.perf_counter()
    first: float | None = None
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
            elif line.startswith("data: ") and event == "stdout" and first is None:
                first = time.perf_counter() - began
            elif line.startswith("data: ") and event == "error":
                raise RuntimeError(f"exec on {name}: {line}")
    if first is None:
        raise RuntimeError(f"exec on {name}: the stream ended without output")
    return first


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


async def measure(
    settings: Settings,
    driver: Driver,
    label: str,
    n: int,
    api_update: dict[str, Any] | None = None,
) -> list[Figures]:
    """The figures of ``driver``; the API execs through ``driver`` (Podman), or through the
    exec source of its settings with ``api_update`` (Kubernetes)."""
    keys = [f"bench-wake-{uuid.uuid4().hex[:6]}-{i}" for i in range(n)]
    spec = SandboxSpec(image=settings.sandbox_image, command=AGENT)
    created, resumed, woken = [], [], []
    async with isolated(settings, "benchw", kafka_partitions=4) as (s, pool):
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600)
        rows = await Rows.open(s, pool)
        await plane.start()
        pub = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
        await pub.__aenter__()
        tokens = TokenStore.of(admin=(TOKEN, *SCOPES))
        if api_update is None:
            assert isinstance(driver, PodmanDriver)
            app = create_app(s, pool, pub, tokens, exec_driver=driver)
        else:
            app = create_app(s.model_copy(update=api_update), pool, pub, tokens)
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
            if api_update is None:
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
            return await measure(settings, driver, "Podman, memory kept (CRIU)", n)
        finally:
            await asyncio.to_thread(podman_service.stop, own)


async def on_real_node(settings: Settings, n: int) -> list[Figures] | str:
    """The same on the local cluster's real node (a kubelet with containerd: kwok's runs no
    containers, so nothing there answers an exec), the workspace a claim of its storage class
    (the controller manager's host-path provisioner); why not, when it cannot run."""
    from services.executor.backends import kubernetes_driver
    from services.localstack.kube_node import NODE_LABEL, NODE_NAME, TAINT
    from services.localstack.kubernetes import STORAGE_CLASS

    try:
        async with bench_namespace(settings) as (path, namespace, core):
            try:
                node = await core.read_node(NODE_NAME)
            except Exception as exc:
                return f"no real node {NODE_NAME} ({type(exc).__name__}; make k8s-node)"
            ready = [c.status for c in node.status.conditions or [] if c.type == "Ready"]
            if ready != ["True"]:
                return f"the real node {NODE_NAME} is not Ready (make k8s-node)"
            update = {
                "driver": "kubernetes", "kube_config": path, "kube_namespace": namespace,
                "kube_node_selector": NODE_LABEL, "kube_tolerations": TAINT,
                "kube_storage_class": STORAGE_CLASS,
            }  # fmt: skip
            driver = kubernetes_driver(settings.model_copy(update=update))
            return await measure(settings, driver, "Kubernetes, real node", n, update)
    except NoCluster as exc:
        return str(exc)


async def main(settings: Settings, n: int = 5) -> None:
    from services.executor.backends import podman_driver

    print("(e) resume and wake-on-exec (HTTP exec → first stdout), one sandbox at a time")
    plain = await measure(settings, podman_driver(settings), "Podman, storage only", n)
    figures = plain + await with_memory(settings, n)
    kube = await on_real_node(settings, n)
    for each in figures + ([] if isinstance(kube, str) else kube):
        print(each.line("s") if each.samples else f"  {each.label}")
    if isinstance(kube, str):
        print(f"  Kubernetes: left out: {kube}")


if __name__ == "__main__":
    asyncio.run(main(Settings()))  # python -m services.bench.wake: this part alone
