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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.settings import Settings
from services.localstack import kubernetes as cluster
from services.localstack.kube_build import binaries

NODE_NAME = "sandstream-node-0"
TAINT_KEY = "sandstream.dev/real-node"
TAINT = f"{TAINT_KEY}=true:NoSchedule"  # the toleration's form in kube_tolerations
NODE_LABEL = f"{TAINT_KEY}=true"  # the node selector's form in kube_node_selector
PAUSE_IMAGE = "localhost/sandstream-pause:1"
COMPONENTS = ("containerd", "kubelet")  # started in this order, stopped in the reverse one
CNI_BRIDGE = "sandstream0"
CNI_SUBNET = "10.85.0.0/16"


@dataclass(frozen=True)
class NodePaths:
    home: Path

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
    return NodePaths(cluster.paths(settings).home / "node")


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
        f"--kubeconfig={cluster.paths(settings).kubeconfig}",
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
        raise cluster.ClusterError(f"{' '.join(cmd[3:])} failed: {result.stderr.strip()}")
    return result.stdout


def _podman(settings: Settings, *args: str, check: bool = True) -> str:
    env = {**os.environ, "CONTAINERS_CONF": str(settings.containers_conf)}
    result = subprocess.run(["podman", *args], capture_output=True, text=True, env=env)
    if check and result.returncode != 0:
        raise cluster.ClusterError(f"podman {args[0]} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def _ensure_pause_image(settings: Settings) -> None:
    """The pause image: Debian's static catatonit, in pause mode (``-P``: it sleeps and reaps)."""
    if _podman(settings, "images", "--quiet", PAUSE_IMAGE, check=False):
        return
    catatonit = Path("/usr/bin/catatonit")
    if not catatonit.exists():
        raise cluster.ClusterError("catatonit not found; run compose/bootstrap.sh")
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
    image_id = _podman(settings, "image", "inspect", "--format", "{{.Id}}", image)
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


def running(settings: Settings) -> bool:
    return all(cluster.live_pid(settings, c) for c in COMPONENTS)


def up(settings: Settings) -> None:
    """Start containerd and the kubelet (the cluster must be up), import the images, and wait
    until the node is Ready; a running node is left as it is."""
    started = time.monotonic()
    p = paths(settings)
    fresh = not running(settings)
    if fresh:
        for name in reversed(COMPONENTS):  # leftovers of a half-started node
            cluster._stop(name, settings)
        _start_containerd(settings, p)
    _ensure_pause_image(settings)
    for image in (PAUSE_IMAGE, settings.sandbox_image):  # before the kubelet needs them
        if import_image(settings, image):
            cluster._say(f"node: imported {image} from Podman into containerd")
    if fresh:
        _start_kubelet(settings, p)
    api = cluster._Api(settings)
    cluster._wait(
        lambda: api.node_ready(NODE_NAME), what=f"node {NODE_NAME} Ready", component="kubelet",
        settings=settings,
    )  # fmt: skip
    cluster._say(f"real node {NODE_NAME} Ready in {time.monotonic() - started:.1f}s")


def _start_containerd(settings: Settings, p: NodePaths) -> None:
    found = {tool: shutil.which(tool) for tool in ("containerd", "ctr", "runc")}
    for tool, path in found.items():
        if path is None:
            raise cluster.ClusterError(f"{tool} not found; run compose/bootstrap.sh")
    p.cni_conf_dir.mkdir(parents=True, exist_ok=True)
    p.containerd_config.write_text(containerd_config(p))
    (p.cni_conf_dir / "10-sandstream.conflist").write_text(json.dumps(cni_conflist(p), indent=1))
    p.socket.parent.mkdir(parents=True, exist_ok=True)
    # Its absolute path: the pid file records the binary, by which `down` recognises it.
    command = [str(found["containerd"]), f"--config={p.containerd_config}"]
    proc = cluster._spawn("containerd", settings, command)
    cluster._wait(
        lambda: subprocess.run(
            ["ctr", "--address", str(p.socket), "version"], capture_output=True, check=False
        ).returncode == 0,
        what="containerd", component="containerd", settings=settings, proc=proc,
    )  # fmt: skip


def _ensure_node_ip(settings: Settings) -> None:
    """The node's address on the loopback device (``ip`` is idempotent with ``replace``)."""
    cmd = ["ip", "address", "replace", f"{settings.kube_node_ip}/32", "dev", "lo"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise cluster.ClusterError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")


def _start_kubelet(settings: Settings, p: NodePaths) -> None:
    _ensure_node_ip(settings)
    p.kubelet_root.mkdir(parents=True, exist_ok=True)
    p.kubelet_config.write_text(json.dumps(kubelet_config(settings, p), indent=1))
    cluster._spawn("kubelet", settings, kubelet_command(settings, p))


def down(settings: Settings) -> list[str]:
    """Stop the node; the names of the components that were running."""
    p = paths(settings)
    running_before = [name for name in reversed(COMPONENTS) if cluster.live_pid(settings, name)]
    cluster._stop("kubelet", settings)  # first: a running kubelet registers its node again
    if running_before:
        _remove_node_object(settings)
    if cluster.live_pid(settings, "containerd"):
        _kill_containers(p)
    cluster._stop("containerd", settings)
    for point in _mounts_below(p.home):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
    if running_before:
        address = f"{settings.kube_node_ip}/32"
        subprocess.run(["ip", "address", "del", address, "dev", "lo"], capture_output=True)
    return running_before


def _remove_node_object(settings: Settings) -> None:
    """Delete the Node (its Pods are then deleted by the Pod garbage collector), if the
    apiserver still answers."""
    try:
        cluster._Api(settings).client.delete(f"/api/v1/nodes/{NODE_NAME}")
    except Exception:  # the cluster may be down already: the node is gone with it
        return


def _kill_containers(p: NodePaths) -> None:
    """Every container of this containerd, killed and removed (their shims exit with them)."""
    for task in _ctr(p, "tasks", "list", "--quiet", check=False).split():
        _ctr(p, "tasks", "kill", "--all", "--signal", "SIGKILL", task, check=False)
    deadline = time.monotonic() + cluster.STOP_TIMEOUT
    while _ctr(p, "tasks", "list", "--quiet", check=False).split():
        for task in _ctr(p, "tasks", "list", "--quiet", check=False).split():
            _ctr(p, "tasks", "delete", "--force", task, check=False)
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for container in _ctr(p, "containers", "list", "--quiet", check=False).split():
        _ctr(p, "containers", "delete", container, check=False)
