"""The local stack's Podman: the API service on its socket (started and stopped by pid file,
with the CRIU the stack builds first on its PATH), the environment of podman commands, the
sandbox base image built from busybox, its status line."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from podman import PodmanClient

from services.common.settings import Settings
from services.localstack import config as cfg
from services.localstack.criu_build import build_criu, criu_dir, criu_path
from services.localstack.kube_build import BuildError
from services.localstack.processes import (
    ComponentStatus,
    StackError,
    live_pid,
    run,
    say,
    spawn,
    stop_pid,
    wait_for,
)

START_TIMEOUT = 30.0


def podman_env(settings: Settings) -> dict[str, str]:
    """The environment for podman commands: ours points CONTAINERS_CONF at compose/podman, and
    puts the CRIU the stack built first on PATH when there is one (runc runs ``criu`` from
    PATH for a checkpoint or a restore: services/localstack/criu_build.py)."""
    env = {**os.environ, "CONTAINERS_CONF": str(settings.containers_conf)}
    if criu_path(settings).exists():
        env["PATH"] = os.pathsep.join([str(criu_dir(settings)), env.get("PATH", os.defpath)])
    return env


def ensure_criu(settings: Settings) -> None:
    """Build CRIU if missing. A failure only costs checkpoints (a suspend that keeps memory
    falls back to keeping storage only), so the stack comes up without it, saying why."""
    try:
        build_criu(settings, lambda message: say(f"podman: {message}"))
    except BuildError as exc:
        say(f"podman: CRIU not built, so no checkpoints (suspend keeps storage only): {exc}")


def _answers(settings: Settings) -> bool:
    if not settings.podman_socket_path.exists():
        return False
    try:
        with PodmanClient(base_url=settings.podman_url, timeout=3) as client:
            return client.ping()
    except Exception:
        return False


def up(settings: Settings) -> None:
    """Start the API service unless it answers (or wait for one a concurrent ``up`` started),
    then build the sandbox base image if it is missing."""
    paths = cfg.podman_paths(settings)
    sock = settings.podman_socket_path
    pid = live_pid(paths.pid, settings.podman_url)
    if _answers(settings):
        say(f"podman: service running ({f'pid {pid}' if pid else 'not started by us'})")
    elif pid is not None:  # started by a concurrent `up`, still coming up
        wait_for(
            lambda: _answers(settings),
            what="podman service",
            timeout=START_TIMEOUT,
            log=paths.log,
        )
    else:
        if len(str(sock).encode()) > 107:
            raise StackError(f"podman: socket path too long for a unix socket: {sock}")
        sock.parent.mkdir(parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        ensure_criu(settings)
        started = time.monotonic()
        try:
            proc = spawn(
                cfg.podman_service_command(settings),
                log=paths.log,
                pidfile=paths.pid,
                env=podman_env(settings),
            )
        except FileNotFoundError as exc:
            raise StackError("podman not found; run compose/bootstrap.sh") from exc
        wait_for(
            lambda: _answers(settings),
            what="podman service",
            timeout=START_TIMEOUT,
            log=paths.log,
            proc=proc,
        )
        say(f"podman: service started (pid {proc.pid}) in {time.monotonic() - started:.1f}s")
    _ensure_image(settings)


def stop(settings: Settings) -> None:
    """Stop the API service ``up`` started (by its pid file), if it runs, and its socket."""
    stopped = stop_pid(cfg.podman_paths(settings).pid, settings.podman_url, "podman service")
    if stopped:
        settings.podman_socket_path.unlink(missing_ok=True)
    say("podman: service stopped" if stopped else "podman: service not running")


def _image_exists(settings: Settings) -> bool:
    cmd = ["podman", "image", "exists", settings.sandbox_image]
    return subprocess.run(cmd, env=podman_env(settings), check=False).returncode == 0


def _ensure_image(settings: Settings) -> None:
    """Build the sandbox base image (static busybox and its applets) if it is missing."""
    if _image_exists(settings):
        return
    busybox = shutil.which("busybox")
    if busybox is None:
        raise StackError("podman: busybox not found; run compose/bootstrap.sh")
    applets = run([busybox, "--list"], what="busybox --list").split()
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        _write_rootfs(rootfs, Path(busybox), applets)
        cmd = ["podman", "import", "--quiet"]
        for change in cfg.IMAGE_CHANGES:
            cmd += ["--change", change]
        run(
            [*cmd, str(rootfs), settings.sandbox_image],
            what="podman import",
            env=podman_env(settings),
        )
    say(f"podman: built image {settings.sandbox_image} ({len(applets)} busybox applets)")


def _write_rootfs(path: Path, busybox: Path, applets: list[str]) -> None:
    def entry(name: str, kind: bytes, mode: int = 0o755, link: str = "") -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.linkname, info.mtime = kind, mode, link, int(time.time())
        return info

    with tarfile.open(path, "w") as tar:
        for name in (*cfg.IMAGE_DIRS, "usr"):
            tar.addfile(entry(name, tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755))
        info = entry("bin/busybox", tarfile.REGTYPE)
        info.size = busybox.stat().st_size
        with busybox.open("rb") as binary:
            tar.addfile(info, binary)
        for applet in sorted(set(applets) - {"busybox"}):
            tar.addfile(entry(f"bin/{applet}", tarfile.SYMTYPE, 0o777, "busybox"))
        for name, target in cfg.IMAGE_SYMLINKS.items():
            tar.addfile(entry(name, tarfile.SYMTYPE, 0o777, target))
        for name, text in cfg.IMAGE_FILES.items():
            data = text.encode()
            info = entry(name, tarfile.REGTYPE, 0o644)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def status(settings: Settings) -> ComponentStatus:
    pid = live_pid(cfg.podman_paths(settings).pid, settings.podman_url)
    if not _answers(settings):
        return ComponentStatus("podman", False, f"no API at {settings.podman_url}")
    owner = f"pid {pid}" if pid else "not started by us"
    if not _image_exists(settings):
        return ComponentStatus(
            "podman", False, f"({owner}); image {settings.sandbox_image} missing"
        )
    return ComponentStatus(
        "podman", True, f"{settings.podman_url} ({owner}); {settings.sandbox_image}"
    )
