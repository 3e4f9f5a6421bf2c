"""What the peer benchmark runs on, started for the run and stopped after it.

- **A Kubernetes cluster of its own**: the local cluster (services/localstack/kubernetes.py:
  etcd, kube-apiserver, controller manager, scheduler, kwok as the node) started fresh from
  empty etcd in a state dir and on ports of the run's own, so that other work on the shared
  cluster neither slows the run nor counts in the apiserver's figures; stopped afterwards.
- **agent-sandbox's controller** (services/localstack/agent_sandbox.py builds it): its CRDs
  (Sandbox; the extensions' SandboxTemplate, SandboxWarmPool, SandboxClaim) and ClusterRoles
  applied, run out of cluster as its own ServiceAccount: with its stock flags for the cold
  phases, restarted with ``--extensions`` for the warm one.
- **sandstream**: ``sandstream up --driver kubernetes`` in a process of its own, as its own
  ServiceAccount (compose/kubernetes/rbac.yaml) in its namespace, on a Kafka broker of the
  run's own (so that the broker's CPU is sandstream's alone) and the machine's PostgreSQL, in
  an isolated environment (own topics and schema).
- **The load generator's account**: a ServiceAccount allowed to create and delete Pods,
  Sandboxes, SandboxTemplates, SandboxWarmPools and SandboxClaims, so that the bench's own
  requests go through the same API priority and fairness as the controllers' (the admin
  token is exempt from it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.bench.peer_kube import Kube, yaml_documents
from services.common.settings import PROJECT_ROOT, Settings
from services.localstack import agent_sandbox, kubernetes, private_broker, stack
from services.localstack.isolation import isolated

SANDSTREAM_RBAC = PROJECT_ROOT / "compose" / "kubernetes" / "rbac.yaml"
AGENT_NAMESPACE = "agent-sandbox-system"
AGENT_ACCOUNT = "agent-sandbox-controller"
CLIENT_NAMESPACE = "bench-client"
CLIENT_ACCOUNT = "bench-client"
START_TIMEOUT = 120.0


def _say(message: str) -> None:
    print(f"peer: {message}", file=sys.stderr, flush=True)


def free_port(pair: bool = False) -> int:
    """A free loopback port (``pair``: and the one after it, for etcd's peer listener)."""
    while True:
        port = private_broker.free_port()
        if not pair or _free(port + 1):
            return port


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_settings(base: Settings, home: Path) -> Settings:
    """The settings of the run's own cluster: its state dir and free ports."""
    return base.model_copy(
        update={
            "state_dir": home,
            "kube_apiserver_port": free_port(),
            "kube_etcd_port": free_port(pair=True),
            "kube_kwok_port": free_port(),
        }
    )


def kubeconfig_for(cluster: Settings, token: str, path: Path) -> Path:
    pki = kubernetes.paths(cluster).pki
    text = kubernetes.render_kubeconfig(
        f"https://127.0.0.1:{cluster.kube_apiserver_port}", (pki / "ca.crt").read_bytes(), token
    )
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


@dataclass
class Cluster:
    settings: Settings
    admin: Kube

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.settings.kube_apiserver_port}"

    @property
    def ca_file(self) -> Path:
        return kubernetes.paths(self.settings).pki / "ca.crt"

    def pids(self) -> dict[str, list[int]]:
        """The cluster's processes by component (those running)."""
        found = {}
        for name in kubernetes.COMPONENTS:
            pid = kubernetes.live_pid(self.settings, name)
            found[name] = [pid] if pid else []
        return found

    async def account(self, namespace: str, name: str, path: Path) -> tuple[str, Path]:
        """A ServiceAccount's token and a kubeconfig holding it."""
        token = await self.admin.token(namespace, name)
        return token, kubeconfig_for(self.settings, token, path)


@asynccontextmanager
async def own_cluster(base: Settings, home: Path) -> AsyncIterator[Cluster]:
    settings = cluster_settings(base, home)
    starting = asyncio.ensure_future(asyncio.to_thread(kubernetes.up, settings))
    try:
        await asyncio.shield(starting)
    except BaseException:  # cancelled (SIGTERM) or failed: what the start began is stopped
        with contextlib.suppress(Exception):
            await starting  # the thread goes on starting components until it returns
        await asyncio.to_thread(kubernetes.down, settings)
        raise
    token = (kubernetes.paths(settings).pki / "token").read_text().strip()
    admin = Kube(
        f"https://127.0.0.1:{settings.kube_apiserver_port}",
        kubernetes.paths(settings).pki / "ca.crt",
        token,
        connections=4,
    )
    try:
        yield Cluster(settings, admin)
    finally:
        await admin.close()
        await asyncio.to_thread(kubernetes.down, settings)


async def client_account(cluster: Cluster, home: Path) -> str:
    """The load generator's ServiceAccount (Pods, Sandboxes and the extensions' objects in
    every namespace); its token."""
    admin = cluster.admin
    await admin.ensure_namespace(CLIENT_NAMESPACE)
    await admin.create(
        f"/api/v1/namespaces/{CLIENT_NAMESPACE}/serviceaccounts",
        {"metadata": {"name": CLIENT_ACCOUNT}},
        exist_ok=True,
    )
    verbs = ["create", "delete", "get", "list", "watch"]
    await admin.create(
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        {"metadata": {"name": CLIENT_ACCOUNT},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": verbs},
                   {"apiGroups": [agent_sandbox.GROUP], "resources": ["sandboxes"],
                    "verbs": verbs},
                   {"apiGroups": [agent_sandbox.EXTENSIONS_GROUP],
                    "resources": ["sandboxtemplates", "sandboxwarmpools", "sandboxclaims"],
                    "verbs": verbs}]},
        exist_ok=True,
    )  # fmt: skip
    await _bind_cluster_role(admin, CLIENT_ACCOUNT, CLIENT_NAMESPACE, CLIENT_ACCOUNT)
    token, _ = await cluster.account(CLIENT_NAMESPACE, CLIENT_ACCOUNT, home / "client.kubeconfig")
    return token


async def _bind_cluster_role(admin: Kube, role: str, namespace: str, account: str) -> None:
    await admin.create(
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {"metadata": {"name": role},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": role},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
        exist_ok=True,
    )  # fmt: skip


# ------------------------------------------------------------------------------ processes


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip


async def _stop(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.to_thread(proc.wait, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        await asyncio.to_thread(proc.wait, 10)


async def _until_ok(url: str, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited (code {proc.returncode}); see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {START_TIMEOUT:.0f}s; see {log}")
            await asyncio.sleep(0.2)


@dataclass
class Controller:
    """agent-sandbox's controller process; ``restart`` runs it again, with its extensions or
    without."""

    binary: Path
    kubeconfig: Path
    home: Path
    proc: subprocess.Popen[bytes] | None = None
    extensions: bool = False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def restart(self, extensions: bool) -> None:
        await self.stop()
        probe = free_port()
        which = "-extensions" if extensions else ""
        log = self.home / f"agent-sandbox-controller{which}.log"
        command = agent_sandbox.controller_command(
            self.binary, self.kubeconfig, free_port(), probe, extensions=extensions
        )
        self.proc, self.extensions = _spawn(command, log), extensions
        await _until_ok(f"http://127.0.0.1:{probe}/readyz", self.proc, "agent-sandbox", log)

    async def stop(self) -> None:
        if self.proc is not None:
            await _stop(self.proc)


@asynccontextmanager
async def agent_controller(
    cluster: Cluster, home: Path, extensions: bool
) -> AsyncIterator[Controller]:
    """agent-sandbox's controller (``extensions``: with them) as its own ServiceAccount, every
    CRD and role of the module applied (the extensions' too, so that a restart with them
    needs nothing more)."""
    built = await asyncio.to_thread(agent_sandbox.build, cluster.settings, _say)
    admin = cluster.admin
    for name in agent_sandbox.MANIFESTS:
        for kind, text in yaml_documents(built.manifest(name).read_text()):
            await admin.apply_yaml(kind, text)
    async with asyncio.timeout(START_TIMEOUT):
        for crd in agent_sandbox.CRD_NAMES:
            while not _established(
                await admin.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
            ):
                await asyncio.sleep(0.1)
    await admin.ensure_namespace(AGENT_NAMESPACE)
    await admin.create(
        f"/api/v1/namespaces/{AGENT_NAMESPACE}/serviceaccounts",
        {"metadata": {"name": AGENT_ACCOUNT}},
        exist_ok=True,
    )
    for role in agent_sandbox.ROLES:
        await _bind_cluster_role(admin, role, AGENT_NAMESPACE, AGENT_ACCOUNT)
    _, kubeconfig = await cluster.account(AGENT_NAMESPACE, AGENT_ACCOUNT, home / "agent.kubeconfig")
    controller = Controller(built.controller, kubeconfig, home)
    try:
        await controller.restart(extensions)
        yield controller
    finally:
        await controller.stop()


def _established(crd: dict[str, object]) -> bool:
    conditions = (crd.get("status") or {}).get("conditions") or []  # type: ignore[attr-defined]
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


@dataclass
class Sandstream:
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    broker: int  # the private broker's pid
    settings: Settings  # the isolated environment's


@dataclass
class Kafka:
    """A broker of the run's own, booting: ``ready()`` waits for it."""

    settings: Settings
    proc: subprocess.Popen[bytes]

    async def ready(self) -> None:
        """Until it answers and its users exist (the JVM boots for minutes on a loaded
        machine: each wait of the stack's is tried again while the broker runs)."""
        deadline = time.monotonic() + 5 * START_TIMEOUT
        while True:
            try:
                await asyncio.to_thread(private_broker.wait_ready, self.settings, self.proc)
                return
            except stack.StackError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise


@asynccontextmanager
async def private_kafka(base: Settings, home: Path) -> AsyncIterator[Kafka]:
    """A broker of the run's own (the local stack's configuration and heap), started now and
    stopped afterwards: its CPU is then sandstream's alone."""
    settings = private_broker.private_settings(
        base, home, kafka_heap=base.kafka_heap, pg_password_file=base.pg_password_path
    )
    proc = private_broker.start(settings)
    try:
        yield Kafka(settings, proc)
    finally:
        await asyncio.to_thread(private_broker.stop, proc)


@asynccontextmanager
async def sandstream(
    kafka: Kafka, cluster: Cluster, home: Path, namespace: str
) -> AsyncIterator[Sandstream]:
    """``sandstream up --driver kubernetes`` on ``kafka``, in an isolated environment (its own
    schema and topics), as its own ServiceAccount in ``namespace``."""
    admin = cluster.admin
    await admin.ensure_namespace(namespace)
    for kind, text in yaml_documents(SANDSTREAM_RBAC.read_text(), namespace=namespace):
        await admin.apply_yaml(kind, text, namespace)
    _, kubeconfig = await cluster.account(namespace, "sandstream", home / "sandstream.kubeconfig")
    await kafka.ready()
    async with isolated(kafka.settings, "peer") as (s, _):
        port = free_port()
        run_dir = home / "sandstream"
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **s.as_env(), "SANDSTREAM_RUN_DIR": str(run_dir)}
        cmd = [
            sys.executable, "-m", "services.cli", "up", "--no-stack", "--driver", "kubernetes",
            "--kubeconfig", str(kubeconfig), "--namespace", namespace, "--port", str(port),
            "--no-openshell",
        ]  # fmt: skip
        log = home / "sandstream-up.log"
        proc = _spawn(cmd, log, env)
        url = f"http://127.0.0.1:{port}"
        try:
            await _until_ok(f"{url}/readyz", proc, "sandstream up", log)
            token = (run_dir / "admin.token").read_text().strip()
            yield Sandstream(proc, url, token, kafka.proc.pid, s)
        finally:
            await _stop(proc)


def remove(home: Path) -> None:
    shutil.rmtree(home, ignore_errors=True)
