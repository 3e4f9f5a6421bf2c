"""Build the local Kubernetes control plane from the Go module proxy, cached outside the clone.

What is built, each through a small wrapper Go module (a ``require`` plus ``tool`` lines):

- kube-apiserver, kube-controller-manager, kube-scheduler from ``k8s.io/kubernetes``. That
  module's go.mod requires every ``k8s.io/<staging>`` module at ``v0.0.0`` and replaces it with
  ``./staging/...``, which a dependent module cannot use; the wrapper replaces each of them with
  its published ``v0.<minor>.<patch>`` release instead.
- etcd from ``go.etcd.io/etcd/server/v3`` (Debian's etcd is too old for a current apiserver, and
  ``go install`` refuses etcd because of a replace in its go.mod).
- kwok from ``sigs.k8s.io/kwok``: the fake node that runs Pods without a kubelet, plus its stock
  stage definitions, taken from the downloaded module.

Everything lands in ``settings.kube_home_path`` (binaries, wrapper modules, Go build and module
caches): a binary present there is never rebuilt, so only the first run on a machine pays for the
build (about 10 minutes of two cores; docs in README.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import Settings

KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")
KUBE_BUILD_TAGS = "selinux,notest,grpcnotrace"
# kwok's stock stages (paths under kustomize/stage/ in its module, without .yaml): a node that
# initialises and heartbeats, Pods that become ready, complete, and finish a graceful delete.
KWOK_STAGES = (
    "node/fast/node-initialize",
    "node/heartbeat-with-lease/node-heartbeat-with-lease",
    "pod/fast/pod-ready",
    "pod/fast/pod-complete",
    "pod/fast/pod-delete",
)
_STAGING_REQUIRE = re.compile(r"^\s*(k8s\.io/[A-Za-z0-9._-]+) v0\.0\.0\s*$", re.MULTILINE)


class BuildError(RuntimeError):
    """A Go step failed; the message carries its output."""


@dataclass(frozen=True)
class KubeBinaries:
    """Where the built binaries live (one directory per version, so versions coexist)."""

    home: Path
    kube_dir: Path
    etcd: Path
    kwok: Path
    kwok_stages: Path

    def kube(self, command: str) -> Path:
        return self.kube_dir / command

    @property
    def all(self) -> tuple[Path, ...]:
        return (*(self.kube(c) for c in KUBE_COMMANDS), self.etcd, self.kwok, self.kwok_stages)


def binaries(settings: Settings) -> KubeBinaries:
    home = settings.kube_home_path
    kwok_dir = home / "bin" / f"kwok-{settings.kube_kwok_version}"
    return KubeBinaries(
        home=home,
        kube_dir=home / "bin" / f"kubernetes-{settings.kube_version}",
        etcd=home / "bin" / f"etcd-{settings.kube_etcd_version}" / "etcd",
        kwok=kwok_dir / "kwok",
        kwok_stages=kwok_dir / "stages.yaml",
    )


def missing(settings: Settings) -> list[Path]:
    return [p for p in binaries(settings).all if not p.exists()]


# --------------------------------------------------------------------------- pure renderers


def staging_version(kube_version: str) -> str:
    """k8s.io/kubernetes v1.Y.Z publishes its staging modules (k8s.io/api, ...) as v0.Y.Z."""
    if not re.fullmatch(r"v1\.\d+\.\d+", kube_version):
        raise ValueError(f"expected a Kubernetes release like v1.37.2, got {kube_version!r}")
    return "v0." + kube_version.removeprefix("v1.")


def staging_modules(kubernetes_go_mod: str) -> list[str]:
    """The modules k8s.io/kubernetes requires at v0.0.0 (its staging tree), sorted."""
    return sorted(set(_STAGING_REQUIRE.findall(kubernetes_go_mod)))


def wrapper_go_mod(
    module: str, requires: dict[str, str], tools: list[str], replaces: dict[str, str]
) -> str:
    lines = [f"module {module}", "", "go 1.24", ""]
    lines += [f"require {path} {version}" for path, version in requires.items()]
    lines += ["", "tool (", *(f"\t{t}" for t in tools), ")"]
    if replaces:
        lines += ["", "replace (", *(f"\t{p} => {p} {v}" for p, v in replaces.items()), ")"]
    return "\n".join(lines) + "\n"


def kube_ldflags(kube_version: str) -> str:
    """Version stamps as Kubernetes' own build sets them (clients check the server version)."""
    minor = kube_version.removeprefix("v1.").split(".")[0]
    stamps = {
        "gitVersion": kube_version,
        "gitMajor": "1",
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in stamps.items()]
    return " ".join(flags)


def go_env(settings: Settings) -> dict[str, str]:
    """The Go environment of every build step: caches in kube_home, no cgo, no toolchain fetch."""
    home = settings.kube_home_path
    return {
        **os.environ,
        "GOCACHE": str(home / "go" / "build"),
        "GOMODCACHE": str(home / "go" / "mod"),
        "GOFLAGS": "-modcacherw",  # so that the cache can be removed with rm -rf
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
    }


# --------------------------------------------------------------------------- build steps


def build(settings: Settings, say: Callable[[str], None]) -> None:
    """Build whatever is missing; a no-op (milliseconds) when every binary is cached."""
    if not missing(settings):
        return
    check_go()
    started = time.monotonic()
    bins = binaries(settings)
    say(f"building the missing binaries into {bins.home} (a first build: ~10 minutes)")
    if not all(bins.kube(c).exists() for c in KUBE_COMMANDS):
        _build_kubernetes(settings, bins, say)
    if not bins.etcd.exists():
        src = _wrapper(
            settings,
            "etcd",
            settings.kube_etcd_version,
            {"go.etcd.io/etcd/server/v3": settings.kube_etcd_version},
            ["go.etcd.io/etcd/server/v3"],
        )
        _go_build(settings, src, ["go.etcd.io/etcd/server/v3"], bins.etcd, ["-s -w"], say)
    if not bins.kwok.exists() or not bins.kwok_stages.exists():
        src = _wrapper(
            settings,
            "kwok",
            settings.kube_kwok_version,
            {"sigs.k8s.io/kwok": settings.kube_kwok_version},
            ["sigs.k8s.io/kwok/cmd/kwok"],
        )
        if not bins.kwok.exists():
            _go_build(settings, src, ["sigs.k8s.io/kwok/cmd/kwok"], bins.kwok, ["-s -w"], say)
        _write_kwok_stages(settings, src, bins.kwok_stages)
    say(f"binaries built in {time.monotonic() - started:.0f}s")


MIN_GO = (1, 24)  # `tool` lines in go.mod


def go_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of ``go env GOVERSION`` output such as ``go1.26.8``."""
    match = re.match(r"^go(\d+)\.(\d+)", text.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_go(minimum: tuple[int, int] = MIN_GO, what: str = "the local cluster") -> None:
    """A ``go`` on the PATH at least ``minimum``, or a BuildError saying what building
    ``what`` needs."""
    need = f"Go {minimum[0]}.{minimum[1]} or newer (https://go.dev/dl; Debian 12's golang is older)"
    if shutil.which("go") is None:
        raise BuildError(f"`go` is not installed: building {what} needs {need}")
    found = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True, check=False)
    version = go_version(found.stdout)
    if version is None or version < minimum:
        raise BuildError(f"found {found.stdout.strip() or 'an unknown Go'}; {what} needs {need}")


def _build_kubernetes(settings: Settings, bins: KubeBinaries, say: Callable[[str], None]) -> None:
    version = settings.kube_version
    staging = staging_version(version)
    # The staging list comes from kubernetes's own go.mod, so another version needs no edit here.
    probe = _src_dir(settings, "kubernetes", version)
    (probe / "go.mod").write_text("module local/kubernetesbuild\n\ngo 1.24\n")
    info = _download(settings, probe, f"k8s.io/kubernetes@{version}")
    replaces = {m: staging for m in staging_modules(Path(info["GoMod"]).read_text())}
    if not replaces:
        raise BuildError(f"no staging modules found in k8s.io/kubernetes@{version}")
    src = _wrapper(
        settings,
        "kubernetes",
        version,
        {"k8s.io/kubernetes": version},
        [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS],
        replaces,
    )
    _go_build(
        settings,
        src,
        [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS if not bins.kube(c).exists()],
        bins.kube_dir,
        [kube_ldflags(version)],
        say,
        tags=KUBE_BUILD_TAGS,
    )


def _src_dir(settings: Settings, name: str, version: str) -> Path:
    src = settings.kube_home_path / "src" / f"{name}-{version}"
    src.mkdir(parents=True, exist_ok=True)
    return src


def _wrapper(
    settings: Settings,
    name: str,
    version: str,
    requires: dict[str, str],
    tools: list[str],
    replaces: dict[str, str] | None = None,
) -> Path:
    """Write the wrapper module and let `go mod tidy` resolve it (seconds with a warm cache)."""
    src = _src_dir(settings, name, version)
    (src / "go.mod").write_text(
        wrapper_go_mod(f"local/{name}build", requires, tools, replaces or {})
    )
    (src / "go.sum").unlink(missing_ok=True)
    _go(settings, src, ["mod", "tidy"], what=f"go mod tidy ({name} {version})")
    return src


def _download(settings: Settings, cwd: Path, module: str) -> dict[str, str]:
    out = _go(settings, cwd, ["mod", "download", "-json", module], what=f"downloading {module}")
    info: dict[str, str] = json.loads(out)
    if info.get("Error"):
        raise BuildError(f"downloading {module}: {info['Error']}")
    return info


def _go_build(
    settings: Settings,
    src: Path,
    packages: list[str],
    out: Path,
    ldflags: list[str],
    say: Callable[[str], None],
    tags: str = "",
) -> None:
    """`go build` into a scratch directory, then move the binaries into place (never a half-built
    one). ``out`` is the binary for one package, the directory for several (named as go names
    them)."""
    started = time.monotonic()
    single = len(packages) == 1
    names = out.name if single else ", ".join(p.rsplit("/", 1)[-1] for p in packages)
    say(f"go build {names} (-p {settings.kube_build_jobs}) ...")
    out_dir = out.parent if single else out
    scratch = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    args = ["build", "-p", str(settings.kube_build_jobs), "-trimpath", "-ldflags", *ldflags]
    if tags:
        args += ["-tags", tags]
    target = f"{scratch}/{out.name}" if single else f"{scratch}/"
    _go(settings, src, [*args, "-o", target, *packages], what=f"go build {names}", nice=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    for built in scratch.iterdir():
        built.replace(out_dir / built.name)
    scratch.rmdir()
    say(f"built {names} in {time.monotonic() - started:.0f}s")


def _write_kwok_stages(settings: Settings, src: Path, target: Path) -> None:
    info = _download(settings, src, f"sigs.k8s.io/kwok@{settings.kube_kwok_version}")
    root = Path(info["Dir"]) / "kustomize" / "stage"
    parts = []
    for stage in KWOK_STAGES:
        path = root / f"{stage}.yaml"
        if not path.exists():
            raise BuildError(f"kwok stage {stage} missing from {root}")
        parts.append(f"---\n{path.read_text().strip()}\n")
    tmp = target.with_suffix(".tmp")
    tmp.write_text("".join(parts))
    tmp.replace(target)


def _go(settings: Settings, cwd: Path, args: list[str], *, what: str, nice: bool = False) -> str:
    cmd = ["go", *args]
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", "10", *cmd]  # the machine is shared: builds yield to everyone else
    result = subprocess.run(
        cmd, cwd=cwd, env=go_env(settings), capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-30:])
        raise BuildError(f"{what} failed (exit {result.returncode}):\n{tail}")
    return result.stdout
