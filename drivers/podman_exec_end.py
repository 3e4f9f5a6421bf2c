"""Ending an exec session's command before it ends by itself: from the host, by its PID.

Podman's exec API cannot stop an exec session (no kill; a running session cannot be removed),
and the sandbox image is arbitrary (no ``kill``, ``timeout`` or shell to count on in it). What
works for every image: ``GET /exec/{id}/json`` gives the exec process's PID as the Podman
service sees it, and where this process shares that PID namespace (it runs on the Podman host,
not in a container of its own) it signals that process from here. runc starts every exec
process as the leader of a session and a process group of its own, so signalling the group
reaches the command's children too, except those that left it (``setsid``, ``setpgid``); an
exec process that leads no group of its own (another runtime) is signalled alone.

The ending: SIGTERM to the group, then SIGKILL once ``grace`` seconds have passed with a member
still alive. Against PID reuse the process is pinned with a pidfd, and signalled only when its
cgroup names the session's container and Podman still reports the session running, with that
PID, after the pin. Where the PID is not the session's process here (another PID namespace, or
a cgroup layout that does not name the container) nothing is signalled and a warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from pathlib import Path
from typing import Any, Final, Literal

from podman import PodmanClient

log = logging.getLogger("sandstream.drivers.podman")

EXEC_GRACE: Final = 5.0  # seconds between SIGTERM and SIGKILL
_KILLED_WAIT: Final = 5.0  # seconds to see the group gone after SIGKILL
_POLL: Final = 0.05

Ending = Literal["exited", "terminated", "killed", "unreachable"]


def end_exec(base_url: str, exec_id: str, *, grace: float, request_timeout: float) -> Ending:
    """End the exec session's command if it still runs: what happened to it."""
    with PodmanClient(base_url=base_url, timeout=request_timeout) as client:
        pid, container = _running(client, exec_id)
        if pid is None:
            return "exited"
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            if isinstance(exc, ProcessLookupError) and _running(client, exec_id)[0] != pid:
                return "exited"  # ended between the look and the pin
            log.warning("exec %s: its process %d is out of reach here (%s; another PID "
                        "namespace than Podman's?): not signalled", exec_id, pid, exc)  # fmt: skip
            return "unreachable"
        try:
            if container not in _cgroups(pid):
                why = "another PID namespace than Podman's?"
                log.warning("exec %s: PID %d here is not in container %s (%s): not signalled",
                            exec_id, pid, container, why)  # fmt: skip
                return "unreachable"
            if _running(client, exec_id)[0] != pid:  # ended between the look and the pin
                return "exited"
            return end_pinned(pidfd, pid, grace)
        finally:
            os.close(pidfd)


def end_pinned(pidfd: int, pid: int, grace: float) -> Ending:
    """SIGTERM to the command (pinned by ``pidfd``, checked to be the command's by the
    caller) and its process group if it leads one, SIGKILL after ``grace`` seconds."""
    group = _group_of(pid) == pid
    _signal(pidfd, pid, group, signal.SIGTERM)
    if _gone(pid, pidfd, group, grace):
        return "terminated"
    _signal(pidfd, pid, group, signal.SIGKILL)
    _gone(pid, pidfd, group, _KILLED_WAIT)
    return "killed"


def _running(client: Any, exec_id: str) -> tuple[int | None, str]:
    """The session's PID while Podman reports it running (else None), and its container."""
    info = client.api.get(f"/exec/{exec_id}/json")
    if info.status_code == 404:
        return None, ""
    info.raise_for_status()
    body = info.json()
    pid = int(body.get("Pid") or 0)
    return (pid if body.get("Running") and pid > 0 else None), str(body.get("ContainerID", "?"))


def _cgroups(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


def _stat(path: str) -> tuple[str, int] | None:
    """A process's state letter and process group, from /proc/<pid>/stat (None: gone)."""
    try:
        text = Path(path, "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[2])


def parent_of(pid: int) -> int | None:
    """A process's parent (None: gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def _group_of(pid: int) -> int | None:
    stat = _stat(f"/proc/{pid}")
    return stat[1] if stat else None


def _signal(pidfd: int, pid: int, group: bool, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, sig)
    if group:
        # The group's number stays taken while it has a member, so it is still the command's.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _alive(pid: int, pidfd: int, group: bool) -> bool:
    """Whether the command (or, for a group, any member) still runs; zombies do not."""
    if not group:
        return not select.select([pidfd], [], [], 0)[0]  # a pidfd reads ready once it exits
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _stat(entry.path)
            if stat is not None and stat[1] == pid and stat[0] not in "ZX":
                return True
    return False


def _gone(pid: int, pidfd: int, group: bool, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the command to be gone: whether it is."""
    wait = threading.Event()
    for _ in range(max(1, int(timeout / _POLL))):
        if not _alive(pid, pidfd, group):
            return True
        wait.wait(_POLL)
    return not _alive(pid, pidfd, group)
