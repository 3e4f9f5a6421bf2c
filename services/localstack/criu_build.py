"""Build CRIU 4.1 from Debian's source package, cached beside the local cluster's binaries.

    python -m services.localstack.criu_build        # build if missing, print the binary's path

Podman checkpoints a container's memory with CRIU (through runc), and Debian 12's CRIU 3.17
fails on Linux 6.13 and later (the vDSO's clock pages moved into a mapping of their own,
``[vvar_vclock]``, which CRIU handles from 4.1 on). So the stack builds CRIU ``CRIU_VERSION``
from Debian's ``CRIU_SUITE`` source package: apt fetches the upstream tarball (``apt-get source
--tar-only``, checked against the suite's signed index) with a sources list, lists and cache of
its own (the machine's apt configuration is not touched), and ``make criu`` builds the one
binary (about a minute of two cores; the build packages are in compose/bootstrap.sh). A binary
present in ``settings.kube_home_path`` is never rebuilt. The Podman service started by
``podman_service.up`` finds it first on its ``PATH`` (runc runs ``criu`` from there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from services.common.settings import Settings, load_settings
from services.localstack.kube_build import BuildError

CRIU_VERSION = "4.1.1-1"  # the Debian source package's version (upstream 4.1.1)
CRIU_SUITE = "trixie"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


def criu_dir(settings: Settings, version: str = CRIU_VERSION) -> Path:
    """The directory that holds the built ``criu`` (what goes first on the service's PATH)."""
    return settings.kube_home_path / "bin" / f"criu-{version}"


def criu_path(settings: Settings, version: str = CRIU_VERSION) -> Path:
    return criu_dir(settings, version) / "criu"


def upstream_version(version: str) -> str:
    """The upstream part of a Debian version: ``4.1.1-1`` -> ``4.1.1``."""
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


def sources_list(suite: str = CRIU_SUITE, mirror: str = DEBIAN_MIRROR) -> str:
    return f"deb-src [signed-by={KEYRING}] {mirror} {suite} main\n"


def apt_options(apt_home: Path) -> list[str]:
    """apt options that keep every file of this download under ``apt_home``."""
    return [
        "-o", f"Dir::Etc::SourceList={apt_home / 'sources.list'}",
        "-o", "Dir::Etc::SourceParts=/dev/null",
        "-o", f"Dir::State::Lists={apt_home / 'lists'}",
        "-o", f"Dir::Cache={apt_home / 'cache'}",
        # apt's download sandbox user could not write into a root-owned cache of ours.
        "-o", "APT::Sandbox::User=root",
    ]  # fmt: skip


def build_criu(settings: Settings, say: Callable[[str], None]) -> Path:
    """The criu binary, built first if missing (about a minute; milliseconds when cached)."""
    target = criu_path(settings)
    if target.exists():
        return target
    for tool in ("apt-get", "make", "cc"):
        if shutil.which(tool) is None:
            raise BuildError(f"`{tool}` is not installed: building CRIU needs compose/bootstrap.sh")
    started = time.monotonic()
    say(f"building CRIU {CRIU_VERSION} ({CRIU_SUITE}'s source) into {target.parent}")
    work = settings.kube_home_path / "src" / f"criu-{CRIU_VERSION}"
    shutil.rmtree(work, ignore_errors=True)
    tarball = _download(work, say)
    # tar(1), not tarfile's safe filter: the tree links a .proto to its absolute system path.
    _run(["tar", "-xf", str(tarball), "-C", str(work)], cwd=work, what="unpacking the source")
    tree = work / f"criu-{upstream_version(CRIU_VERSION)}"
    jobs = str(settings.kube_build_jobs)
    _run(["nice", "-n", "10", "make", "-j", jobs, "criu"], cwd=tree, what="make criu")
    scratch = target.with_name("criu.partial")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(tree / "criu" / "criu", scratch)
    scratch.replace(target)  # never a half-copied binary under the name the service runs
    shutil.rmtree(work, ignore_errors=True)
    say(f"CRIU built in {time.monotonic() - started:.0f}s")
    return target


def _download(work: Path, say: Callable[[str], None]) -> Path:
    apt_home = work / "apt"
    for sub in ("lists/partial", "cache/archives/partial"):
        (apt_home / sub).mkdir(parents=True, exist_ok=True)
    (apt_home / "sources.list").write_text(sources_list())
    options = apt_options(apt_home)
    _run(["apt-get", *options, "update"], cwd=work, what=f"apt-get update ({CRIU_SUITE} sources)")
    say(f"apt-get source --tar-only criu={CRIU_VERSION}")
    _run(
        ["apt-get", *options, "source", "--tar-only", f"criu={CRIU_VERSION}"],
        cwd=work,
        what=f"apt-get source criu={CRIU_VERSION} (from {CRIU_SUITE})",
    )
    found = sorted(work.glob(f"criu_{upstream_version(CRIU_VERSION)}.orig.tar.*"))
    if not found:
        raise BuildError(f"apt-get source criu={CRIU_VERSION} left no upstream tarball in {work}")
    return found[0]


def _run(cmd: list[str], *, cwd: Path, what: str) -> None:
    env = {**os.environ, "LC_ALL": "C"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-30:])
        raise BuildError(f"{what} failed (exit {result.returncode}):\n{tail}")


def main() -> int:
    try:
        path = build_criu(load_settings(), lambda m: print(f"criu: {m}", file=sys.stderr))
    except BuildError as exc:
        print(f"criu: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
