"""Build sandstream's OCI image without any container registry (``make image``).

    python -m services.localstack.image [build] [--rebuild-base]

Three steps, each skipped when its inputs are unchanged:

1. The base: a Debian 12 root file system made by ``mmdebstrap`` from Debian's packages (the
   machine's apt sources), with Python 3.11 and little else (no documentation, man pages,
   locales or apt lists), imported into Podman as ``localhost/sandstream-debian12:<recipe>``,
   where ``<recipe>`` hashes everything that decides its content. An image of that name in
   Podman's store is never rebuilt (``--rebuild-base`` rebuilds it, e.g. for security updates).
2. The wheels: sandstream's own, built from the checkout with a fixed SOURCE_DATE_EPOCH (the
   same sources give the same bytes), and its dependencies' wheels with a requirements file
   pinning each one; the dependencies' wheels are kept in ``settings.image_home_path`` (outside
   the clone, like the Kubernetes binaries), keyed by pyproject.toml's dependency list, so only
   the first build on a machine downloads them.
3. ``podman build`` of deploy/image/Containerfile, labelled with the hash of all of the above:
   when the image already carries that label nothing is built; otherwise buildah's layer cache
   keeps the dependencies' layer while the requirements are the same, and only sandstream's own
   layer is rebuilt.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from services.common.settings import PROJECT_ROOT, Settings, load_settings

IMAGE_REPOSITORY = "localhost/sandstream"
BASE_REPOSITORY = "localhost/sandstream-debian12"
CONTAINERFILE = PROJECT_ROOT / "deploy" / "image" / "Containerfile"
INPUTS_LABEL = "io.sandstream.image.inputs"
SUITE = "bookworm"
# What the base holds beyond Debian's essential packages: Python (python3-venv for the pip
# wheel the build installs with), the CA bundle (TLS to Kafka, PostgreSQL, Kubernetes),
# useradd, and the C++ runtime grpcio and protobuf link against.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd", "libstdc++6")
BASE_EXCLUDES = (
    "/usr/share/doc/*",
    "/usr/share/man/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
)
BASE_CLEANUP = 'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/* "$1"/tmp/*'
APT_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))
SOURCE_DATE_EPOCH = "315532800"  # 1980-01-01, the earliest time a wheel (zip) can hold
_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


class ImageError(RuntimeError):
    """A build step failed; the message says which and carries its output."""


# --------------------------------------------------------------------------- pure parts


def mmdebstrap_command(sources: Sequence[Path], out: Path) -> list[str]:
    """The base's root file system as a tarball at ``out``, from ``sources`` (apt source files)."""
    cmd = [
        "mmdebstrap",
        "--variant=essential",
        f"--include={','.join(BASE_PACKAGES)}",
        # /bin -> usr/bin and friends without the usrmerge package (which pulls in perl)
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        '--aptopt=Acquire::Languages "none"',
        *(f"--dpkgopt=path-exclude={pattern}" for pattern in BASE_EXCLUDES),
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",  # the licences stay
        f"--customize-hook={BASE_CLEANUP}",
        SUITE,
        str(out),
    ]
    return cmd + [str(s) for s in sources]


def base_reference() -> str:
    """The base's name: its recipe's hash (the command without where it reads and writes)."""
    recipe = mmdebstrap_command([], Path("rootfs.tar"))
    return f"{BASE_REPOSITORY}:{_digest(json.dumps(recipe))[:12]}"


def requirement_of(wheel: str) -> str:
    """``name==version`` of a wheel file name (PEP 427)."""
    match = _WHEEL_NAME.match(wheel)
    if match is None:
        raise ImageError(f"not a wheel file name: {wheel}")
    return f"{match['name']}=={match['version']}"


def requirements(wheels: Sequence[str], own: str) -> str:
    """The requirements file pinning every wheel but ``own`` (sandstream's), sorted."""
    return "".join(f"{requirement_of(w)}\n" for w in sorted(wheels) if w != own)


def dependencies_key(pyproject: str) -> str:
    """What decides the dependencies' wheels: pyproject.toml's dependency list."""
    deps = tomllib.loads(pyproject)["project"]["dependencies"]
    return _digest(json.dumps(sorted(deps)))[:16]


def inputs_digest(base: str, containerfile: str, requirements_sha: str, wheel_sha: str) -> str:
    return _digest(json.dumps([base, containerfile, requirements_sha, wheel_sha]))


def image_reference(version: str) -> str:
    return f"{IMAGE_REPOSITORY}:{version}"


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def project_version() -> str:
    version: str = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"][
        "version"
    ]
    return version


# --------------------------------------------------------------------------- steps


def build(settings: Settings, say: Callable[[str], None], *, rebuild_base: bool = False) -> str:
    """Build what is missing or stale; the image's reference. One build at a time per machine
    (a lock file in the cache): a second waits, then finds the image current."""
    lock = settings.image_home_path / "build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return _build(settings, say, rebuild_base)


def _build(settings: Settings, say: Callable[[str], None], rebuild_base: bool) -> str:
    started = time.monotonic()
    base = _ensure_base(settings, say, rebuild_base)
    target = image_reference(project_version())
    with tempfile.TemporaryDirectory(prefix="sandstream-image-") as tmp:
        context = Path(tmp)
        wheels = context / "wheels"
        wheels.mkdir()
        own = _build_wheel(wheels)
        deps = _dependency_wheels(settings, wheels / own, say)
        for wheel in deps.glob("*.whl"):
            shutil.copy(wheel, wheels)
        reqs = requirements([w.name for w in wheels.glob("*.whl")], own)
        (wheels / "requirements.txt").write_text(reqs)
        wheel_sha = _digest((wheels / own).read_bytes())
        reqs_sha = _digest(reqs)
        inputs = inputs_digest(base, CONTAINERFILE.read_text(), reqs_sha, wheel_sha)
        if _label(settings, target) == inputs:
            say(f"{target} is up to date ({time.monotonic() - started:.0f}s)")
            return target
        say(f"podman build {target} ...")
        _podman(
            settings,
            [
                "build", "--network=none", "--file", str(CONTAINERFILE),
                "--build-arg", f"BASE={base}",
                "--build-arg", f"DEPS_SHA256={reqs_sha}",
                "--build-arg", f"WHEEL_SHA256={wheel_sha}",
                "--build-arg", f"WHEEL={own}",
                "--label", f"{INPUTS_LABEL}={inputs}",
                "--tag", target, str(context),
            ],
            what="podman build",
        )  # fmt: skip
    size = _podman(settings, ["image", "inspect", "--format", "{{.Size}}", target], what="size")
    say(f"built {target} ({int(size) / 1e6:.0f} MB) in {time.monotonic() - started:.0f}s")
    return target


def _ensure_base(settings: Settings, say: Callable[[str], None], rebuild: bool) -> str:
    base = base_reference()
    if not rebuild and _exists(settings, base):
        return base
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap not found: run `bash compose/bootstrap.sh` (as root)")
    sources = [p for p in APT_SOURCES if p.is_file()] + sorted(
        p for p in APT_SOURCES[1].glob("*") if p.suffix in (".list", ".sources")
    )
    started = time.monotonic()
    say(f"building the base {base} with mmdebstrap (Debian 12; about a minute) ...")
    with tempfile.TemporaryDirectory(prefix="sandstream-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        _run(mmdebstrap_command(sources, rootfs), what="mmdebstrap")
        _podman(
            settings,
            ["import", "--quiet", "--change", 'CMD ["/bin/bash"]', str(rootfs), base],
            what="podman import",
        )
    say(f"base {base} built in {time.monotonic() - started:.0f}s")
    return base


def _build_wheel(out: Path) -> str:
    """sandstream's wheel from the checkout into ``out``; its file name."""
    env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
    # setuptools builds through the checkout's build/ and packs whatever build/lib holds: a
    # module removed since an earlier build would ride along in the wheel. Built from scratch.
    shutil.rmtree(PROJECT_ROOT / "build", ignore_errors=True)
    _run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out),
         str(PROJECT_ROOT)],
        what="building the sandstream wheel", env=env,
    )  # fmt: skip
    built = [p.name for p in out.glob("sandstream-*.whl")]
    if len(built) != 1:
        raise ImageError(f"expected one sandstream wheel, found {built}")
    return built[0]


def _dependency_wheels(settings: Settings, own: Path, say: Callable[[str], None]) -> Path:
    """The wheels of sandstream's dependencies (cached by pyproject's dependency list)."""
    key = dependencies_key((PROJECT_ROOT / "pyproject.toml").read_text())
    cached = settings.image_home_path / f"deps-{key}"
    if cached.is_dir():
        return cached
    say("downloading the dependencies' wheels (pip; first build only) ...")
    partial = cached.with_name(cached.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(partial), str(own)],
        what="pip wheel (the dependencies)",
    )
    (partial / own.name).unlink()  # the checkout's own wheel is built every time
    partial.replace(cached)
    return cached


# --------------------------------------------------------------------------- podman


def podman_env(settings: Settings) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(settings.containers_conf)}


def _exists(settings: Settings, ref: str) -> bool:
    cmd = ["podman", "image", "exists", ref]
    return subprocess.run(cmd, env=podman_env(settings), check=False).returncode == 0


def _label(settings: Settings, ref: str) -> str | None:
    if not _exists(settings, ref):
        return None
    fmt = f'{{{{index .Labels "{INPUTS_LABEL}"}}}}'
    return _podman(settings, ["image", "inspect", "--format", fmt, ref], what="inspect").strip()


def _podman(settings: Settings, args: list[str], *, what: str) -> str:
    return _run(["podman", *args], what=what, env=podman_env(settings))


def _run(cmd: list[str], *, what: str, env: dict[str, str] | None = None) -> str:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    except FileNotFoundError as exc:
        raise ImageError(f"{what}: {cmd[0]} not found; run `bash compose/bootstrap.sh`") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-30:])
        raise ImageError(f"{what} failed (exit {result.returncode}):\n{tail}")
    return result.stdout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.localstack.image")
    parser.add_argument("action", nargs="?", choices=["build"], default="build")
    parser.add_argument("--rebuild-base", action="store_true",
                        help="build the Debian base again (e.g. for security updates)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        ref = build(
            load_settings(),
            lambda m: print(f"image: {m}", file=sys.stderr, flush=True),
            rebuild_base=args.rebuild_base,
        )
    except ImageError as exc:
        print(f"image: {exc}", file=sys.stderr)
        return 1
    print(ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
