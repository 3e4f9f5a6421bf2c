"""Streamed exec in a Podman container: Podman's exec API, read by a thread into a bounded
buffer (the thread waits while the caller has OUTPUT_CHUNKS chunks not yet taken).

``POST /containers/{id}/exec`` creates the exec session, ``POST /exec/{id}/start`` streams the
output multiplexed in frames (an 8-byte header: stream type, three zero bytes, big-endian
length), and ``GET /exec/{id}/json`` gives the exit code once the stream has ended. The
command runs inside the container: nothing is spawned in the calling process.

With input (``stdin``), a command that exits without reading all of it makes Podman break the
stream off (``connection reset``, after an ``Error: ... attach ...`` line on stderr): output not
delivered by then is lost, but the exit code is still read and reported.

Leaving the iteration before the exit (a deadline, a cancelled caller) ends the command: SIGTERM
to its process group, SIGKILL after a grace, from the host by the session's PID
(drivers/podman_exec_end.py says how, and when it cannot); the iteration ends after that.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import socket
import struct
import threading
from collections.abc import AsyncGenerator, Iterator, Mapping
from typing import Any, Final

from podman import PodmanClient

from drivers.podman_exec_end import EXEC_GRACE, end_exec
from drivers.protocol import DriverError, ExecEvent, ExecExit, ExecOutput

log = logging.getLogger("sandstream.drivers.podman")

_STREAMS: Final = {1: "stdout", 2: "stderr"}
_HEADER: Final = struct.Struct(">BxxxL")
OUTPUT_CHUNKS: Final = 16  # output chunks (frames of Podman's stream) read ahead of the caller


class NotStarted(DriverError):
    """The command never started: the container is gone, stopped or paused. A caller that
    named the container by a remembered id may look it up again and retry."""


class _Done:
    """Queue marker: the output ended (``error`` says why, None for a clean end)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class OutputBuffer:
    """The chunks the reading thread has handed over and the caller has not taken yet: at most
    ``size``. The thread waits for room before it reads on (so Podman's stream, and the command
    writing into it, wait for a caller that does not read); the end marker takes no room.
    ``most`` is the largest number ever held, ``waiting`` whether the thread waits for room."""

    def __init__(self, size: int = OUTPUT_CHUNKS) -> None:
        if size < 1:
            raise ValueError("an output buffer holds one chunk at least")
        self.size = size
        self.most = 0
        self.waiting = False
        self._room = threading.Semaphore(size)
        self._held = 0
        self._count = threading.Lock()
        self._queue: asyncio.Queue[ExecOutput | _Done] = asyncio.Queue()

    @property
    def held(self) -> int:
        return self._held

    def put(
        self, loop: asyncio.AbstractEventLoop, item: ExecOutput, leaving: threading.Event
    ) -> bool:
        """From the thread: hand ``item`` over once there is room; False when the caller left
        meanwhile (nothing handed over)."""
        if not self._room.acquire(blocking=False):
            self.waiting = True
            self._room.acquire()
            self.waiting = False
        if leaving.is_set():
            self._room.release()
            return False
        with self._count:
            self._held += 1
            self.most = max(self.most, self._held)
        self._hand(loop, item)
        return True

    def end(self, loop: asyncio.AbstractEventLoop, done: _Done) -> None:
        """From the thread: the end marker (it takes no room)."""
        self._hand(loop, done)

    def _hand(self, loop: asyncio.AbstractEventLoop, item: ExecOutput | _Done) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> ExecOutput | _Done:
        item = await self._queue.get()
        if isinstance(item, ExecOutput):
            with self._count:
                self._held -= 1
            self._room.release()
        return item

    def wake(self) -> None:
        """The caller is leaving: a thread waiting for room wakes (and hands nothing over)."""
        self._room.release()


def _read_exact(raw: Any, size: int) -> bytes:
    """``size`` bytes, fewer only at the end of the stream."""
    chunks = []
    while size > 0:
        chunk = raw.read(size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def frames(raw: Any) -> Iterator[ExecOutput]:
    """The frames of a multiplexed exec stream (stdin frames, type 0, are dropped)."""
    while True:
        header = _read_exact(raw, _HEADER.size)
        if len(header) < _HEADER.size:
            return
        kind, length = _HEADER.unpack(header)
        data = _read_exact(raw, length)
        stream = _STREAMS.get(kind)
        if stream is not None and data:
            yield ExecOutput(stream, data)  # type: ignore[arg-type]
        if len(data) < length:
            return


def _socket_of(response: Any) -> socket.socket | None:
    raw = getattr(response, "raw", None)
    connection = getattr(raw, "connection", None) or getattr(raw, "_connection", None)
    sock = getattr(connection, "sock", None)
    if isinstance(sock, socket.socket):
        return sock
    # urllib3 may have let go of the connection object: the socket behind the file it reads
    fp = getattr(getattr(raw, "_fp", None), "fp", None)
    sock = getattr(getattr(fp, "raw", None), "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _feed(response: Any, stdin: bytes) -> None:
    """Write ``stdin`` into the attached stream, then close its writing half (the command
    reads the end of its input). In a thread of its own: a command that does not read its
    input holds the write, never the output. A command gone already ends the write quietly."""
    sock = _socket_of(response)
    if sock is None:
        log.warning("exec: no socket to write the command's input into")
        return
    with contextlib.suppress(OSError):
        sock.sendall(stdin)
        sock.shutdown(socket.SHUT_WR)


def _shutdown(response: Any) -> None:
    """Shut the stream's socket down, which wakes the thread blocked reading it. Never close
    the response here: closing waits for the reading thread's buffer lock (the thread closes
    it itself once woken)."""
    sock = _socket_of(response)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _improper(response: Any) -> bool:
    """Podman 4.3 refuses an exec in a stopped container with a 500 "container state
    improper" rather than a 409."""
    return bool(response.status_code == 500 and "state improper" in response.text)


def _exec_body(
    command: builtins.list[str],
    env: Mapping[str, str] | None,
    workdir: str | None,
    stdin: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "AttachStdin": stdin,
        "AttachStdout": True,
        "AttachStderr": True,
        "Tty": False,
        "Cmd": builtins.list(command),
    }
    if env:
        body["Env"] = [f"{k}={v}" for k, v in env.items()]
    if workdir:
        body["WorkingDir"] = workdir
    return body


async def exec_stream(
    base_url: str,
    runtime_id: str,
    command: builtins.list[str],
    *,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    stdin: bytes | None = None,
    request_timeout: float = 60.0,
    grace: float = EXEC_GRACE,
    buffer: OutputBuffer | None = None,
) -> AsyncGenerator[ExecEvent, None]:
    """Run ``command`` in the container ``runtime_id``: its output as it comes, then the exit.
    ``stdin``: the command's input, then its end (None: no input attached, as ``< /dev/null``).
    Left before the exit, the command is ended (``grace``: seconds from SIGTERM to SIGKILL).
    At most ``buffer.size`` chunks (OUTPUT_CHUNKS by default) are read ahead of the caller."""
    loop = asyncio.get_running_loop()
    chunks = OutputBuffer() if buffer is None else buffer
    started: asyncio.Future[str] = loop.create_future()
    leaving = threading.Event()
    starting = threading.Lock()  # held from the leaving check until the session has started
    holder: dict[str, Any] = {}

    def settle(value: str | BaseException) -> None:
        def _set() -> None:
            if started.done():
                return
            if isinstance(value, BaseException):
                started.set_exception(value)
            else:
                started.set_result(value)

        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set)

    def run() -> None:
        client = PodmanClient(base_url=base_url, timeout=request_timeout)
        response: Any = None
        try:
            created = client.api.post(
                f"/containers/{runtime_id}/exec",
                data=json.dumps(_exec_body(command, env, workdir, stdin is not None)),
            )
            if created.status_code == 404:
                settle(NotStarted(f"exec: no container {runtime_id}", retryable=False))
                return
            if created.status_code == 409 or _improper(created):
                settle(NotStarted("exec: the runtime is not running", retryable=False))
                return
            created.raise_for_status()
            exec_id = holder["exec_id"] = str(created.json()["Id"])
            with starting:  # a caller gone by now finds the session either started or never
                if leaving.is_set():
                    return
                # The output may idle for as long as the command likes: no read timeout.
                response = client.api.post(
                    f"/exec/{exec_id}/start",
                    data=json.dumps({"Detach": False, "Tty": False}),
                    stream=True,
                    timeout=(request_timeout, None),
                )
            if response.status_code == 409:
                settle(NotStarted("exec: the runtime is not running", retryable=False))
                return
            response.raise_for_status()
            holder["response"] = response
            settle(exec_id)
            if leaving.is_set():
                return
            if stdin is not None:
                feeder = threading.Thread(
                    target=_feed, args=(response, stdin), name="podman-exec-stdin", daemon=True
                )
                feeder.start()
            for output in frames(response.raw):
                if leaving.is_set() or not chunks.put(loop, output, leaving):
                    return
            chunks.end(loop, _Done(None))
        except Exception as exc:  # every failure goes to the caller
            if not started.done():
                settle(exc)
            chunks.end(loop, _Done(exc))
        finally:
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()
            client.close()  # type: ignore[no-untyped-call]

    def end() -> None:
        with starting:
            exec_id = holder.get("exec_id")
        if exec_id is None:
            return
        try:
            ending = end_exec(base_url, exec_id, grace=grace, request_timeout=request_timeout)
        except Exception as exc:  # the caller is leaving already: say it, do not replace why
            log.warning("exec %s left before its exit; ending its command failed: %s",
                        exec_id, exc)  # fmt: skip
        else:
            if ending in ("terminated", "killed"):
                log.info("exec %s left before its exit: its command %s", exec_id, ending)

    thread = threading.Thread(target=run, name="podman-exec", daemon=True)
    thread.start()
    exited = False
    try:
        try:
            exec_id = await started
        except DriverError:
            raise
        except Exception as exc:
            raise DriverError(f"exec failed: {exc}", retryable=False) from exc
        while not isinstance(item := await chunks.get(), _Done):
            yield item
        if item.error is not None and stdin is None:
            raise DriverError(f"exec output broke off: {item.error}", retryable=True)
        try:
            code = await asyncio.to_thread(_exit_code, base_url, exec_id, request_timeout)
        except Exception as exc:
            why = item.error or exc
            raise DriverError(f"exec output broke off: {why}", retryable=True) from exc
        exited = True
        yield ExecExit(code)
    finally:
        leaving.set()
        chunks.wake()  # a thread waiting for room reads no further
        response = holder.get("response")
        if response is not None:
            _shutdown(response)
        if not exited:
            # In a thread of its own: the command is ended even if this wait is cancelled too.
            await asyncio.to_thread(end)


def _exit_code(base_url: str, exec_id: str, request_timeout: float) -> int:
    with PodmanClient(base_url=base_url, timeout=request_timeout) as client:
        # The stream ends when the process's output closes; the exit is recorded just after.
        for _ in range(50):
            info = client.api.get(f"/exec/{exec_id}/json")
            info.raise_for_status()
            body = info.json()
            if not body.get("Running") and body.get("ExitCode") is not None:
                return int(body["ExitCode"])
            threading.Event().wait(0.02)
    raise DriverError(f"exec {exec_id}: no exit code recorded", retryable=True)
