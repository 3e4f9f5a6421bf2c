"""A real node for the local cluster: a kubelet with containerd and runc, so that sandbox Pods run
real containers (logs, exec, signals and exit codes are the kernel's, not kwok's stages).

    python -m services.localstack.kubernetes up --real-node    (and down / status as usual)

What runs (all of it Debian's but the kubelet, which is built from the Go module proxy with the
control plane, services/localstack/kube_build.py):

- containerd 1.6 with a configuration of its own (root, state, sockets under
  ``state_dir/kubernetes/node``; the cgroupfs driver: no systemd runs here), runc, and the CNI
  plugins bridge, host-local and loopback on a bridge and subnet of their own.
- the kubelet, registered as ``NODE_NAME`` with the taint ``TAINT`` (only Pods that tolerate it
  land there: kwok's node stays the default for everything else), cgroup v1 allowed
  (``failCgroupV1: false``), eviction and image GC thresholds out of the way of a shared test
  machine. It serves on ``kube_node_ip``, an address added to the loopback device (a kubelet
  refuses 127.0.0.1 as its node IP, and only this machine reaches the loopback device), with
  anonymous access allowed: the apiserver reaches it for logs and exec without a client
  certificate.
- images imported from Podman (nothing is pulled from a registry): the pause image (Debian's
  static catatonit in pause mode, ``PAUSE_IMAGE``) and the sandbox base image.

``down`` deletes the Node object, kills every container of the node's containerd, stops the
kubelet and containerd, and unmounts what they left mounted below the node's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.settings import Settings
from services.localstack.kube_build import binaries, build
from services.localstack.processes import StackError, live_pid, spawn, stop_pid, wait_for

NODE_NAME = "sandstream-node-0"
TAINT_KEY = "sandstream.dev/real-node"
TAINT = f"{TAINT_KEY}=true:NoSchedule"  # the toleration's form in kube_tolerations
NODE_LABEL = f"{TAINT_KEY}=true"  # the node selector's form in kube_node_selector
PAUSE_IMAGE = "localhost/sandstream-pause:1"
COMPONENTS = ("containerd", "kubelet")  # started in this order, stopped in the reverse one
START_TIMEOUT = 120.0
CNI_BRIDGE = "sandstream0"
CNI_SUBNET = "10.85.0.0/16"


@dataclass(frozen=True)
class NodePaths:
    home: Path

    def log(self, component: str) -> Path:
        return self.home / f"{component}.log"

    def pid(self, component: str) -> Path:
        return self.home / f"{component}.pid"

    def marker(self, component: str) -> str:
        """A path in the component's command line, unique to this checkout."""
        return str(self.containerd_config if component == "containerd" else self.kubelet_config)

    @property
    def containerd_config(self) -> Path:
        return self.home / "containerd.toml"

    @property
    def socket(self) -> Path:
        return self.home / "containerd" / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.home / "cni" / "net.d"

    @property
    def kubelet_root(self) -> Path:
        return self.home / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.home / "kubelet.yaml"

    @property
    def images(self) -> Path:
        # One stamp per imported image (its Podman image id), inside containerd's root: a new
        # root (an emptied folder) imports again.
        return self.home / "containerd" / "root" / "sandstream-imports"


def paths(settings: Settings) -> NodePaths:
    """Beside the cluster's files (services/localstack/kubernetes.py: state_dir/kubernetes)."""
    return NodePaths(settings.state_dir / "kubernetes" / "node")


# --------------------------------------------------------------------------- pure renderers


def containerd_config(p: NodePaths) -> str:
    """containerd's own configuration: every path below the node's folder, runc through the
    cgroupfs driver, the pause image imported (never pulled), CNI from Debian's plugins."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{p.home / "containerd" / "root"}"
state = "{p.home / "containerd" / "state"}"
[grpc]
  address = "{p.socket}"
[ttrpc]
  address = "{p.socket}.ttrpc"
[debug]
  address = "{p.home / "containerd" / "debug.sock"}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{p.home / "containerd" / "opt"}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  disable_apparmor = true
  # No CAP_SYS_RESOURCE here: a container's oom_score_adj may not go below containerd's own
  # (the pause container's -998 made runc fail with "can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  enable_selinux = false
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{p.cni_conf_dir}"
"""


def cni_conflist(p: NodePaths) -> dict[str, Any]:
    ipam = {
        "type": "host-local",
        "ranges": [[{"subnet": CNI_SUBNET}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": str(p.home / "cni" / "ipam"),
    }
    bridge = {"type": "bridge", "bridge": CNI_BRIDGE, "isGateway": True, "ipam": ipam}
    return {
        "cniVersion": "1.0.0",
        "name": "sandstream-node",
        "plugins": [bridge, {"type": "loopback"}],
    }


def kubelet_config(settings: Settings, p: NodePaths) -> dict[str, Any]:
    """The KubeletConfiguration (as JSON, which is YAML)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # The host runs cgroup v1 and no systemd (kubelets from 1.35 on refuse v1 by default).
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{p.socket}",
        "address": settings.kube_node_ip,
        "port": settings.kube_kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": settings.kube_kubelet_port + 1,
        # The apiserver connects for logs and exec without a client certificate: loopback only.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "localStorageCapacityIsolation": False,
        "enforceNodeAllocatable": [],
        # A shared test machine: no eviction and no image GC because its disk is busy.
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "podLogsDir": str(p.home / "pod-logs"),
        "maxPods": 250,
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "10s",
        "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
    }


def kubelet_command(settings: Settings, p: NodePaths) -> list[str]:
    return [
        str(binaries(settings).kube("kubelet")),
        f"--config={p.kubelet_config}",
        f"--kubeconfig={settings.state_dir / 'kubernetes' / 'kubeconfig'}",
        f"--root-dir={p.kubelet_root}",
        f"--cert-dir={p.kubelet_root / 'pki'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={settings.kube_node_ip}",
        f"--node-labels={NODE_LABEL}",
    ]


# --------------------------------------------------------------------------- shell


def _ctr(p: NodePaths, *args: str, check: bool = True) -> str:
    cmd = ["ctr", "--address", str(p.socket), "--namespace", "k8s.io", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise StackError(f"{' '.join(cmd[3:])} failed: {result.stderr.strip()}")
    return result.stdout


def _podman(settings: Settings, *args: str, check: bool = True) -> str:
    env = {**os.environ, "CONTAINERS_CONF": str(settings.containers_conf)}
    result = subprocess.run(["podman", *args], capture_output=True, text=True, env=env)
    if check and result.returncode != 0:
        raise StackError(f"podman {args[0]} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def _ensure_pause_image(settings: Settings) -> None:
    """The pause image: Debian's static catatonit, in pause mode (``-P``: it sleeps and reaps)."""
    if _podman(settings, "images", "--quiet", PAUSE_IMAGE, check=False):
        return
    catatonit = Path("/usr/bin/catatonit")
    if not catatonit.exists():
        raise StackError("catatonit not found; run compose/bootstrap.sh")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(catatonit, Path(tmp) / "catatonit")
        rootfs = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", tmp, "-cf", str(rootfs), "catatonit"], check=True)
        _podman(
            settings, "import", "--quiet", "--change", 'ENTRYPOINT ["/catatonit", "-P"]',
            str(rootfs), PAUSE_IMAGE,
        )  # fmt: skip


def import_image(settings: Settings, image: str) -> bool:
    """Copy ``image`` from Podman into the node's containerd unless the same Podman image is
    there already; True when it imported."""
    p = paths(settings)
    image_id = _podman(settings, "images", "--quiet", "--no-trunc", image)
    if not image_id:
        raise StackError(f"image {image} is not in Podman: run `make stack` (or build it)")
    stamp = p.images / image.replace("/", "_").replace(":", "_")
    if stamp.exists() and stamp.read_text() == image_id:
        return False
    p.images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "image.tar"
        _podman(settings, "save", "--quiet", "--output", str(archive), image)
        _ctr(p, "images", "import", str(archive))
    stamp.write_text(image_id)
    return True


def _mounts_below(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first (so that each unmount finds it free);
    the kubelet mounts its root folder onto itself."""
    prefix = str(root.resolve()) + "/"
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point.startswith(prefix):
            found.append(point)
    return sorted(set(found), key=len, reverse=True)


# --------------------------------------------------------------------------- entry points


def pid_of(settings: Settings, component: str) -> int | None:
    p = paths(settings)
    return live_pid(p.pid(component), p.marker(component))


def running(settings: Settings) -> bool:
    return all(pid_of(settings, c) for c in COMPONENTS)


def up(settings: Settings, node_ready: Callable[[str], bool], say: Callable[[str], None]) -> None:
    """Start containerd and the kubelet (the cluster must be up: ``node_ready`` asks its
    apiserver), import the images, and wait until the node is Ready; a running node is left
    as it is."""
    started = time.monotonic()
    p = paths(settings)
    build(settings, say)  # the kubelet, when a cluster built before it had one runs already
    fresh = not running(settings)
    if fresh:
        for name in reversed(COMPONENTS):  # leftovers of a half-started node
            stop_pid(p.pid(name), p.marker(name), name)
        _start_containerd(p)
    _ensure_pause_image(settings)
    for image in (PAUSE_IMAGE, settings.sandbox_image):  # before the kubelet needs them
        if import_image(settings, image):
            say(f"node: imported {image} from Podman into containerd")
    if fresh:
        _start_kubelet(settings, p)
    wait_for(
        lambda: node_ready(NODE_NAME), what=f"node {NODE_NAME} Ready", timeout=START_TIMEOUT,
        log=p.log("kubelet"),
    )  # fmt: skip
    say(f"real node {NODE_NAME} Ready in {time.monotonic() - started:.1f}s")


def _start_containerd(p: NodePaths) -> None:
    found = {tool: shutil.which(tool) for tool in ("containerd", "ctr", "runc")}
    for tool, path in found.items():
        if path is None:
            raise StackError(f"{tool} not found; run compose/bootstrap.sh")
    p.cni_conf_dir.mkdir(parents=True, exist_ok=True)
    p.containerd_config.write_text(containerd_config(p))
    (p.cni_conf_dir / "10-sandstream.conflist").write_text(json.dumps(cni_conflist(p), indent=1))
    p.socket.parent.mkdir(parents=True, exist_ok=True)
    command = [str(found["containerd"]), f"--config={p.containerd_config}"]
    proc = spawn(command, log=p.log("containerd"), pidfile=p.pid("containerd"))
    wait_for(
        lambda: subprocess.run(
            ["ctr", "--address", str(p.socket), "version"], capture_output=True, check=False
        ).returncode == 0,
        what="containerd", timeout=START_TIMEOUT, log=p.log("containerd"), proc=proc,
    )  # fmt: skip


def _ensure_node_ip(settings: Settings) -> None:
    """The node's address on the loopback device (``ip`` is idempotent with ``replace``)."""
    cmd = ["ip", "address", "replace", f"{settings.kube_node_ip}/32", "dev", "lo"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise StackError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")


def _start_kubelet(settings: Settings, p: NodePaths) -> None:
    _ensure_node_ip(settings)
    p.kubelet_root.mkdir(parents=True, exist_ok=True)
    p.kubelet_config.write_text(json.dumps(kubelet_config(settings, p), indent=1))
    spawn(kubelet_command(settings, p), log=p.log("kubelet"), pidfile=p.pid("kubelet"))


def down(settings: Settings, delete_node: Callable[[str], None]) -> list[str]:
    """Stop the node (``delete_node`` removes its Node object from the cluster); the names of
    the components that were running."""
    p = paths(settings)
    running_before = [name for name in reversed(COMPONENTS) if pid_of(settings, name)]
    # The kubelet first: a running kubelet registers its node again.
    stop_pid(p.pid("kubelet"), p.marker("kubelet"), "kubelet")
    if running_before:
        delete_node(NODE_NAME)
    if pid_of(settings, "containerd"):
        _kill_containers(p)
    stop_pid(p.pid("containerd"), p.marker("containerd"), "containerd")
    for _ in range(5):  # a folder mounted twice (two kubelet runs) needs two unmounts
        points = _mounts_below(p.home)
        for point in points:
            subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
        if not points:
            break
    if running_before:
        address = f"{settings.kube_node_ip}/32"
        subprocess.run(["ip", "address", "del", address, "dev", "lo"], capture_output=True)
    return running_before


def _kill_containers(p: NodePaths) -> None:
    """Every container of this containerd, killed and removed (their shims exit with them)."""
    for task in _ctr(p, "tasks", "list", "--quiet", check=False).split():
        _ctr(p, "tasks", "kill", "--all", "--signal", "SIGKILL", task, check=False)
    deadline = time.monotonic() + START_TIMEOUT
    while _ctr(p, "tasks", "list", "--quiet", check=False).split():
        for task in _ctr(p, "tasks", "list", "--quiet", check=False).split():
            _ctr(p, "tasks", "delete", "--force", task, check=False)
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for container in _ctr(p, "containers", "list", "--quiet", check=False).split():
        _ctr(p, "containers", "delete", container, check=False)
