"""This process as the reaper of the commands runc leaves (drivers/podman_runc.py): a child
subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so a command orphaned when ``runc exec
--detach`` exits becomes its child, whose exit status its exec reads by its PID.

Safe beside asyncio and subprocess: they wait for the PIDs they started only (Python 3.11's
default ThreadedChildWatcher, ``Popen.wait``), never ``waitpid(-1)``, so an adopted command is
reaped by its exec alone. But a subreaper adopts every orphan among its descendants, and
nobody here would wait for one it did not start (a zombie until the process exits): so the
runtime path is taken only by a process with no child processes but its execs' (``strangers``;
the services that run execs start none later). docs/adr/0010-podman-exec-through-runc.md.
"""

from __future__ import annotations

import builtins
import ctypes
import os
import subprocess
import threading
from pathlib import Path
from typing import Any, Final

_PR_SET_CHILD_SUBREAPER: Final = 36  # prctl(2), <linux/prctl.h>

_lock = threading.Lock()
_runcs: builtins.set[int] = set()  # runc processes started here and not yet reaped
_subreaper: builtins.list[bool] = []  # set, once


def become() -> None:
    """Make this process a child subreaper, once (an OSError when the kernel refuses)."""
    with _lock:
        if _subreaper:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(errno)}")
        _subreaper.append(True)


def start_runc(argv: builtins.list[str], **options: Any) -> subprocess.Popen[bytes]:
    """Start runc as this subreaper's child, counted as the runtime path's own."""
    become()
    with _lock:
        proc = subprocess.Popen(argv, **options)
        _runcs.add(proc.pid)
    return proc


def reaped(runc_pid: int) -> None:
    """runc (started by ``start_runc``) has been reaped."""
    with _lock:
        _runcs.discard(runc_pid)


def strangers() -> builtins.list[tuple[int, str]]:
    """This process's live children (PID, command name) that are not the runtime path's:
    neither runc started here nor a command runc left (those run in a container's PID
    namespace). A zombie is not one: its own children were handed on when it died, so it
    leaves no orphan to adopt, and whoever started it still reaps it."""
    own_ns = os.readlink("/proc/self/ns/pid")
    me = str(os.getpid())
    found = []
    with _lock:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in _runcs:
                continue
            try:
                text = (entry / "stat").read_text()
                state, parent = text[text.rindex(")") + 2 :].split()[:2]
                if parent != me or state == "Z":
                    continue
                if os.readlink(entry / "ns" / "pid") != own_ns:
                    continue  # a command in a container
            except (OSError, ValueError):
                continue  # gone
            found.append((int(entry.name), text[text.index("(") + 1 : text.rindex(")")]))
    return found
