"""Helpers for the Kubernetes tests: the local cluster (a real kube-apiserver with kwok as the
node, `make k8s` starts it), a namespace per test module, and an admin client for looking (and
reaching) behind the driver's back.

A test module imports the fixtures ``admin_fixture``, ``ns_fixture`` and ``keys_fixture`` to
get ``admin`` and ``ns`` (one each per module) and ``keys`` (per test).

The tests never start a cluster: without one they FAIL with the command that starts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from harness import eventually
from kubernetes_asyncio import client, config

from drivers.kubernetes import KubeConfig, KubernetesDriver
from drivers.protocol import (
    LABEL_KEY,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
)
from services.common.settings import Settings
from services.localstack import kubernetes as local_cluster
from services.localstack.cluster import free_port_run
from services.localstack.kubernetes import STORAGE_CLASS, kubeconfig_path

START_HINT = "run `make k8s` (python -m services.localstack.kubernetes up)"
DRIVER_STOP_TIMEOUT = 5.0
HOLD_FINALIZER = "sandstream.test/hold"
OWN_APISERVER = "kube-apiserver-of-test"  # an OwnApiserver's files: <this>-<owner pid>-<port>


def cluster_kubeconfig(settings: Settings) -> Path:
    """The kubeconfig the tests use: SANDSTREAM_KUBE_CONFIG, else the local cluster's."""
    return settings.kube_config or kubeconfig_path(settings)


@dataclass
class Admin:
    """An admin client of the cluster, with raw (JSON dict) helpers."""

    api: client.ApiClient
    kubeconfig: Path

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    async def _json(self, call: Any) -> Any:
        response = await call
        async with response:
            body = await response.read()
            assert 200 <= response.status < 300, f"HTTP {response.status}: {body[:500]!r}"
            return json.loads(body)

    async def pods(self, namespace: str, key: str) -> list[dict[str, Any]]:
        answer = await self._json(
            self.core.list_namespaced_pod(
                namespace, label_selector=f"{LABEL_KEY}={key}", _preload_content=False
            )
        )
        return sorted(answer["items"], key=lambda p: p["metadata"]["name"])

    async def pod_names(self, namespace: str, key: str) -> list[str]:
        return [p["metadata"]["name"] for p in await self.pods(namespace, key)]

    async def claims(self, namespace: str, key: str) -> list[str]:
        answer = await self._json(
            self.core.list_namespaced_persistent_volume_claim(
                namespace, label_selector=f"{LABEL_KEY}={key}", _preload_content=False
            )
        )
        return sorted(c["metadata"]["name"] for c in answer["items"])

    async def secrets(self, namespace: str, key: str) -> list[dict[str, Any]]:
        answer = await self._json(
            self.core.list_namespaced_secret(
                namespace, label_selector=f"{LABEL_KEY}={key}", _preload_content=False
            )
        )
        return sorted(answer["items"], key=lambda s: s["metadata"]["name"])

    async def events_text(self, namespace: str) -> str:
        """Every event of the namespace, as JSON text (to search for what must not be there)."""
        answer = await self._json(
            self.core.list_namespaced_event(namespace, _preload_content=False)
        )
        return json.dumps(answer["items"])

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self.core.patch_namespaced_pod(name, namespace, patch)

    async def exit_pod(
        self, namespace: str, name: str, code: int, at: datetime | None = None
    ) -> None:
        """The sandbox's container ends with ``code`` (at ``at``: its ``finishedAt``, which
        the watcher reports as the exit's time; default a fixed time), as a kubelet would
        report it (kwok has no containers: the status is written through pods/status)."""
        phase = "Succeeded" if code == 0 else "Failed"
        now = at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if at else "2030-01-01T00:00:00Z"
        status = {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "sandbox",
                    "image": "x",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {
                        "terminated": {
                            "exitCode": code,
                            "reason": "Completed" if code == 0 else "Error",
                            "startedAt": now,
                            "finishedAt": now,
                        }
                    },
                }
            ],
        }
        await self.core.patch_namespaced_pod_status(name, namespace, {"status": status})

    async def hold(self, namespace: str, name: str) -> None:
        """A finalizer nobody removes: the Pod never finishes terminating."""
        await self.patch_pod(namespace, name, {"metadata": {"finalizers": [HOLD_FINALIZER]}})

    async def release(self, namespace: str, name: str) -> None:
        with_404_ok = self.patch_pod(namespace, name, {"metadata": {"finalizers": None}})
        try:
            await with_404_ok
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    async def delete_pod_now(self, namespace: str, name: str) -> None:
        try:
            await self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    async def remove_everything_of(self, namespace: str, key: str) -> None:
        for pod in await self.pods(namespace, key):
            name = pod["metadata"]["name"]
            if pod["metadata"].get("finalizers"):
                await self.release(namespace, name)
            await self.delete_pod_now(namespace, name)
        for secret in await self.secrets(namespace, key):
            with_404_ok = self.core.delete_namespaced_secret(secret["metadata"]["name"], namespace)
            try:
                await with_404_ok
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        for claim in await self.claims(namespace, key):
            with_404_ok = self.core.delete_namespaced_persistent_volume_claim(claim, namespace)
            try:
                await with_404_ok
            except client.ApiException as exc:
                if exc.status != 404:
                    raise


@asynccontextmanager
async def admin_client(settings: Settings) -> AsyncIterator[Admin]:
    """An admin client; fails the test (never skips) when no API server answers."""
    path = cluster_kubeconfig(settings)
    if not path.exists():
        pytest.fail(f"no kubeconfig at {path}: no local Kubernetes cluster; {START_HINT}")
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(path), client_configuration=configuration, persist_config=False
    )
    api = client.ApiClient(configuration)
    try:
        try:
            await asyncio.wait_for(client.VersionApi(api).get_code(), 10)
        except Exception as exc:
            pytest.fail(f"no Kubernetes API server at {configuration.host} ({exc!r}); {START_HINT}")
        yield Admin(api, path)
    finally:
        await api.close()


@asynccontextmanager
async def namespace(admin: Admin, prefix: str = "t") -> AsyncIterator[str]:
    """A fresh namespace (ready for Pods: its default ServiceAccount exists), deleted after."""
    name = f"sst-{prefix}-{uuid.uuid4().hex[:8]}"
    await admin.core.create_namespace({"metadata": {"name": name}})
    try:

        async def has_default_account() -> bool:
            accounts = await admin.core.list_namespaced_service_account(name)
            return any(a.metadata.name == "default" for a in accounts.items)

        await eventually(has_default_account, bool, timeout=30, what=f"{name}/default account")
        yield name
    finally:
        await admin.core.delete_namespace(name)


@pytest_asyncio.fixture(scope="module", loop_scope="session", name="admin")
async def admin_fixture(settings: Settings) -> AsyncIterator[Admin]:
    """The module's admin client."""
    async with admin_client(settings) as admin:
        yield admin


@pytest_asyncio.fixture(scope="module", loop_scope="session", name="ns")
async def ns_fixture(admin: Admin, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The module's namespace, named after it (``sst-<module>-<tag>``), deleted after."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    async with namespace(admin, module) as name:
        yield name


@pytest_asyncio.fixture(loop_scope="session", name="keys")
async def keys_fixture(admin: Admin, ns: str) -> AsyncIterator[Keys]:
    """The test's sandbox names in the module's namespace; their Pods, secrets and claims are
    removed after it."""
    made = Keys(admin, ns, "k")
    try:
        yield made
    finally:
        await made.cleanup()


@dataclass(frozen=True)
class OwnApiserver:
    """An extra kube-apiserver on the local cluster's etcd, for a test that restarts its
    apiserver: the cluster's own apiserver (which the controllers, kwok and every other test
    run use) is never touched."""

    settings: Settings  # kube_apiserver_port is its port
    name: str  # its pid and log files' name
    kubeconfig: Path

    async def restart(self) -> None:
        await asyncio.to_thread(local_cluster.restart_apiserver, self.settings, self.name)

    def pid(self) -> int | None:
        return local_cluster.live_pid(self.settings, self.name)


@asynccontextmanager
async def own_apiserver(settings: Settings, directory: Path) -> AsyncIterator[OwnApiserver]:
    """An OwnApiserver (its kubeconfig in ``directory``), stopped on exit whatever happened;
    after a clean exit, it has checked that nothing of it runs and that the cluster's own
    apiserver is the process it found."""
    if settings.kube_config is not None:
        pytest.fail("an apiserver of its own needs the local cluster, not SANDSTREAM_KUBE_CONFIG")
    shared = shared_apiserver_pid(settings)
    await asyncio.to_thread(stop_orphaned_apiservers, settings)
    port = free_port_run(1)
    server = OwnApiserver(
        settings.model_copy(update={"kube_apiserver_port": port}),
        f"{OWN_APISERVER}-{os.getpid()}-{port}",  # its owner's pid: see below
        directory / "kubeconfig",
    )
    try:
        await asyncio.to_thread(local_cluster.start_apiserver, server.settings, server.name)
        local_cluster.write_kubeconfig(server.settings, server.kubeconfig)
        yield server
    finally:
        await asyncio.to_thread(local_cluster.stop_apiserver, server.settings, server.name)
    assert server.pid() is None, f"{server.name} left running"
    assert shared is not None and shared_apiserver_pid(settings) == shared, "shared one restarted"


def stop_orphaned_apiservers(settings: Settings) -> None:
    """Stop the own apiservers of test runs that are gone (killed before they could stop
    theirs), so none outlives its run for longer than until the next one starts."""
    for pidfile in local_cluster.paths(settings).home.glob(f"{OWN_APISERVER}-*-*.pid"):
        owner = pidfile.stem.split("-")[-2]
        if not Path(f"/proc/{owner}").exists():
            local_cluster.stop_apiserver(settings, pidfile.stem)


def shared_apiserver_pid(settings: Settings) -> int | None:
    """The pid of the local cluster's own apiserver (a test leaves it as it found it)."""
    return local_cluster.live_pid(settings, local_cluster.APISERVER)


def driver_config(admin: Admin, ns: str, **overrides: Any) -> KubeConfig:
    values: dict[str, Any] = {
        "namespace": ns,
        "kubeconfig": admin.kubeconfig,
        "storage_class": STORAGE_CLASS,
        "stop_timeout": DRIVER_STOP_TIMEOUT,
        "launch_timeout": 30.0,
        "removal_margin": 10.0,
    }
    values.update(overrides)
    return KubeConfig(**values)


def new_driver(admin: Admin, ns: str, **overrides: Any) -> KubernetesDriver:
    return KubernetesDriver(driver_config(admin, ns, **overrides))


class Keys:
    """Unique sandbox names; ``cleanup()`` removes their Pods (finalizers first) and claims."""

    def __init__(self, admin: Admin, ns: str, prefix: str) -> None:
        self.admin, self.ns, self.prefix = admin, ns, prefix
        self.made: list[str] = []

    def __call__(self) -> str:
        self.made.append(f"{self.prefix}-{uuid.uuid4().hex[:8]}")
        return self.made[-1]

    async def cleanup(self) -> None:
        for key in self.made:
            await self.admin.remove_everything_of(self.ns, key)


async def wait_pods(
    admin: Admin,
    ns: str,
    key: str,
    check: Callable[[list[dict[str, Any]]], bool],
    what: str,
    timeout: float = 30.0,
) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = await eventually(
        lambda: admin.pods(ns, key), check, timeout=timeout, what=f"{key}: {what}"
    )
    return found


def phase_of(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("phase")


def env_of(pod: Mapping[str, Any]) -> dict[str, str]:
    container = pod["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def kube_env(settings: Settings) -> dict[str, str]:
    """Environment variables pointing a subprocess at the tests' cluster."""
    return {**os.environ, "SANDSTREAM_KUBE_CONFIG": str(cluster_kubeconfig(settings))}


class HoldingDriver:
    """A KubernetesDriver whose watch holds back everything it reports of chosen keys until
    ``release(key)``: late delivery made deterministic. The rest is the real driver."""

    def __init__(self, inner: KubernetesDriver) -> None:
        self.inner = inner
        self.holding: set[str] = set()
        self.held: list[WatchObservation] = []
        self._queues: list[asyncio.Queue[WatchObservation | BaseException]] = []

    def hold(self, key: str) -> None:
        self.holding.add(key)

    def held_of(self, key: str) -> list[WatchObservation]:
        return [o for o in self.held if o.key == key]

    def release(self, key: str) -> list[WatchObservation]:
        """Stop holding ``key`` and deliver what was held, in order; returns it."""
        self.holding.discard(key)
        released = self.held_of(key)
        self.held = [o for o in self.held if o.key != key]
        for queue in self._queues:
            for observation in released:
                queue.put_nowait(observation)
        return released

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        return await self.inner.launch(spec)

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self.inner.stop(key, generation, timeout)

    async def suspend(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self.inner.suspend(key, generation, timeout)

    async def kill(self, key: str, generation: int) -> OpResult:
        return await self.inner.kill(key, generation)

    async def delete(self, key: str, sandbox_id: uuid.UUID | None = None) -> bool:
        return await self.inner.delete(key, sandbox_id)

    async def get(self, key: str) -> list[RuntimeInfo]:
        return await self.inner.get(key)

    async def list(self) -> list[RuntimeInfo]:
        return await self.inner.list()

    async def close(self) -> None:
        await self.inner.close()

    async def watch(self) -> AsyncIterator[WatchObservation]:
        queue: asyncio.Queue[WatchObservation | BaseException] = asyncio.Queue()
        self._queues.append(queue)

        async def pump() -> None:
            try:
                async for observation in self.inner.watch():
                    if observation.key in self.holding:
                        self.held.append(observation)
                    else:
                        queue.put_nowait(observation)
            except Exception as exc:  # handed to the reader, which raises it
                queue.put_nowait(exc)

        task = asyncio.create_task(pump())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()
            self._queues.remove(queue)
