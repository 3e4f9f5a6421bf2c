"""``python -m services.bench kube-requests [--sandboxes N]``: what one sandbox costs the
apiserver through the Kubernetes driver alone, beside bare Pods, in one run.

Both run against a kube-apiserver of the bench's own on the local cluster's etcd (`make k8s`),
which no other client uses: its ``apiserver_request_total`` counts exactly the requests of the
driver or of the bare-Pod client (the scheduler, kwok and the controllers talk to the
cluster's own apiserver, and do the same for both: the Pods are the same). Each side creates N
sandboxes at once, waits until all are Ready (running), deletes them and waits until they are
gone; its requests are read before and after, while its one shared watch is still open (a
watch request is counted when it ends, so a watch per sandbox counts, a shared one does not).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivers.kubernetes import KubeConfig, KubernetesDriver
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.bench.peer_kube import Kube
from services.bench.peer_stats import counts_delta, pod_ready, render_rows, request_counts
from services.bench.peer_systems import COMMAND, pod_spec
from services.common.settings import Settings
from services.localstack import kubernetes as local_cluster
from services.localstack.cluster import free_port_run

# The resources either side asks about; the rest (e.g. GET /metrics) is the bench's own.
RESOURCES = frozenset({"pods", "secrets", "persistentvolumeclaims"})
Counts = dict[tuple[str, str], float]


@dataclass(frozen=True)
class Costs:
    """One side's requests for ``sandboxes`` sandboxes, by (verb, resource)."""

    sandboxes: int
    requests: Mapping[tuple[str, str], float]

    @property
    def per_sandbox(self) -> float:
        return sum(self.requests.values()) / self.sandboxes

    def beyond_create_and_delete(self) -> float:
        """Every request but the Pods' creates and deletes (which bare Pods make too)."""
        return sum(
            n for (verb, res), n in self.requests.items()
            if (verb, res) not in (("POST", "pods"), ("DELETE", "pods"))
        )  # fmt: skip

    def line(self) -> str:
        ranked = sorted(self.requests.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{v} {r} {n / self.sandboxes:.2f}" for (v, r), n in ranked)


async def counts(kube: Kube) -> Counts:
    return {k: v for k, v in request_counts(await kube.metrics()).items() if k[1] in RESOURCES}


def launch_specs(image: str, n: int) -> list[LaunchSpec]:
    tag = uuid.uuid4().hex[:6]
    return [
        LaunchSpec(key=f"req-{tag}-{i}", sandbox_id=uuid.uuid4(), generation=1,
                   identity=f"rid-{tag}-{i}", spec=SandboxSpec(image=image, command=COMMAND))
        for i in range(n)
    ]  # fmt: skip


async def driver_costs(kube: Kube, cfg: KubeConfig, image: str, n: int) -> Costs:
    """N sandboxes launched at once (each call returns once its Pod runs), then deleted at
    once, by one driver."""
    specs = launch_specs(image, n)
    driver = KubernetesDriver(cfg)
    try:
        before = await counts(kube)
        await asyncio.gather(*(driver.launch(s) for s in specs))
        await asyncio.gather(*(driver.delete(s.key, s.sandbox_id) for s in specs))
        after = await counts(kube)
    finally:
        await driver.close()
    return Costs(n, counts_delta(before, after))


async def bare_costs(kube: Kube, namespace: str, image: str, n: int) -> Costs:
    """N Pods of the driver's shape created at once, Ready as one watch of them shows, deleted
    at once, gone as that watch shows: the cluster's own floor."""
    path = f"/api/v1/namespaces/{namespace}/pods"
    tag = uuid.uuid4().hex[:6]
    names = {f"bare-{tag}-{i}" for i in range(n)}
    ready: set[str] = set()
    gone: set[str] = set()
    changed = asyncio.Event()

    def seen(kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            gone.add(name)
        elif pod_ready(pod):
            ready.add(name)
        changed.set()

    async def until(done: set[str]) -> None:
        async with asyncio.timeout(120):
            while not names <= done:
                changed.clear()
                await changed.wait()

    before = await counts(kube)
    watch = asyncio.ensure_future(kube.watch(path, seen, await kube.resource_version(path)))
    try:
        body = {"apiVersion": "v1", "kind": "Pod", "spec": pod_spec(image)}
        await asyncio.gather(*(kube.create(path, {**body, "metadata": {"name": m}}) for m in names))
        await until(ready)
        await asyncio.gather(*(kube.delete(f"{path}/{m}") for m in names))
        await until(gone)
        after = await counts(kube)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    return Costs(n, counts_delta(before, after))


def kube_client(settings: Settings, port: int) -> Kube:
    """The bench's client of the apiserver on ``port`` of the local cluster (its admin
    token)."""
    pki = local_cluster.paths(settings).pki
    token = (pki / "token").read_text().strip()
    return Kube(f"https://127.0.0.1:{port}", pki / "ca.crt", token)


@asynccontextmanager
async def own_apiserver(settings: Settings, home: Path) -> AsyncIterator[tuple[int, Path]]:
    """An extra kube-apiserver on the local cluster's etcd: (its port, its kubeconfig)."""
    port = free_port_run(1)
    own = settings.model_copy(update={"kube_apiserver_port": port})
    name = f"kube-apiserver-bench-{os.getpid()}-{port}"
    kubeconfig = home / f"{name}.kubeconfig"
    try:
        await asyncio.to_thread(local_cluster.start_apiserver, own, name)
        local_cluster.write_kubeconfig(own, kubeconfig)
        yield port, kubeconfig
    finally:
        await asyncio.to_thread(local_cluster.stop_apiserver, own, name)
        kubeconfig.unlink(missing_ok=True)


def table(ours: Costs, bare: Costs) -> str:
    extra = [c.beyond_create_and_delete() / c.sandboxes for c in (ours, bare)]
    rows = [
        ["", "driver", "bare Pods", "driver/bare"],
        ["requests / sandbox", f"{ours.per_sandbox:.2f}", f"{bare.per_sandbox:.2f}",
         f"{ours.per_sandbox / bare.per_sandbox:.2f}"],
        ["beyond create + delete, / sandbox", f"{extra[0]:.2f}", f"{extra[1]:.2f}", ""],
    ]  # fmt: skip
    return render_rows(rows)


async def main(settings: Settings, sandboxes: int) -> None:
    home = settings.state_dir / "bench"
    home.mkdir(parents=True, exist_ok=True)
    namespace = f"bench-req-{uuid.uuid4().hex[:6]}"
    async with own_apiserver(settings, home) as (port, kubeconfig):
        kube = kube_client(settings, port)
        try:
            await kube.ensure_namespace(namespace)
            cfg = KubeConfig(namespace=namespace, kubeconfig=kubeconfig)
            bare = await bare_costs(kube, namespace, settings.sandbox_image, sandboxes)
            ours = await driver_costs(kube, cfg, settings.sandbox_image, sandboxes)
            print(
                f"apiserver requests per sandbox, {sandboxes} sandboxes at once, create → Ready "
                "→ delete → gone (an apiserver of the bench's own: only these clients)"
            )
            print(table(ours, bare))
            print(f"  driver:    {ours.line()}")
            print(f"  bare Pods: {bare.line()}")
        finally:
            await kube.delete(f"/api/v1/namespaces/{namespace}")
            await kube.close()
