"""The Kubernetes driver's exec capability: a command in the sandbox's Pod through the exec
subresource (the ``v5.channel.k8s.io`` websocket of drivers/kube_files.py: stdin sent and
closed, stdout and stderr apart, the exit from the error channel).

Kubernetes' exec takes no environment and no working directory: with either, the command runs
through the image's ``sh`` (``cd``, then ``exec``) and ``env``, which the image must have.

Kubernetes cannot end an exec either: a closed websocket leaves the command running in the
container (neither the kubelet nor containerd signals it; a real node proves it). So every
command starts under the image's ``sh``, which reports its PID (the first line of stderr, kept
from the caller) and then ``exec``s the command in its place; runc makes each exec process the
leader of a process group of its own. Leaving the stream before the command's exit (the
caller's timeout, a client gone) ends it from a second exec: ``kill`` SIGTERM to that group,
SIGKILL once ``grace`` seconds have passed with a member still running (read from
``/proc``: a zombie left to a PID 1 that reaps nothing does not count). An image without
``sh`` runs the command as given, which nothing can end but its own exit; a program the
runtime cannot start there is exit 127 (126 when not permitted), as ``sh`` would say it.
Where no kubelet serves exec (a kwok node, as in the local cluster), the stream fails with a
DriverError that carries the apiserver's reason.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import ClassVar, Final

from drivers.kube_config import KubeConfig
from drivers.kube_files import KubeFiles
from drivers.protocol import DriverError, ExecEvent, ExecExit, ExecOutput

log = logging.getLogger("sandstream.drivers.kubernetes")

_IN_WORKDIR: Final = 'cd -- "$1" || exit 127; shift; exec "$@"'
_WITH_PID: Final = 'echo "$$" >&2; exec "$@"'  # the PID first, then the command in its place
# A signal to the command's process group (or, should it lead none, to the process alone).
# (No ``--``: busybox's kill takes it for a PID; a negative number after ``-s`` is a group.)
_SIGNAL: Final = 'kill -s "$1" "-$2" 2>/dev/null || kill -s "$1" "$2" 2>/dev/null'
# Whether a process of the group (or the process) "$1" still runs: a zombie does not (a Pod's
# PID 1 need not reap the orphans it inherits). /proc/N/stat: "N (comm) state ppid pgrp ...".
_RUNS: Final = (
    'g=$1; for f in /proc/[0-9]*/stat; do read -r s 2>/dev/null < "$f" || continue; '
    "n=${s%% *}; s=${s##*) }; set -- $s; "
    '[ "$1" != Z ] && { [ "$3" = "$g" ] || [ "$n" = "$g" ]; } && exit 0; done; exit 1'
)
_NO_SH: Final = 'exec: "sh"'  # the runtime's words when the image has no sh
EXEC_GRACE: Final = 5.0  # seconds between SIGTERM and SIGKILL
_POLL: Final = 0.2


def wrapped(
    command: builtins.list[str], env: Mapping[str, str] | None, workdir: str | None
) -> builtins.list[str]:
    """The argv that gives ``command`` its environment and working directory."""
    argv = builtins.list(command)
    if env:
        argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    if workdir:
        argv = ["sh", "-c", _IN_WORKDIR, "sh", workdir, *argv]
    return argv


def reporting_pid(argv: builtins.list[str]) -> builtins.list[str]:
    """``argv`` under ``sh``, which writes its PID on stderr and then becomes the command."""
    return ["sh", "-c", _WITH_PID, "sh", *argv]


async def _once(data: bytes) -> AsyncIterator[bytes]:
    if data:
        yield data


class PidLine:
    """The wrapper's first line of stderr (its PID), taken out of the command's stderr."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending = True
        self._head = bytearray()

    def feed(self, data: bytes) -> bytes:
        """The part of ``data`` that is the command's own stderr."""
        if not self.pending:
            return data
        self._head += data
        line, newline, rest = self._head.partition(b"\n")
        if not newline:
            return b""
        self.pending = False
        if line.isdigit():
            self.pid = int(line)
            return bytes(rest)
        return bytes(self._head)  # not the wrapper's (cannot happen): passed on whole


class KubeExec:
    """The ExecDriver of the Kubernetes driver's Pods (``sandstream-<key>-g<generation>``)."""

    # An exec's environment becomes part of its argv (``env K=V …``), which is the query of
    # the apiserver's exec request URL (its logs and audit): no place for a provider's value.
    exec_env_refusal: ClassVar[str | None] = (
        "the kubernetes driver cannot pass an exec's environment privately (an exec's argv is "
        "in the apiserver's request URL)"
    )

    def __init__(self, cfg: KubeConfig, grace: float = EXEC_GRACE) -> None:
        self._pods = KubeFiles(cfg)  # its exec websocket serves commands as it serves files
        self.grace = grace

    async def exec_stream(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        stdin: bytes | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        argv = wrapped(command, env, workdir)
        head = PidLine()
        ended = False
        try:
            try:
                async for event in self._run(key, generation, reporting_pid(argv), stdin):
                    if isinstance(event, ExecOutput) and event.stream == "stderr":
                        if not (data := head.feed(event.data)):
                            continue
                        event = ExecOutput("stderr", data)
                    ended = isinstance(event, ExecExit)
                    yield event
            except DriverError as exc:
                if (
                    not head.pending
                    or _start_failure(exc.reason) is None
                    or _NO_SH not in exc.reason
                ):
                    raise
                async for event in self._as_given(key, generation, argv, stdin):  # no sh
                    ended = isinstance(event, ExecExit)
                    yield event
        finally:
            if not ended and head.pid is not None:
                await self._end(key, generation, head.pid)

    async def _run(
        self, key: str, generation: int, argv: builtins.list[str], stdin: bytes | None
    ) -> AsyncIterator[ExecEvent]:
        feed = None if stdin is None else _once(stdin)
        events = self._pods._events(key, generation, argv, feed)
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def _as_given(
        self, key: str, generation: int, argv: builtins.list[str], stdin: bytes | None
    ) -> AsyncIterator[ExecEvent]:
        """The command without ``sh``; a program the runtime cannot start is exit 127 (126
        when not permitted) with the runtime's message on stderr, as ``sh`` would say it."""
        try:
            async for event in self._run(key, generation, argv, stdin):
                yield event
        except DriverError as exc:
            code = _start_failure(exc.reason)
            if code is None:
                raise
            yield ExecOutput("stderr", exc.reason.encode() + b"\n")
            yield ExecExit(code)

    async def _end(self, key: str, generation: int, pid: int) -> None:
        """SIGTERM to the command left running, SIGKILL after the grace; errors are logged
        (the Pod may be gone, which ended the command too)."""
        try:
            if not await self._signal(key, generation, "TERM", pid):
                return  # ended by itself meanwhile
            deadline = asyncio.get_running_loop().time() + self.grace
            while asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(_POLL)
                if not await self._runs(key, generation, pid):
                    return
            await self._signal(key, generation, "KILL", pid)
        except DriverError as exc:
            log.warning("exec in %s generation %d: could not end PID %d: %s",
                        key, generation, pid, exc.reason)  # fmt: skip

    async def _runs(self, key: str, generation: int, pid: int) -> bool:
        return await self._succeeds(key, generation, ["sh", "-c", _RUNS, "sh", str(pid)])

    async def _signal(self, key: str, generation: int, signal: str, pid: int) -> bool:
        """Whether the signal reached the process (group) ``pid``."""
        return await self._succeeds(key, generation, ["sh", "-c", _SIGNAL, "sh", signal, str(pid)])

    async def _succeeds(self, key: str, generation: int, argv: builtins.list[str]) -> bool:
        exits = [e async for e in self._run(key, generation, argv, None) if isinstance(e, ExecExit)]
        return exits == [ExecExit(0)]

    async def close(self) -> None:
        await self._pods.close()


def _start_failure(reason: str) -> int | None:
    """The shell's exit code for the runtime's failure to start a program, else None."""
    if "unable to start container process" not in reason:
        return None
    return 126 if "permission denied" in reason else 127
