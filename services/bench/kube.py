"""Create and stop latency of the whole pipeline, Podman beside Kubernetes (part of
``make bench``; figures printed, never asserted).

Each sandbox is timed from its command being published to its row reaching the phase:
CreateSandbox → Ready, then StopSandbox → Stopped, then SuspendSandbox → Suspended and
ResumeSandbox → Ready (a new generation on the kept workspace: the volume on Podman, the claim
of the local cluster's storage class on Kubernetes), one sandbox at a time. Podman runs real
containers (`sleep` under catatonit); Kubernetes is the local cluster of `make k8s`
(a real kube-apiserver, kwok as the node: no containers, so its figures are the control path
alone: API calls, scheduling, watch events). The Kubernetes part is left out, with a note,
when no cluster answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from drivers.protocol import Driver
from events.commands import CreateSandbox, DeleteSandbox, ResumeSandbox, StopSandbox, SuspendSandbox
from events.common import SandboxSpec
from events.publisher import CommandPublisher
from services.bench.drivers import Figures, Rows, _cmd, timed
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack.isolation import isolated
from services.up.control_plane import ControlPlane

SAMPLES = 10
STOP_TIMEOUT = 3


async def create_and_stop(
    settings: Settings, label: str, driver: Driver, image: str, samples: int = SAMPLES
) -> list[Figures]:
    keys = [f"bench-{label}-{uuid.uuid4().hex[:6]}-{i}" for i in range(samples)]
    spec = SandboxSpec(image=image, command=["sleep", "3600"], stop_timeout_seconds=STOP_TIMEOUT)
    async with isolated(settings, "benchk", kafka_partitions=4) as (s, pool):
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600)
        rows = await Rows.open(s, pool)
        await plane.start()
        try:
            async with CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands) as pub:
                created = [
                    await timed(pub, rows, _cmd(CreateSandbox, k, spec=spec), "Ready") for k in keys
                ]
                stopped = [await timed(pub, rows, _cmd(StopSandbox, k), "Stopped") for k in keys]
                resumed = []
                for key in keys:  # a Stopped sandbox suspends at once: no runtime to remove
                    await timed(pub, rows, _cmd(SuspendSandbox, key), "Suspended")
                    resumed.append(await timed(pub, rows, _cmd(ResumeSandbox, key), "Ready"))
                for key in keys:
                    await pub.publish(_cmd(DeleteSandbox, key))
                for key in keys:
                    await rows.until(key, "Deleted")
        finally:
            await plane.stop()
            await rows.close()
            await driver.close()
    return [
        Figures(f"{label}: create → Ready", created),
        Figures(f"{label}: stop → Stopped", stopped),
        Figures(f"{label}: resume → Ready (kept workspace)", resumed),
    ]


class NoCluster(Exception):
    """No usable local cluster: why."""


@contextlib.asynccontextmanager
async def bench_namespace(settings: Settings) -> AsyncIterator[tuple[Path, str, Any]]:
    """The local cluster's kubeconfig, a namespace of this run's own (its default
    ServiceAccount made; deleted afterwards) and a CoreV1Api; NoCluster when none answers."""
    from kubernetes_asyncio import client, config

    from services.localstack.kubernetes import kubeconfig_path

    path = settings.kube_config or kubeconfig_path(settings)
    if not path.exists():
        raise NoCluster(f"no kubeconfig at {path} (make k8s)")
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(path), client_configuration=configuration, persist_config=False
    )
    namespace = f"sandstream-bench-{uuid.uuid4().hex[:6]}"
    async with client.ApiClient(configuration) as api:
        core = client.CoreV1Api(api)
        try:
            await core.create_namespace(
                client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
            )
        except Exception as exc:  # any failure here means: no usable cluster
            raise NoCluster(f"no cluster at {configuration.host} ({type(exc).__name__})") from exc
        try:
            for _ in range(100):  # the controller manager makes the default ServiceAccount
                accounts = await core.list_namespaced_service_account(namespace)
                if any(a.metadata.name == "default" for a in accounts.items):
                    break
                await asyncio.sleep(0.1)
            yield path, namespace, core
        finally:
            await core.delete_namespace(namespace)


async def _kubernetes(settings: Settings) -> list[Figures] | str:
    from drivers.kubernetes import KubeConfig, KubernetesDriver
    from services.localstack.kubernetes import STORAGE_CLASS

    try:
        async with bench_namespace(settings) as (path, namespace, _):
            driver = KubernetesDriver(
                KubeConfig(
                    namespace=namespace,
                    kubeconfig=path,
                    storage_class=STORAGE_CLASS,
                    stop_timeout=STOP_TIMEOUT,
                )
            )
            return await create_and_stop(settings, "kubernetes", driver, settings.sandbox_image)
    except NoCluster as exc:
        return str(exc)


async def main(settings: Settings) -> None:
    from services.executor.backends import podman_driver

    print("(c) create and stop latency, Podman beside Kubernetes (one sandbox at a time)")
    podman = podman_driver(settings, stop_timeout=STOP_TIMEOUT)
    for figures in await create_and_stop(settings, "podman", podman, settings.sandbox_image):
        print(figures.line("ms"))
    kube = await _kubernetes(settings)
    if isinstance(kube, str):
        print(f"  kubernetes: left out: {kube}")
    else:
        for figures in kube:
            print(figures.line("ms", "(kwok node: no containers)"))


if __name__ == "__main__":
    asyncio.run(main(Settings()))  # python -m services.bench.kube: this part alone
