"""How the Podman driver creates a generation's container: its arguments (name, labels, env,
init, grace period, workspace) and its confinement (limits, privileges, a read-only root).
"""

from __future__ import annotations

import math
from typing import Any, Final

from drivers.labels import runtime_labels
from drivers.podman_checkpoint import LABEL_SPEC_HASH, spec_hash
from drivers.podman_objects import container_name
from drivers.protocol import IDENTITY_ENV, WORKSPACE_PATH, LaunchSpec, grace_period
from events.common import SandboxResources, SandboxSpec

# Seconds a stop waits after SIGTERM before SIGKILL, unless the caller or the sandbox says.
DEFAULT_STOP_TIMEOUT: Final = 10.0
# A sandbox's limits when its spec sets none (SandboxSpec.resources).
DEFAULT_LIMITS: Final = SandboxResources(memory_mib=1024, cpu_millicores=1000, pids=512)
TMPFS_PATHS: Final = ("/tmp", "/var/tmp", "/run")
CPU_PERIOD_US: Final = 100_000  # the CFS period the CPU quota is a share of
# Set explicitly because passing any ulimit replaces the service's default_ulimits (and
# limits above the machine's hard limits make runc fail).
ULIMITS: Final = (
    {"Name": "core", "Soft": 0, "Hard": 0},
    {"Name": "nofile", "Soft": 1024, "Hard": 1024},
    {"Name": "nproc", "Soft": 1024, "Hard": 1024},
)


def confinement(spec: SandboxSpec, defaults: SandboxResources = DEFAULT_LIMITS) -> dict[str, Any]:
    """The create arguments that confine a runtime: limits and privileges."""
    own = spec.resources or SandboxResources()
    memory = own.memory_mib or defaults.memory_mib
    cpu = own.cpu_millicores or defaults.cpu_millicores
    pids = own.pids or defaults.pids
    args: dict[str, Any] = {
        "no_new_privileges": True,
        "cap_drop": ["ALL"],
        "read_only": spec.read_only_root is not False,
        # Writable scratch space on a read-only root (the API does not add it by itself).
        "mounts": [
            {"type": "tmpfs", "source": "tmpfs", "target": path, "size": "64m"}
            for path in TMPFS_PATHS
        ],
        "ulimits": [dict(u) for u in ULIMITS],
    }
    if memory is not None:
        args["mem_limit"] = memory * 1024 * 1024
    if cpu is not None:
        args["cpu_period"] = CPU_PERIOD_US
        args["cpu_quota"] = cpu * CPU_PERIOD_US // 1000
    if pids is not None:
        args["pids_limit"] = pids
    return args


def create_args(
    spec: LaunchSpec, *, volume: str, init: bool, stop_timeout: float, limits: SandboxResources
) -> dict[str, Any]:
    """The arguments of ``containers.create`` for the generation's container (without its
    provider values: drivers/podman_secrets.py adds those)."""
    args: dict[str, Any] = {
        "name": container_name(spec.key, spec.generation),
        "hostname": spec.key,
        "labels": runtime_labels(spec),
        "environment": {**spec.spec.env, IDENTITY_ENV: spec.identity},
        "init": init,
        # Podman's own default for `podman stop` by hand; sandstream always passes the
        # grace period explicitly (PodmanCalls.grace).
        "stop_timeout": math.ceil(grace_period(None, spec.spec.stop_timeout_seconds, stop_timeout)),
        "volumes": {volume: {"bind": WORKSPACE_PATH, "mode": "rw"}},
        **confinement(spec.spec, limits),
    }
    if spec.spec.command:
        args["command"] = list(spec.spec.command)
    # What a resume's restore of a memory checkpoint must match (drivers/podman_checkpoint.py).
    args["labels"][LABEL_SPEC_HASH] = spec_hash(args)
    return args
