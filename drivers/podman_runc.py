"""Exec through Podman's OCI runtime directly: ``runc exec`` of the container, without Podman's
exec API (docs/adr/0010-podman-exec-through-runc.md says why, and what it gives up).

Only where this process can do what conmon does for Podman (``probe``): it runs as root on the
Podman host, Podman is rootful with runc, and runc's state of the container is under the state
root Podman runs runc with (rootful Podman 4.3 passes no ``--root``: runc's default,
``/run/runc``), and this process has no child processes of its own (it becomes the reaper of
runc's commands: drivers/podman_reaper.py). Anything else (a remote socket, rootless, crun,
another namespace, a process that started other processes) keeps Podman's exec API
(drivers/podman_exec.py).

The process is the one Podman's exec would run: the container's own process from its OCI
config (``config.json`` in the bundle runc's state names: user, capabilities, no_new_privileges,
rlimits, AppArmor/SELinux labels, OOM score, env, cwd), with the command as its args, no
terminal, the exec's env appended (a later entry wins, as in Podman), the exec's working
directory, and the supplementary groups Podman's exec gives (it leaves out the primary group
that Podman adds to the container's own process when it starts it). Seccomp, namespaces and
cgroups are the container's: runc applies them to every exec. It goes to runc in a 0600 file
in a 0700 directory of its own, removed once runc has started the command (or failed to).

runc runs detached (``--detach``, as conmon runs it for Podman): the command inherits this
process's pipes as its stdin, stdout and stderr (read by threads into the bounded OutputBuffer,
drivers/podman_exec.py, as Podman's stream is) and runc exits once it has started it. This
process is a child subreaper (drivers/podman_reaper.py), so the command, orphaned when runc exits,
becomes its child (the kernel reparents an orphan to the nearest subreaper among its dead
parent's ancestors in the parent's PID namespace: runc's, the host's), and its exit status is
read with ``waitpid`` on its PID (128 + the signal for a killed one, as Podman reports). The
exec answers when the command exits, as Podman's does: what its output already holds is read
(a bounded drain), and a child left in the background holding stdout or stderr holds nothing
(``sh -c "server & echo started"`` answers at once). Only the command itself is reparented
here: its own orphans stay in the container's PID namespace, whose init adopts them.
Whether the command started is decided by runc's pid file: written, it runs; runc exiting
without it failed before starting anything (its stderr is its own error). Leaving before the
exit ends the command as Podman's path does: SIGTERM to its process group, SIGKILL after the
grace (drivers/podman_exec_end.py), by the PID runc wrote, pinned with a pidfd once it is this
process's child, and never reaped while it is being signalled.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import copy
import json
import logging
import os
import select
import shutil
import subprocess
import tempfile
import threading
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, Literal, TypeVar

from podman import PodmanClient

from drivers import podman_reaper
from drivers.podman_exec import NotStarted, OutputBuffer, _Done
from drivers.podman_exec_end import EXEC_GRACE, Ending, end_pinned, parent_of
from drivers.protocol import DriverError, ExecEvent, ExecExit, ExecOutput

log = logging.getLogger("sandstream.drivers.podman")

T = TypeVar("T")

ExecMode = Literal["auto", "runtime", "api"]
EXEC_MODES: Final = ("auto", "runtime", "api")
RUNC_ROOT: Final = Path("/run/runc")  # runc's own default for root, which rootful Podman keeps
_READ: Final = 65536
_DRAIN: Final = 16  # reads of what the output holds once the command has exited
_POLL: Final = 0.001  # seconds between looks at the pid file while runc starts the command
_START_WAIT: Final = 60.0  # seconds runc may take to start the command or fail
_GONE: Final = ("container does not exist", "paused", "stopped", "not running")


@dataclass(frozen=True)
class Runc:
    """The runtime Podman runs (its binary here) and its state root."""

    path: str
    root: Path

    def bundle(self, runtime_id: str) -> Path | None:
        """The container's bundle, from runc's state of it; None when runc (under this root,
        in this mount namespace) has no state of it: gone, stopped, or out of reach."""
        try:
            state = json.loads((self.root / runtime_id / "state.json").read_bytes())
        except (OSError, ValueError):
            return None
        for label in (state.get("config") or {}).get("labels") or []:
            if isinstance(label, str) and label.startswith("bundle="):
                return Path(label.removeprefix("bundle="))
        return None


def probe(
    base_url: str, mode: ExecMode, root: Path, request_timeout: float
) -> tuple[Runc | None, str]:
    """Whether this process can exec through the runtime: (the runtime, "") or (None, why
    not). Asks Podman (``GET /info``) which runtime it runs; ``mode`` "api" never does."""
    if mode == "api":
        return None, "SANDSTREAM_PODMAN_EXEC=api"
    if not base_url.startswith("unix://"):
        return None, f"Podman's socket is not local ({base_url})"
    if os.geteuid() != 0:
        return None, "this process does not run as root"
    with PodmanClient(base_url=base_url, timeout=request_timeout) as client:
        answer = client.api.get("/info")
        answer.raise_for_status()
        host = answer.json().get("host") or {}
    runtime = host.get("ociRuntime") or {}
    path = str(runtime.get("path") or "")
    if (host.get("security") or {}).get("rootless"):
        return None, "Podman is rootless"
    if runtime.get("name") != "runc":
        return None, f"Podman's OCI runtime is {runtime.get('name')!r}, not runc"
    if not os.access(path, os.X_OK):
        return None, f"Podman's runc ({path}) is not here"
    if not root.is_dir():
        return None, f"runc's state root {root} is not here"
    others = podman_reaper.strangers()
    if others:
        return None, (
            f"this process has child processes of its own (PIDs {others[:5]}), whose orphans "
            "it would adopt as the reaper of runc's commands"
        )
    try:
        podman_reaper.become()  # to reap each command runc leaves once it has started it
    except OSError as exc:
        return None, f"this process cannot reap runc's commands ({exc})"
    return Runc(path, root), ""


def exec_process(
    config: Mapping[str, Any],
    runtime_id: str,
    command: builtins.list[str],
    env: Mapping[str, str] | None,
    workdir: str | None,
) -> dict[str, Any]:
    """The exec's OCI process: the container's own (from its OCI ``config``), as Podman's
    exec derives it."""
    process = copy.deepcopy(dict(config["process"]))
    process["args"] = builtins.list(command)
    process["terminal"] = False
    process.pop("consoleSize", None)
    own = process.get("env") or []
    default = runtime_id[:12]
    if config.get("hostname") == default:
        # No hostname given: Podman names the container's own process's HOSTNAME (the ID's
        # first 12 characters) when it starts it, not its exec's.
        own = [entry for entry in own if entry != f"HOSTNAME={default}"]
    process["env"] = [*own, *(f"{k}={v}" for k, v in (env or {}).items())]
    if workdir:
        process["cwd"] = workdir
    user = process.get("user") or {}
    gids = user.get("additionalGids") or []
    if gids and gids[0] == user.get("gid"):
        # Podman puts the primary group first among a started container's supplementary
        # groups; its exec gives only the user's memberships and the container's group-adds.
        if gids[1:]:
            user["additionalGids"] = gids[1:]
        else:
            del user["additionalGids"]
    return process


def write_private(directory: Path, name: str, data: bytes) -> Path:
    """``data`` in a new file of mode 0600 (never through a link, never an existing file)."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return path


def _exit_for(message: str) -> int:
    """The exit code Podman's exec gives a command the runtime could not start."""
    if "no such file or directory" in message or "executable file not found" in message:
        return 127
    if "permission denied" in message or "operation not permitted" in message:
        return 126
    return 125


_SUFFIX: Final = {
    127: "OCI runtime attempted to invoke a command that was not found",
    126: "OCI permission denied",
    125: "OCI runtime error",
}


class _Run:
    """One ``runc exec --detach``: runc's process, its files, whether the command started,
    and the command's exit code once it has exited (reaped here: runc leaves it to us)."""

    def __init__(self, runc: Runc, runtime_id: str, process: dict[str, Any], stdin: bool) -> None:
        self.runtime_id = runtime_id
        self.dir = Path(tempfile.mkdtemp(prefix="sandstream-exec-"))  # 0700
        self.pid_file = self.dir / "pid"
        try:
            self.spec = write_private(self.dir, "process.json", json.dumps(process).encode())
            argv = [
                runc.path, "--root", str(runc.root), "exec", "--detach",
                "--process", str(self.spec), "--pid-file", str(self.pid_file), runtime_id,
            ]  # fmt: skip
            # A session of its own: a terminal's Ctrl-C to this process is not runc's to forward.
            self.proc = podman_reaper.start_runc(
                argv,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.decided = threading.Event()
        self.started = False
        self.threads: builtins.list[threading.Thread] = []  # the output's readers, once started
        self.fed = False  # the input's feeder started (it closes the input)
        self.code: int | None = None  # the command's exit code, once reaped
        self.lost = ""  # why the command's exit code is out of reach
        self.pidfd: int | None = None  # the command, pinned once it is this process's child
        self.pinned = threading.Event()  # pinned, or known never to be
        self.reaping = threading.Lock()  # held while the command is signalled: not reaped then
        # Readable once the command has exited (or runc without it) or the caller leaves:
        # wakes the readers and the input's feeder.
        self.wake_r, self.wake_w = os.pipe()
        self.watcher = threading.Thread(target=self._watch, name="runc-exec-wait", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        try:
            self.proc.wait()  # runc: it exits once the command runs (or failed to start it)
            podman_reaper.reaped(self.proc.pid)
            self.decided.wait()
            pid = self.pid() if self.started else None
            if pid is not None:
                self._reap(pid)
        finally:
            self.pinned.set()
            self.wake()

    def _reap(self, pid: int) -> None:
        """Wait for the command (reparented here when runc exited) and read its exit code."""
        if parent_of(pid) != os.getpid():  # not adopted: its PID is nothing of ours to wait on
            self.lost = f"the command (PID {pid}) is not this process's child once runc exited"
            return
        # An unreaped child: its PID (and its group's number) stay the command's until reaped.
        self.pidfd = os.pidfd_open(pid)
        self.pinned.set()
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited; not reaped yet
        with self.reaping:
            _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        self.code = code if code >= 0 else 128 - code  # killed: 128 + the signal, as Podman

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"\0")

    def decide(self) -> None:
        """Wait until the command has started (runc wrote its pid file) or runc has exited
        without starting it; then the process file goes."""
        wait = threading.Event()
        deadline = _START_WAIT / _POLL
        while not self.decided.is_set():
            if self.pid_file.exists():
                self.started = True
            elif self.proc.poll() is not None or deadline <= 0:
                self.started = self.pid_file.exists()
            else:
                deadline -= 1
                wait.wait(_POLL)
                continue
            with contextlib.suppress(OSError):
                self.spec.unlink()
            self.decided.set()

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def end(self, grace: float) -> Ending:
        """End the command if it still runs (its group: SIGTERM, SIGKILL after ``grace``)."""
        self.decided.wait(_START_WAIT)
        pid = self.pid() if self.started else None
        if pid is None or not self.pinned.wait(_START_WAIT):
            return "exited"
        with self.reaping:  # not reaped meanwhile: its PID and group stay the command's
            if self.pidfd is None or self.code is not None:
                return "exited"
            if select.select([self.pidfd], [], [], 0)[0]:  # exited (a pidfd reads ready)
                return "exited"
            return end_pinned(self.pidfd, pid, grace)

    def close(self) -> None:
        """The files go now; the pipes close, and runc is reaped, in the background."""
        shutil.rmtree(self.dir, ignore_errors=True)
        threading.Thread(target=self._release, name="runc-exec-reap", daemon=True).start()

    def _release(self) -> None:
        # Never under a reader (woken, a reader leaves once the caller has): a descriptor
        # closed under it could be another file's by its next read. The input's feeder closes
        # the input itself.
        for thread in self.threads:
            thread.join()
        pipes = [self.proc.stdout, self.proc.stderr, None if self.fed else self.proc.stdin]
        for pipe in pipes:
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self.proc.wait()
        self.watcher.join()  # the command reaped
        if self.pidfd is not None:
            os.close(self.pidfd)
        os.close(self.wake_r)
        os.close(self.wake_w)


def _in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """``fn`` in a daemon thread of its own, its result a future of the running loop: never in
    the loop's default executor (a few threads), which execs waiting on runc could fill. A
    cancelled wait leaves the thread running to its end."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # the waiter gets it
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, None, exc)
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="runc-exec-call", daemon=True).start()
    return future


def _feed(run: _Run, pipe: IO[bytes], data: bytes) -> None:
    """The command's input, then its end. Stops at the command's exit or the caller leaving
    (a background child may hold the input and never read it); a command gone already (no
    reader left) ends the write quietly."""
    fd = pipe.fileno()
    os.set_blocking(fd, False)
    rest = memoryview(data)
    with contextlib.suppress(OSError):
        while rest and not select.select([run.wake_r], [fd], [])[0]:
            with contextlib.suppress(BlockingIOError):
                rest = rest[os.write(fd, rest[:_READ]) :]
    with contextlib.suppress(OSError):
        pipe.close()


def _read(
    run: _Run,
    pipe: IO[bytes],
    stream: Literal["stdout", "stderr"],
    chunks: OutputBuffer,
    loop: asyncio.AbstractEventLoop,
    leaving: threading.Event,
    ended: Any,
) -> None:
    """One output into the buffer (waiting for room), until its end, the caller leaving, or
    the command's exit (then what the pipe holds already, at most _DRAIN reads: a child the
    command left in the background may hold the pipe open, and is not waited for)."""
    fd = pipe.fileno()
    try:
        while not leaving.is_set():
            ready = select.select([fd, run.wake_r], [], [])[0]
            draining = run.wake_r in ready
            for _ in range(_DRAIN if draining else 1):
                if leaving.is_set() or not select.select([fd], [], [], 0)[0]:
                    break
                data = os.read(fd, _READ)
                if not data:
                    draining = True
                    break
                if not chunks.put(loop, ExecOutput(stream, data), leaving):
                    return
            if draining:
                break
        if not leaving.is_set():
            ended(None)
    except Exception as exc:  # every failure goes to the caller
        ended(exc)


async def exec_stream(
    runc: Runc,
    runtime_id: str,
    command: builtins.list[str],
    *,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    stdin: bytes | None = None,
    grace: float = EXEC_GRACE,
    buffer: OutputBuffer | None = None,
) -> AsyncGenerator[ExecEvent, None]:
    """Run ``command`` in the container ``runtime_id`` through runc: as
    drivers/podman_exec.py's ``exec_stream`` does through Podman's API. NotStarted when the
    container is gone, stopped or paused (nothing ran)."""
    bundle = runc.bundle(runtime_id)
    if bundle is None:
        raise NotStarted(f"exec: no running container {runtime_id} for runc", retryable=False)
    try:
        config = json.loads((bundle / "config.json").read_bytes())
        process = exec_process(config, runtime_id, command, env, workdir)
    except (OSError, ValueError, KeyError) as exc:
        raise NotStarted(f"exec: the container's OCI config: {exc}", retryable=False) from exc
    loop = asyncio.get_running_loop()
    chunks = OutputBuffer() if buffer is None else buffer
    leaving = threading.Event()
    creating = _in_thread(lambda: _Run(runc, runtime_id, process, stdin is not None))
    try:
        run = await asyncio.shield(creating)
    except asyncio.CancelledError:  # runc may start the command still: it is ended then
        creating.add_done_callback(lambda made: _abandon(made, grace))
        raise
    readers = _readers(run, chunks, loop, leaving)
    exited = False
    try:
        await _in_thread(run.decide)
        if not run.started:
            if run.proc.poll() is None:  # runc hangs: nothing of the command ran
                run.proc.kill()
                raise DriverError(f"exec: runc started nothing in {_START_WAIT:g}s", retryable=True)
            async for event in _failed(run):
                yield event
            exited = True
            return
        if stdin is not None and run.proc.stdin is not None:
            run.fed = True
            threading.Thread(target=_feed, args=(run, run.proc.stdin, stdin), daemon=True,
                             name="runc-exec-stdin").start()  # fmt: skip
        for reader in readers:
            run.threads.append(reader)
            reader.start()
        while not isinstance(item := await chunks.get(), _Done):
            yield item
        if item.error is not None:
            raise DriverError(f"exec output broke off: {item.error}", retryable=True)
        await _in_thread(run.watcher.join)  # the command reaped
        if run.code is None:
            raise DriverError(
                f"exec: {run.lost or 'the command exit code is lost'}", retryable=False
            )
        exited = True
        yield ExecExit(run.code)
    finally:
        leaving.set()
        run.wake()  # a reader waiting for output looks up
        chunks.wake()  # a reader waiting for room reads no further
        if not exited:
            # In a thread of its own: the command is ended even if this wait is cancelled too.
            await _in_thread(lambda: _end(run, grace))
        run.close()


def _readers(
    run: _Run, chunks: OutputBuffer, loop: asyncio.AbstractEventLoop, leaving: threading.Event
) -> builtins.list[threading.Thread]:
    """The two output readers; the last one to end puts the end marker."""
    lock, left, errors = threading.Lock(), [2], builtins.list[BaseException]()

    def ended(error: BaseException | None) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            left[0] -= 1
            if left[0]:
                return
        chunks.end(loop, _Done(errors[0] if errors else None))

    pipes = (("stdout", run.proc.stdout), ("stderr", run.proc.stderr))
    return [
        threading.Thread(
            target=_read,
            args=(run, pipe, name, chunks, loop, leaving, ended),
            name=f"runc-exec-{name}",
            daemon=True,
        )
        for name, pipe in pipes
    ]


async def _failed(run: _Run) -> AsyncGenerator[ExecEvent, None]:
    """runc exited without starting the command: what Podman's exec answers then."""
    assert run.proc.stderr is not None
    said = await _in_thread(run.proc.stderr.read)
    message = said.decode(errors="replace").strip() or f"runc exited {run.proc.returncode}"
    if any(gone in message for gone in _GONE):
        raise NotStarted(f"exec: {message}", retryable=False)
    if "unable to start container process" not in message:
        raise DriverError(f"exec: runc: {message}", retryable=True)
    code = _exit_for(message)
    yield ExecOutput("stderr", f"Error: runc: {message}: {_SUFFIX[code]}\n".encode())
    yield ExecExit(code)


def _abandon(made: asyncio.Future[_Run], grace: float) -> None:
    """A run its caller left while runc was being started: its command ended, its files gone."""
    if made.cancelled() or made.exception() is not None:
        return
    run = made.result()

    def ending() -> None:
        run.decide()
        _end(run, grace)
        run.close()

    threading.Thread(target=ending, name="runc-exec-abandoned", daemon=True).start()


def _end(run: _Run, grace: float) -> None:
    try:
        ending = run.end(grace)
    except Exception as exc:  # the caller is leaving already: say it, do not replace why
        log.warning("runc exec in %s left before its exit; ending its command failed: %s",
                    run.runtime_id, exc)  # fmt: skip
    else:
        if ending in ("terminated", "killed"):
            log.info("runc exec left before its exit: its command %s", ending)
