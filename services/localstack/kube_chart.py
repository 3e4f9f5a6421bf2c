"""Install the Helm chart on the local Kubernetes cluster's real node (`make k8s-node`) with the
``kubernetes`` driver: ``helm install`` from the image (`make image`), against the local stack's
Kafka and PostgreSQL; sandboxes run as Pods on the same node.

    python -m services.localstack.kube_chart up | down     [--namespace sandstream]

``up`` imports the image into the node's containerd (nothing is pulled), creates the chart's
Secrets in the namespace (those of kube_play: each role's SCRAM credential, the PostgreSQL
password, a new credentials key, a new tokens file whose admin token it writes to
``<state_dir>/kube-play/<release>/admin.token``), and runs ``helm install --wait``: the prepare
hook Job, then every role's Deployment until its Pods are Ready. ``down`` uninstalls the release
and deletes the Secrets, waits until the release's Pods are gone, and removes the tokens file
and the admin token; the namespace stays.

What the local cluster needs of the chart's values, and why:

- ``hostNetwork``: Kafka and PostgreSQL listen on the host's loopback (the address Kafka
  advertises), so the roles run on the host's network, one replica each with a health port of
  its own (kube_play's ports), the API on ``Ports.api``.
- ``nodeSelector`` and ``tolerations``: the real node is tainted (kwok's node, which runs no
  containers, is every other Pod's default); the sandboxes are placed there by the driver's
  ``KUBE_NODE_SELECTOR`` and ``KUBE_TOLERATIONS`` settings.
- ``kubernetesDriver.apiServer``: no kube-proxy runs, so the address the kubelet injects (the
  ``kubernetes`` Service's) reaches nothing; the roles use the kubeconfig's (a loopback
  address: they are on the host's network).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from kubernetes_asyncio import client, config

from services.common.settings import Settings, load_settings
from services.localstack import kube_node, kube_play
from services.localstack.helm_build import helm_path
from services.localstack.image import IMAGE_REPOSITORY, project_version
from services.localstack.kube_node import NODE_LABEL, TAINT, TAINT_KEY
from services.localstack.kube_play import CHART, LocalDeployment, merged
from services.localstack.kubernetes import kubeconfig_path

INSTALL_TIMEOUT = 600  # seconds: the prepare Job and every role's first start, on a busy machine
PODS_GONE_TIMEOUT = 120.0  # seconds: a role drains within its 75 s grace period
TOLERATION = {"key": TAINT_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"}


class ChartError(RuntimeError):
    """A step failed; the message says which, with helm's output and the Pods' states."""


@dataclass(frozen=True)
class ClusterDeployment:
    """One release of the chart on the local cluster: kube_play's names, ports and Secrets, in
    ``namespace``, through ``kubeconfig``."""

    local: LocalDeployment
    namespace: str
    kubeconfig: Path

    @property
    def release(self) -> str:
        return self.local.release


def api_server(kubeconfig: Path) -> tuple[str, int]:
    """The apiserver's host and port in ``kubeconfig`` (its first cluster)."""
    document = yaml.safe_load(kubeconfig.read_text())
    url = urlsplit(document["clusters"][0]["cluster"]["server"])
    if url.hostname is None:
        raise ChartError(f"no apiserver address in {kubeconfig}")
    return url.hostname, url.port or 443


def chart_values(deployment: ClusterDeployment, version: str) -> dict[str, Any]:
    """kube_play's values (host network, one replica per role, the local stack's endpoints),
    with the kubernetes driver on the real node."""
    host, port = api_server(deployment.kubeconfig)
    return merged(
        kube_play.chart_values(deployment.local, version),
        {
            "driver": "kubernetes",
            "kubernetesDriver": {"apiServer": {"host": host, "port": port}},
            "nodeSelector": {TAINT_KEY: "true"},
            "tolerations": [TOLERATION],
            "settings": {"KUBE_NODE_SELECTOR": NODE_LABEL, "KUBE_TOLERATIONS": TAINT},
        },
    )


def helm_flags(values: Mapping[str, Any]) -> list[str]:
    return [f"--set-json={k}={json.dumps(v)}" for k, v in values.items()]


# --------------------------------------------------------------------------- steps


@asynccontextmanager
async def core_api(kubeconfig: Path) -> AsyncIterator[client.CoreV1Api]:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
    )
    async with client.ApiClient(configuration) as api:
        yield client.CoreV1Api(api)


async def up(deployment: ClusterDeployment, timeout: int = INSTALL_TIMEOUT) -> None:
    """The image in the node's containerd, the Secrets, then ``helm install --wait``."""
    settings = deployment.local.settings
    version = project_version()
    await asyncio.to_thread(kube_node.import_image, settings, f"{IMAGE_REPOSITORY}:{version}")
    async with core_api(deployment.kubeconfig) as core:
        await _ensure_namespace(core, deployment.namespace)
        for name, data in kube_play.secret_data(deployment.local).items():
            await _replace_secret(core, deployment.namespace, name, data)
        values = chart_values(deployment, version)
        result = await asyncio.to_thread(
            helm, deployment, "install", deployment.release, str(CHART),
            "--wait", "--timeout", f"{timeout}s", *helm_flags(values),
        )  # fmt: skip
        if result.returncode != 0:
            states = await pod_states(core, deployment.namespace)
            raise ChartError(
                f"helm install failed:\n{result.stderr.strip()}\n"
                f"pods:\n{json.dumps(states, indent=1)}"
            )


async def down(deployment: ClusterDeployment, timeout: int = INSTALL_TIMEOUT) -> None:
    """Uninstall the release, delete the Secrets, and wait until the release's Pods are gone:
    ``helm uninstall --wait`` returns once its own objects are, while the Pods the garbage
    collector deletes after them may still be draining."""
    result = await asyncio.to_thread(
        helm, deployment, "uninstall", deployment.release, "--ignore-not-found",
        "--wait", "--timeout", f"{timeout}s",
    )  # fmt: skip
    async with core_api(deployment.kubeconfig) as core:
        for name in deployment.local.secret_names().values():
            try:
                await core.delete_namespaced_secret(name, deployment.namespace)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        if result.returncode != 0:
            raise ChartError(f"helm uninstall failed:\n{result.stderr.strip()}")
        await _wait_pods_gone(core, deployment, PODS_GONE_TIMEOUT)
    shutil.rmtree(deployment.local.home, ignore_errors=True)  # the tokens file, the admin token


async def _wait_pods_gone(
    core: client.CoreV1Api, deployment: ClusterDeployment, timeout: float
) -> None:
    selector = f"app.kubernetes.io/instance={deployment.release}"
    deadline = time.monotonic() + timeout
    while pods := (
        await core.list_namespaced_pod(deployment.namespace, label_selector=selector)
    ).items:
        if time.monotonic() > deadline:
            names = [p.metadata.name for p in pods]
            raise ChartError(f"the release's Pods still there after {timeout:.0f}s: {names}")
        await asyncio.sleep(0.5)  # the poll interval; the deadline above bounds the wait


def helm(deployment: ClusterDeployment, *args: str) -> subprocess.CompletedProcess[str]:
    binary = helm_path(deployment.local.settings)
    if not binary.exists():
        raise ChartError(f"no helm at {binary}: run `make helm`")
    where = ["--kubeconfig", str(deployment.kubeconfig), "--namespace", deployment.namespace]
    return subprocess.run(
        [str(binary), *args, *where], capture_output=True, text=True, check=False
    )  # fmt: skip


async def pod_states(core: client.CoreV1Api, namespace: str) -> dict[str, Any]:
    """Each Pod's node, phase and containers' states: what a failed wait reports."""
    pods = await core.list_namespaced_pod(namespace)
    found: dict[str, Any] = {}
    for pod in pods.items:
        statuses = [
            *(pod.status.init_container_statuses or []),
            *(pod.status.container_statuses or []),
        ]
        found[pod.metadata.name] = {
            "node": pod.spec.node_name,
            "phase": pod.status.phase,
            "conditions": [f"{c.type}={c.status} {c.message or ''}".strip()
                           for c in pod.status.conditions or []],
            "containers": {s.name: str(s.state.to_dict()) for s in statuses},
        }  # fmt: skip
    return found


async def _ensure_namespace(core: client.CoreV1Api, name: str) -> None:
    try:
        await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    except client.ApiException as exc:
        if exc.status != 409:
            raise


async def _replace_secret(
    core: client.CoreV1Api, namespace: str, name: str, data: Mapping[str, str]
) -> None:
    body = client.V1Secret(
        metadata=client.V1ObjectMeta(name=name), type="Opaque", string_data=dict(data)
    )
    try:
        await core.delete_namespaced_secret(name, namespace)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    await core.create_namespaced_secret(namespace, body)


def local(settings: Settings, namespace: str) -> ClusterDeployment:
    """The deployment ``up`` and ``down`` make: release ``sandstream``, kube_play's ports."""
    kubeconfig = settings.kube_config or kubeconfig_path(settings)
    return ClusterDeployment(LocalDeployment(settings), namespace, kubeconfig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.localstack.kube_chart")
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--namespace", default="sandstream")
    args = parser.parse_args(argv)
    deployment = local(load_settings(), args.namespace)
    try:
        if args.action == "up":
            asyncio.run(up(deployment))
            print(f"sandstream on the real node: API {deployment.local.api_url}, "
                  f"admin token {deployment.local.admin_token_file}")  # fmt: skip
        else:
            asyncio.run(down(deployment))
    except ChartError as exc:
        print(f"kube chart: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
