"""kubernetes-sigs/agent-sandbox's controller, built from the Go module proxy for the peer
benchmark (``python -m services.bench peer``), cached beside the local cluster's binaries.

    python -m services.localstack.agent_sandbox build

The controller comes from ``sigs.k8s.io/agent-sandbox`` through a wrapper module (a ``require``
plus a ``tool`` line), as the cluster's own binaries do (services/localstack/kube_build.py);
the module's own manifests — the Sandbox CRD and the controller's ClusterRole — are copied
from the downloaded module beside the binary, with its extensions' (SandboxTemplate,
SandboxWarmPool, SandboxClaim: CRDs and ClusterRole), which the controller serves when run
with ``--extensions``. Everything lands in
``settings.kube_home_path/bin/agent-sandbox-<version>``: present there, nothing is rebuilt.
The module needs Go 1.26 (its go.mod says so); the build takes about 3 minutes of two idle
cores, with the Kubernetes modules already in the Go cache from the cluster's build.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import Settings, load_settings
from services.localstack.kube_build import BuildError, _download, _go_build, _wrapper, check_go

MODULE = "sigs.k8s.io/agent-sandbox"
VERSION = "v1.0.1"
CONTROLLER_PACKAGE = f"{MODULE}/cmd/agent-sandbox-controller"
MIN_GO = (1, 26)  # the module's go.mod: go 1.26.0
# Manifests of the module (paths under its k8s/ folder) the benchmark applies.
SANDBOX_CRD = "crds/agents.x-k8s.io_sandboxes.yaml"
CONTROLLER_ROLE = "rbac.generated.yaml"  # the ClusterRole agent-sandbox-controller
EXTENSION_CRDS = (
    "crds/extensions.agents.x-k8s.io_sandboxtemplates.yaml",
    "crds/extensions.agents.x-k8s.io_sandboxwarmpools.yaml",
    "crds/extensions.agents.x-k8s.io_sandboxclaims.yaml",
)
EXTENSIONS_ROLE = "extensions-rbac.generated.yaml"  # agent-sandbox-controller-extensions
MANIFESTS = (SANDBOX_CRD, CONTROLLER_ROLE, *EXTENSION_CRDS, EXTENSIONS_ROLE)
# The ClusterRoles the controller's account is bound to (with --extensions: both).
ROLES = ("agent-sandbox-controller", "agent-sandbox-controller-extensions")
# The Sandbox API its CRD serves, and the extensions' API.
GROUP = "agents.x-k8s.io"
EXTENSIONS_GROUP = "extensions.agents.x-k8s.io"
API_VERSION = "v1beta1"
# Every CRD it serves (plural.group), to wait for before the controller starts.
CRD_NAMES = (
    f"sandboxes.{GROUP}",
    *(f"{r}.{EXTENSIONS_GROUP}" for r in ("sandboxtemplates", "sandboxwarmpools", "sandboxclaims")),
)
# A Sandbox's label saying how a claim got it: "warm" (adopted from a pool) or "cold".
LAUNCH_TYPE_LABEL = "agents.x-k8s.io/launch-type"


@dataclass(frozen=True)
class AgentSandbox:
    """Where the built controller and its manifests live."""

    home: Path

    @property
    def controller(self) -> Path:
        return self.home / "agent-sandbox-controller"

    def manifest(self, name: str) -> Path:
        return self.home / "k8s" / name

    @property
    def all(self) -> tuple[Path, ...]:
        return (self.controller, *(self.manifest(m) for m in MANIFESTS))


def files(settings: Settings) -> AgentSandbox:
    return AgentSandbox(settings.kube_home_path / "bin" / f"agent-sandbox-{VERSION}")


def missing(settings: Settings) -> list[Path]:
    return [p for p in files(settings).all if not p.exists()]


def controller_command(
    binary: Path, kubeconfig: Path, metrics_port: int, probe_port: int, extensions: bool = False
) -> list[str]:
    """The controller run out of cluster (pure): one replica, no leader election, its metrics
    and probes on loopback ports of their own, ``extensions``: its templates, warm pools and
    claims on; stock settings otherwise (client QPS unlimited, burst 10; the warm pool's and
    the claims' workers, batch and refill rate at their defaults: what a user gets)."""
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        *(["--extensions"] if extensions else []),
        f"--metrics-bind-address=127.0.0.1:{metrics_port}",
        f"--health-probe-bind-address=127.0.0.1:{probe_port}",
    ]


def build(settings: Settings, say: Callable[[str], None]) -> AgentSandbox:
    """Build the controller and copy its manifests unless they are cached (a no-op then)."""
    built = files(settings)
    if not missing(settings):
        return built
    check_go(MIN_GO, f"agent-sandbox {VERSION}")
    started = time.monotonic()
    first = "" if built.controller.exists() else " (a first build: ~3 minutes)"
    say(f"building agent-sandbox {VERSION} into {built.home}{first}")
    src = _wrapper(settings, "agent-sandbox", VERSION, {MODULE: VERSION}, [CONTROLLER_PACKAGE])
    if first:
        _go_build(settings, src, [CONTROLLER_PACKAGE], built.controller, ["-s -w"], say)
    module_dir = Path(_download(settings, src, f"{MODULE}@{VERSION}")["Dir"]) / "k8s"
    for name in MANIFESTS:
        target = built.manifest(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(target.name + ".tmp")
        shutil.copyfile(module_dir / name, staged)
        staged.replace(target)
    say(f"agent-sandbox built in {time.monotonic() - started:.0f}s")
    return built


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.localstack.agent_sandbox")
    parser.add_argument("action", choices=["build", "path"])
    args = parser.parse_args(argv)
    settings = load_settings()
    if args.action == "path":
        print(files(settings).home)
        return 0
    try:
        build(settings, lambda m: print(f"agent-sandbox: {m}", file=sys.stderr, flush=True))
    except BuildError as exc:
        print(f"agent-sandbox: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
