"""What every component of the local stack shares: the error and the status line it reports,
and the processes it starts (detached with a pid file, recognised by pid and marker, stopped)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STOP_TIMEOUT = 60.0
EXEC_TIMEOUT = 10.0


class StackError(RuntimeError):
    """A component could not be brought up; the message says which one and why."""


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    running: bool
    detail: str


def say(message: str) -> None:
    print(f"stack: {message}", flush=True)


def live_pid(pidfile: Path, marker: str) -> int | None:
    """The pid in ``pidfile`` if that process lives and its command line contains ``marker``.

    The marker (a path unique to this checkout) guards against a reused pid.
    """
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = _cmdline(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    state = stat.rpartition(")")[2].split()[0]
    if state in ("Z", "X") or marker.encode() not in cmdline:
        return None
    return pid


def _cmdline(pid: int) -> bytes:
    """The process's command line, once it has one.

    A process in the middle of exec reads an empty command line: its new program's memory
    holds no arguments until the kernel has loaded that program, which can end after the
    parent's Popen has returned (and long after, on a loaded machine). Such a process already
    has its executable (a kernel thread or a process tearing down has none), so wait for its
    arguments rather than take it for a stranger.
    """
    deadline = time.monotonic() + EXEC_TIMEOUT
    while not (cmdline := Path(f"/proc/{pid}/cmdline").read_bytes()):
        os.readlink(f"/proc/{pid}/exe")  # OSError: no program, so never a command line
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return cmdline


def spawn(
    cmd: list[str], *, log: Path, pidfile: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` detached (own session, output appended to ``log``), record its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n--- {time.strftime('%F %T')} starting: {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            env=env,
            start_new_session=True,
        )
    pidfile.write_text(f"{proc.pid}\n")
    return proc


def stop_pid(pidfile: Path, marker: str, what: str, timeout: float = STOP_TIMEOUT) -> bool:
    """SIGTERM the recorded process, SIGKILL it after ``timeout``; False if none was running."""
    pid = live_pid(pidfile, marker)
    if pid is None:
        pidfile.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    killed = False
    while live_pid(pidfile, marker) is not None:
        if time.monotonic() > deadline:
            if killed:
                raise StackError(f"{what} (pid {pid}) survived SIGKILL")
            say(f"{what} (pid {pid}) ignored SIGTERM for {timeout:.0f}s; killing it")
            os.kill(pid, signal.SIGKILL)
            killed, deadline = True, time.monotonic() + 10
        time.sleep(0.1)
    pidfile.unlink(missing_ok=True)
    return True


def wait_for(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    log: Path,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{what} exited with code {proc.returncode}\n{tail(log)}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} not ready after {timeout:.0f}s\n{tail(log)}")
        time.sleep(0.25)


def run(cmd: list[str], *, what: str, env: dict[str, str] | None = None) -> str:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    except FileNotFoundError as exc:
        raise StackError(f"{what}: {cmd[0]} not found; run `bash compose/bootstrap.sh`") from exc
    if result.returncode != 0:
        raise StackError(f"{what} failed (exit {result.returncode}):\n{output(result)}")
    return result.stdout


def output(result: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(part.strip() for part in (result.stdout, result.stderr) if part.strip())


def tail(path: Path, lines: int = 12) -> str:
    """The first errors (with the line after each) and the last lines of the latest run."""
    try:
        text = path.read_text(errors="replace").split("\n--- ")[-1].splitlines()
    except OSError:
        return f"(no log at {path})"
    errors = [i for i, line in enumerate(text) if " ERROR " in line or " FATAL " in line][:3]
    shown = [line for i in errors for line in text[i : i + 2]]
    shown += ["..."] if shown else []
    shown += text[-lines:]
    return f"from {path}:\n" + "\n".join(f"    {line}" for line in shown)


def write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False
