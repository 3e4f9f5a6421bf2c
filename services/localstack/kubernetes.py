"""A real Kubernetes control plane on loopback, for the Kubernetes driver's tests and local runs.

    python -m services.localstack.kubernetes up | down | status | build | env

``up`` builds what is missing (services/localstack/kube_build.py: ~10 minutes on the first run,
cached outside the clone afterwards), then starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (the fake node: Pods reach Running without a kubelet or containers),
registers one fake node, creates the ``sandstream-local`` StorageClass (the controller manager's
hostPath provisioner) and writes an admin kubeconfig; a running cluster is left as it is.
``down`` stops the processes by the pids ``up`` saved, and nothing else. ``env`` prints
``export KUBECONFIG=...``.

Ports (settings): apiserver 16443, etcd 16379/16380, kwok 16247; the controller manager and
the scheduler serve no port. Both talk to the apiserver at up to ``CLIENT_QPS`` requests a
second (their stock limits, 20 and 50, made deleting 300 Pods take 14.4 s instead of 2.4-3.4:
a burst measured against the cluster's own throttles rather than against the apiserver).
Another state dir and other ports (a copy of the settings) make a second cluster beside the
first: the peer benchmark starts one of its own so. Runtime files (certificates, etcd data,
logs, pids, kubeconfig) live under ``settings.state_dir/kubernetes``; each ``up`` of a stopped
cluster starts from an empty etcd.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.common.settings import Settings, load_settings
from services.localstack import kube_node
from services.localstack.kube_build import BuildError, KubeBinaries, binaries, build
from services.localstack.processes import StackError

START_TIMEOUT = 120.0
STOP_TIMEOUT = 20.0
NODE_NAME = "kwok-node-0"
STORAGE_CLASS = "sandstream-local"
# Started in this order, stopped in the reverse one (etcd last).
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
APISERVER = "kube-apiserver"
CLIENT_QPS = 500  # and burst: the controller manager's and the scheduler's client limits


class ClusterError(RuntimeError):
    """The cluster could not be built or started; the message says which part and why."""


def _say(message: str) -> None:
    print(f"kubernetes: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ClusterPaths:
    home: Path

    @property
    def pki(self) -> Path:
        return self.home / "pki"

    @property
    def etcd_data(self) -> Path:
        return self.home / "etcd-data"

    @property
    def kubeconfig(self) -> Path:
        return self.home / "kubeconfig"

    def log(self, component: str) -> Path:
        return self.home / f"{component}.log"

    def pid(self, component: str) -> Path:
        return self.home / f"{component}.pid"

    @property
    def scheduler_config(self) -> Path:
        return self.home / "kube-scheduler.yaml"


def paths(settings: Settings) -> ClusterPaths:
    return ClusterPaths(settings.state_dir / "kubernetes")


def kubeconfig_path(settings: Settings) -> Path:
    """Where `up` writes the admin kubeconfig of the local cluster."""
    return paths(settings).kubeconfig


# --------------------------------------------------------------------------- command lines


def component_command(name: str, settings: Settings, bins: KubeBinaries) -> list[str]:
    """The command line of one component (pure: paths and ports from settings)."""
    p = paths(settings)
    pki = p.pki
    etcd_url = f"http://127.0.0.1:{settings.kube_etcd_port}"
    peer_url = f"http://127.0.0.1:{settings.kube_etcd_port + 1}"
    if name == "etcd":
        return [
            str(bins.etcd),
            "--name=local",
            f"--data-dir={p.etcd_data}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=local={peer_url}",
            "--unsafe-no-fsync",  # a throwaway store for tests: no fsync per write
            "--quota-backend-bytes=2147483648",
        ]
    if name == "kube-apiserver":
        return [
            str(bins.kube("kube-apiserver")),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            f"--secure-port={settings.kube_apiserver_port}",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",  # required with a loopback advertise address
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--kubelet-preferred-address-types=InternalIP,Hostname",  # no DNS knows a node
            "--profiling=false",
        ]
    kubeconfig = f"--kubeconfig={p.kubeconfig}"
    if name == "kube-controller-manager":
        return [
            str(bins.kube("kube-controller-manager")),
            kubeconfig,
            "--secure-port=0",
            "--leader-elect=false",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=false",
            f"--kube-api-qps={CLIENT_QPS}",
            f"--kube-api-burst={CLIENT_QPS}",
            # The in-tree hostPath provisioner (for tests only): claims of the sandstream-local
            # class get a volume, so Pods that use them can be scheduled.
            "--enable-hostpath-provisioner",
            "--controllers=*",
        ]
    if name == "kube-scheduler":
        # Its kubeconfig, client limits and leader election are in the file (scheduler_config):
        # with --config the scheduler ignores the flags of the same settings.
        return [
            str(bins.kube("kube-scheduler")),
            f"--config={p.scheduler_config}",
            "--secure-port=0",
        ]
    if name == "kwok":
        return [
            str(bins.kwok),
            kubeconfig,
            f"--config={bins.kwok_stages}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-ip=127.0.0.1",
            "--cidr=10.244.0.0/16",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{settings.kube_kwok_port}",
        ]
    raise ValueError(f"unknown component {name!r}")


def render_kubeconfig(server: str, ca_pem: bytes, token: str) -> str:
    ca = base64.b64encode(ca_pem).decode()
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: local\n  cluster:\n    server: {server}\n"
        f"    certificate-authority-data: {ca}\n"
        f"users:\n- name: admin\n  user:\n    token: {token}\n"
        "contexts:\n- name: local\n  context:\n    cluster: local\n    user: admin\n"
        "current-context: local\n"
    )


def scheduler_config(kubeconfig: Path) -> str:
    """The scheduler's KubeSchedulerConfiguration: the cluster, raised client limits, no
    leader election (one scheduler)."""
    return (
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
        f"clientConnection:\n  kubeconfig: {kubeconfig}\n"
        f"  qps: {CLIENT_QPS}\n  burst: {CLIENT_QPS}\n"
        "leaderElection:\n  leaderElect: false\n"
    )


NODE_MANIFEST: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {
        "name": NODE_NAME,
        # kwok manages nodes with this annotation; ttl 0: no node-lease caching delays
        "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        "labels": {
            "type": "kwok",
            "kubernetes.io/hostname": NODE_NAME,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        },
    },
}
STORAGE_CLASS_MANIFEST: dict[str, Any] = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {"name": STORAGE_CLASS},
    "provisioner": "kubernetes.io/host-path",
    "reclaimPolicy": "Delete",
    "volumeBindingMode": "Immediate",
}


# --------------------------------------------------------------------------- processes


def _live_pid(pidfile: Path) -> int | None:
    """The recorded pid if that process still runs the binary recorded with it."""
    try:
        pid_text, _, exe = pidfile.read_text().strip().partition(" ")
        pid = int(pid_text)
        running = os.readlink(f"/proc/{pid}/exe")
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    if state in ("Z", "X") or running != exe:
        return None
    return pid


def _exited(pid: int) -> bool:
    """The process is gone, or a zombie whose threads have all ended: its files (and so its
    ports) are closed. Its exe link disappears earlier, while it is still exiting, and its main
    thread turns zombie while the others still run."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (OSError, IndexError):
        return True
    return state in ("Z", "X") and threads <= 1


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _spawn(name: str, settings: Settings, cmd: list[str]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` detached, its log and pid file named ``name``."""
    p = paths(settings)
    with p.log(name).open("ab") as out:
        out.write(f"\n--- {time.strftime('%F %T')} starting: {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=p.home,
            start_new_session=True,
        )
    p.pid(name).write_text(f"{proc.pid} {os.path.realpath(cmd[0])}\n")
    return proc


def _stop(name: str, settings: Settings, sig: signal.Signals = signal.SIGTERM) -> bool:
    """Signal the recorded process (SIGKILL after a while); False if it was not running."""
    pidfile = paths(settings).pid(name)
    pid = _live_pid(pidfile)
    if pid is None:
        pidfile.unlink(missing_ok=True)
        return False
    os.kill(pid, sig)
    deadline = time.monotonic() + STOP_TIMEOUT
    while not _exited(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + STOP_TIMEOUT
        time.sleep(0.05)
    pidfile.unlink(missing_ok=True)
    return True


def _wait(
    ready: Callable[[], bool], *, what: str, component: str, settings: Settings, proc: Any = None
) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise ClusterError(
                f"{component} exited (code {proc.returncode}) {_tail(component, settings)}"
            )
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out waiting for {what} {_tail(component, settings)}")
        time.sleep(0.1)


def _tail(component: str, settings: Settings, lines: int = 15) -> str:
    try:
        text = paths(settings).log(component).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "; last lines of its log:\n" + "\n".join(f"    {line}" for line in text[-lines:])


# --------------------------------------------------------------------------- API helpers


class _Api:
    """Just enough of the API for bringing the cluster up (admin token, our CA)."""

    def __init__(self, settings: Settings) -> None:
        pki = paths(settings).pki
        self.client = httpx.Client(
            base_url=f"https://127.0.0.1:{settings.kube_apiserver_port}",
            verify=ssl.create_default_context(cafile=str(pki / "ca.crt")),
            headers={"Authorization": f"Bearer {(pki / 'token').read_text().strip()}"},
            timeout=5.0,
        )

    def ok(self, path: str) -> bool:
        try:
            return self.client.get(path).status_code == 200
        except httpx.HTTPError:
            return False

    def ensure(self, path: str, manifest: dict[str, Any]) -> None:
        response = self.client.post(path, json=manifest)
        if response.status_code not in (200, 201, 409):
            raise ClusterError(
                f"creating {manifest['kind']}: HTTP {response.status_code} {response.text}"
            )

    def delete_node(self, name: str) -> None:
        with contextlib.suppress(httpx.HTTPError):  # no apiserver: the node went with it
            self.client.delete(f"/api/v1/nodes/{name}")

    def node_ready(self, name: str = NODE_NAME) -> bool:
        try:
            response = self.client.get(f"/api/v1/nodes/{name}")
            node = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return False  # not registered yet (a kubelet registers itself)
        conditions = (node.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


# --------------------------------------------------------------------------- PKI


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ClusterError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _ensure_pki(settings: Settings) -> None:
    """A CA, the apiserver's certificate (SAN 127.0.0.1; Python 3.13's strict checks want a
    real CA and an authority key id), the service-account key pair and an admin token."""
    pki = paths(settings).pki
    if (pki / "token").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
        "-subj", "/CN=sandstream-local-ca", "-keyout", "ca.key", "-out", "ca.crt",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
        "-keyout", "apiserver.key", "-out", "apiserver.csr",
        cwd=pki,
    )  # fmt: skip
    (pki / "apiserver.ext").write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default\n"
        "authorityKeyIdentifier=keyid,issuer\n"
        "subjectKeyIdentifier=hash\n"
    )
    _openssl(
        "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "3650", "-extfile", "apiserver.ext", "-out", "apiserver.crt",
        cwd=pki,
    )  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    token = secrets.token_hex(24)
    # token,user,uid,"groups": system:masters bypasses RBAC (the admin of a test cluster)
    (pki / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    (pki / "token.tmp").write_text(token + "\n")
    (pki / "token.tmp").replace(pki / "token")


# --------------------------------------------------------------------------- entry points


def running(settings: Settings) -> bool:
    """Every component runs (by its pid file) and the apiserver answers /readyz."""
    if not all(_live_pid(paths(settings).pid(c)) for c in COMPONENTS):
        return False
    return _Api(settings).ok("/readyz")


def up(settings: Settings) -> Path:
    """Build if needed, start the cluster unless it runs; the kubeconfig's path."""
    p = paths(settings)
    if running(settings):
        _say(f"running; KUBECONFIG={p.kubeconfig}")
        return p.kubeconfig
    try:
        build(settings, _say)
    except BuildError as exc:
        raise ClusterError(str(exc)) from exc
    for name in reversed(COMPONENTS):  # leftovers of a half-started cluster
        _stop(name, settings)
    started = time.monotonic()
    p.home.mkdir(parents=True, exist_ok=True)
    _ensure_pki(settings)
    bins = binaries(settings)
    shutil.rmtree(p.etcd_data, ignore_errors=True)  # a fresh cluster each time
    p.etcd_data.mkdir(mode=0o700)

    etcd = _spawn("etcd", settings, component_command("etcd", settings, bins))
    _wait(
        lambda: _http_ok(f"http://127.0.0.1:{settings.kube_etcd_port}/health"),
        what="etcd /health", component="etcd", settings=settings, proc=etcd,
    )  # fmt: skip
    start_apiserver(settings)
    write_kubeconfig(settings, p.kubeconfig)
    p.scheduler_config.write_text(scheduler_config(p.kubeconfig))

    procs = {
        name: _spawn(name, settings, component_command(name, settings, bins))
        for name in COMPONENTS[2:]
    }
    api = _Api(settings)
    _wait(
        lambda: _http_ok(f"http://127.0.0.1:{settings.kube_kwok_port}/healthz"),
        what="kwok /healthz", component="kwok", settings=settings, proc=procs["kwok"],
    )  # fmt: skip
    api.ensure("/api/v1/nodes", NODE_MANIFEST)
    api.ensure("/apis/storage.k8s.io/v1/storageclasses", STORAGE_CLASS_MANIFEST)
    _wait(
        api.node_ready, what=f"node {NODE_NAME} Ready", component="kwok", settings=settings,
        proc=procs["kwok"],
    )  # fmt: skip
    # The ServiceAccount admission refuses Pods until the controller manager made "default".
    _wait(
        lambda: api.ok("/api/v1/namespaces/default/serviceaccounts/default"),
        what="the default ServiceAccount", component="kube-controller-manager",
        settings=settings, proc=procs["kube-controller-manager"],
    )  # fmt: skip
    _say(f"cluster up in {time.monotonic() - started:.1f}s; KUBECONFIG={p.kubeconfig}")
    return p.kubeconfig


def write_kubeconfig(settings: Settings, path: Path) -> None:
    """An admin kubeconfig (0600) for the apiserver on ``settings.kube_apiserver_port``."""
    pki = paths(settings).pki
    text = render_kubeconfig(
        f"https://127.0.0.1:{settings.kube_apiserver_port}",
        (pki / "ca.crt").read_bytes(),
        (pki / "token").read_text().strip(),
    )
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(text)
    os.chmod(staged, 0o600)
    staged.replace(path)


def start_apiserver(settings: Settings, name: str = APISERVER) -> None:
    """Start a kube-apiserver on ``settings.kube_apiserver_port`` (unless the one whose pid
    file is ``name`` runs) and wait for /readyz.

    Another ``name`` and port start an extra apiserver on the cluster's etcd (same
    certificates and token): one a test may kill and restart without breaking anyone else's
    connections to the cluster's own apiserver, which the other components use.
    """
    if _live_pid(paths(settings).pid(name)) is None:
        _wait(
            lambda: _port_free(settings.kube_apiserver_port),
            what=f"port {settings.kube_apiserver_port} to be free",
            component=name, settings=settings,
        )  # fmt: skip
        proc = _spawn(name, settings, component_command(APISERVER, settings, binaries(settings)))
    else:
        proc = None
    api = _Api(settings)
    _wait(
        lambda: api.ok("/readyz"), what=f"{name} /readyz", component=name,
        settings=settings, proc=proc,
    )  # fmt: skip


def live_pid(settings: Settings, name: str) -> int | None:
    """The pid of the running component (or extra apiserver) ``name``, if it runs."""
    return _live_pid(paths(settings).pid(name))


def restart_apiserver(settings: Settings, name: str) -> None:
    """Kill the apiserver ``name`` (as a crash would) and start it again: every watch through
    it breaks, and its watch cache starts over, so a watch resumed from an older version gets
    410 Gone."""
    _stop(name, settings, signal.SIGKILL)
    start_apiserver(settings, name)


def stop_apiserver(settings: Settings, name: str) -> bool:
    """Stop the extra apiserver ``name`` and remove its log; False if it was not running."""
    stopped = _stop(name, settings)
    paths(settings).log(name).unlink(missing_ok=True)
    return stopped


def down(settings: Settings) -> None:
    stopped = kube_node.down(settings, _Api(settings).delete_node)
    stopped += [name for name in reversed(COMPONENTS) if _stop(name, settings)]
    _say(f"stopped {', '.join(stopped)}" if stopped else "not running")


def status(settings: Settings) -> bool:
    p = paths(settings)
    for name in COMPONENTS:
        pid = _live_pid(p.pid(name))
        print(f"{name:<24} {'up' if pid else 'DOWN':<5} {f'pid {pid}' if pid else ''}")
    for name in kube_node.COMPONENTS:  # the real node's, when it runs
        if pid := kube_node.pid_of(settings, name):
            print(f"{name:<24} up    pid {pid}")
    ok = running(settings)
    print(
        f"{'api':<24} {'up' if ok else 'DOWN':<5} https://127.0.0.1:{settings.kube_apiserver_port}"
    )
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.localstack.kubernetes")
    parser.add_argument("action", choices=["up", "down", "status", "build", "env"])
    parser.add_argument("--real-node", action="store_true", help="up: and a real node too")
    args = parser.parse_args(argv)
    settings = load_settings()
    try:
        if args.action == "up":
            up(settings)
            if args.real_node:  # beside kwok's node (services/localstack/kube_node.py)
                kube_node.up(settings, _Api(settings).node_ready, _say)
        elif args.action == "down":
            down(settings)
        elif args.action == "status":
            return 0 if status(settings) else 1
        elif args.action == "build":
            build(settings, _say)
        else:
            print(f"export KUBECONFIG={kubeconfig_path(settings)}")
    except (ClusterError, BuildError, StackError) as exc:
        print(f"kubernetes: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
