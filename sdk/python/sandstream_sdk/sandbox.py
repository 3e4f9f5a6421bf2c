"""The synchronous face: :class:`Sandbox`, its ``commands`` and ``files``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Literal, overload

import httpx

from sandstream_sdk import commands as _commands
from sandstream_sdk import files as _files
from sandstream_sdk import lifecycle
from sandstream_sdk._transport import Call, Config, SseParser, SyncTransport
from sandstream_sdk.errors import NotFoundError, NotReadyError, TimeoutError
from sandstream_sdk.logs import lines_of, logs_call
from sandstream_sdk.models import CommandResult, EntryInfo, LogLine, SandboxInfo


class Commands:
    """``sb.commands``: run commands inside the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        on_stdout: _commands.OutputHandler | None = None,
        on_stderr: _commands.OutputHandler | None = None,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = 60,
        stdin: str | None = None,
        check: bool = True,
    ) -> CommandResult:
        """Run ``cmd`` (a string through ``sh -c``, or an argv list) and wait for its end.
        With ``on_stdout``/``on_stderr`` the output is streamed to them as it comes (its first
        MiB per output kept in the result); without, the result holds each output up to the
        server's limit (``stdout_truncated`` says when cut). ``timeout`` (seconds; None: the
        server's limit) ends the command and raises TimeoutError; a non-zero exit raises
        CommandExitError unless ``check=False``."""
        stream = on_stdout is not None or on_stderr is not None
        call = _commands.run_call(self._sandbox.name, cmd, env=envs, cwd=cwd, timeout=timeout,
                                  stdin=stdin, stream=stream)  # fmt: skip
        transport = self._sandbox._transport
        if not stream:
            result = CommandResult.model_validate(transport.send(call).json())
            return _commands.checked(result, check)
        folded, parser = _commands.Streamed(), SseParser()
        handlers = {"stdout": on_stdout, "stderr": on_stderr}
        with transport.stream(call) as response:
            for line in response.iter_lines():
                event = parser.feed(line)
                if event is None:
                    continue
                output = folded.take(*event)
                if output is not None and (handler := handlers[output[0]]) is not None:
                    handler(output[1])
        return _commands.checked(folded.finish(), check)


class Files:
    """``sb.files``: read and write files inside the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def _send(self, call: Call) -> httpx.Response:
        return self._sandbox._transport.send(call)

    def write(self, path: str, data: str | bytes) -> EntryInfo:
        """Write the file (its parents made); a str is written as UTF-8."""
        response = self._send(_files.write_call(self._sandbox.name, path, data))
        return _files.entry_of(response.json())

    @overload
    def read(self, path: str, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, format: Literal["bytes"]) -> bytes: ...
    def read(self, path: str, format: str = "text") -> str | bytes:
        """The whole file, in memory (a large one: :meth:`read_stream`, :meth:`download`)."""
        response = self._send(_files.read_call(self._sandbox.name, path))
        return _files.decoded(response.content, format)

    @contextlib.contextmanager
    def read_stream(
        self, path: str, *, chunk_size: int = _files.CHUNK_SIZE
    ) -> Iterator[_files.FileChunks]:
        """The file's bytes in chunks as they arrive, never the whole file in memory::

            with sb.files.read_stream("data.bin") as chunks:
                for chunk in chunks:
                    ...

        The ``with`` raises what :meth:`read` raises (NotFoundError, NotReadyError, ...)
        before any byte, and waits for a suspended sandbox's wake as it does; a body broken
        off midway raises UnavailableError. Leaving the block early closes the connection:
        the rest is not read."""
        call = _files.stream_call(self._sandbox.name, path, chunk_size)
        with self._sandbox._transport.stream(call) as response:
            yield _files.FileChunks(response, path, chunk_size)

    def download(
        self,
        path: str,
        local_path: str | os.PathLike[str],
        *,
        chunk_size: int = _files.CHUNK_SIZE,
    ) -> Path:
        """Stream the file to ``local_path`` (an existing directory receives it under its own
        name) and return where it landed. It is written to ``.NAME.part`` beside it and
        renamed over it once whole: a failed download leaves nothing, not a part."""
        target, partial = _files.landing(path, local_path)
        try:
            # The stream's errors come first: no part is made for a download refused.
            with (
                self.read_stream(path, chunk_size=chunk_size) as chunks,
                partial.open("wb") as handle,
            ):
                for chunk in chunks:
                    handle.write(chunk)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    def list(self, path: str = ".") -> list[EntryInfo]:
        return _files.entries_of(self._send(_files.list_call(self._sandbox.name, path)).json())

    def get_info(self, path: str) -> EntryInfo:
        return _files.entry_of(self._send(_files.stat_call(self._sandbox.name, path)).json())

    def exists(self, path: str) -> bool:
        try:
            self.get_info(path)
        except NotFoundError:
            return False
        return True

    def make_dir(self, path: str) -> bool:
        """Make the directory and its parents: True, or False when it existed already."""
        if self.exists(path):
            return False
        self._send(_files.mkdir_call(self._sandbox.name, path))
        return True

    def remove(self, path: str) -> None:
        """Remove a file, or a directory with all in it."""
        self._send(_files.remove_call(self._sandbox.name, path))

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        response = self._send(_files.move_call(self._sandbox.name, old_path, new_path))
        return _files.entry_of(response.json())


class Sandbox:
    """A sandbox: made with :meth:`create` or found with :meth:`connect`. As a context
    manager it is killed (deleted) when the block ends, as E2B's is."""

    def __init__(self, info: SandboxInfo, transport: SyncTransport, wait: float) -> None:
        self.info = info
        self._transport = transport
        self._wait = wait
        self.commands = Commands(self)
        self.files = Files(self)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def sandbox_id(self) -> str:
        """The name: sandstream addresses a sandbox by it (``info.id`` is the incarnation)."""
        return self.info.name

    @classmethod
    def create(
        cls,
        image: str | None = None,
        *,
        template: str | None = None,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
        idle_suspend: int | None = None,
        api_url: str | None = None,
        token: str | None = None,
        request_timeout: float | None = None,
        wait_timeout: float = lifecycle.DEFAULT_WAIT,
    ) -> Sandbox:
        """Create a sandbox running ``image`` and wait until it is Ready. ``timeout``: its
        time to live in seconds (then it is stopped; default: the server's); ``command``:
        its main process (default: ``sleep infinity``, so that it stays up for commands);
        ``name``: default a random ``sb-…``. ``template``: a template's name
        (``NAME`` or ``NAME:REVISION``) instead of ``image``: its spec, with ``env`` added or
        replaced, ``labels`` added and ``timeout`` as the time to live. ``idle_suspend``:
        seconds without use through sandstream (commands, files, logs) after which the server
        suspends it; the next command or file call resumes it (not with ``template``, whose
        spec sets it: use :meth:`set_idle_suspend` after)."""
        name = name or lifecycle.new_name()
        call = lifecycle.create_call(
            name, image, template, command=command, env=env or envs, labels=labels,
            timeout=timeout, idle_suspend=idle_suspend,
        )  # fmt: skip
        transport = SyncTransport(Config.of(api_url, token, request_timeout))
        created = False
        try:
            transport.send(call)
            created = True
            info = lifecycle.info_of(transport.send(lifecycle.get_call(name)).json())
            sandbox = cls(info, transport, wait_timeout)
            sandbox._until("Ready")
        except BaseException:
            if created:  # never handed out, so nobody else would delete it
                with contextlib.suppress(Exception):
                    transport.send(lifecycle.delete_call(name))
            transport.close()
            raise
        return sandbox

    @classmethod
    def connect(cls, name: str, *, auto_resume: bool = True, api_url: str | None = None,
                token: str | None = None, request_timeout: float | None = None,
                wait_timeout: float = lifecycle.DEFAULT_WAIT) -> Sandbox:  # fmt: skip
        """The existing sandbox ``name`` (NotFoundError when there is none). A suspended one
        (Suspended, or Suspending: waited for) is resumed and waited for until Ready, as E2B's
        connect does with a paused sandbox (not one whose time to live ended: NotReadyError,
        as for a wake on access); ``auto_resume=False`` leaves it as it is."""
        transport = SyncTransport(Config.of(api_url, token, request_timeout))
        try:
            info = lifecycle.info_of(transport.send(lifecycle.get_call(name)).json())
            sandbox = cls(info, transport, wait_timeout)
            if auto_resume and info.phase in ("Suspending", "Suspended"):
                sandbox._resume(implicit=True)
        except BaseException:
            transport.close()
            raise
        return sandbox

    def get_info(self) -> SandboxInfo:
        self.info = lifecycle.info_of(self._transport.send(lifecycle.get_call(self.name)).json())
        return self.info

    def is_running(self) -> bool:
        try:
            return self.get_info().phase == "Ready"
        except NotFoundError:
            return False

    def stop(self, *, expected_version: int | None = None) -> None:
        """Stop it (its files stay) and wait until it is Stopped; ``expected_version``: only
        if the sandbox is at that version (else VersionConflictError)."""
        body = lifecycle.versioned(expected_version)
        self._transport.send(lifecycle.command_call(self.name, "stop", body))
        self._until("Stopped")

    def start(self, *, expected_version: int | None = None) -> None:
        """Start it again (a new runtime, the same workspace) and wait until it is Ready;
        ``expected_version`` as for :meth:`stop`."""
        body = lifecycle.versioned(expected_version)
        self._transport.send(lifecycle.command_call(self.name, "start", body))
        self._until("Ready")

    def pause(self, *, expected_version: int | None = None) -> str:
        """Suspend it (E2B's pause) and wait until it is Suspended: its runtime removed, its
        workspace and everything it is kept; its name, for :meth:`connect`. On Podman with
        memory kept (the server's setting) its processes resume where they were; else they
        start afresh on the kept workspace. ``expected_version`` as for :meth:`stop`."""
        body = lifecycle.versioned(expected_version)
        self._transport.send(lifecycle.command_call(self.name, "suspend", body))
        self._until("Suspended")
        return self.name

    def resume(self) -> None:
        """Resume it and wait until it is Ready (a Suspending one is waited for first; a
        Ready one, or one another caller resumes, is waited for only). A command or file call
        resumes it too, on the server."""
        self._resume(implicit=False)

    def _resume(self, *, implicit: bool) -> None:
        """``implicit`` (``connect``): a sandbox whose time to live ended is not brought back
        (NotReadyError), as the server's wake on access does not."""
        info = self.get_info()
        if info.phase == "Suspending":  # it may end Suspended, or Ready (the suspend failed)
            self._until("suspend settled")
            info = self.info
        if implicit and (why := lifecycle.expired_while_suspended(info)) is not None:
            raise NotReadyError(why, status=412, code="FAILED_PRECONDITION")
        if lifecycle.resumable(info):
            call = lifecycle.command_call(self.name, "resume", lifecycle.wake_body(info))
            self._transport.send(call)
        self._until("Ready")

    def set_idle_suspend(self, seconds: int | None) -> None:
        """Suspend it after ``seconds`` without use through sandstream; None: never."""
        body = {"idle_suspend_seconds": seconds}
        self._transport.send(lifecycle.command_call(self.name, "idle-suspend", body))

    def kill(self) -> bool:
        """Delete it and wait until it is gone: True, or False when it was gone already."""
        try:
            self._transport.send(lifecycle.delete_call(self.name))
        except NotFoundError:
            return False
        self._until("gone")
        return True

    def set_timeout(self, timeout: float) -> None:
        """A new time to live: ``timeout`` seconds from now."""
        self._transport.send(lifecycle.command_call(self.name, "extend", {"ttl_seconds": timeout}))

    def logs(self, *, tail: int | None = None, since: datetime | None = None) -> list[LogLine]:
        """What its main process wrote (stdout and stderr), oldest first."""
        return lines_of(self._transport.send(logs_call(self.name, tail, since)).text)

    def close(self) -> None:
        """Close the connection (the sandbox stays)."""
        self._transport.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        try:
            self.kill()
        finally:
            self.close()

    def _until(self, goal: lifecycle.Goal) -> None:
        deadline = time.monotonic() + self._wait
        while True:
            try:
                info: SandboxInfo | None = self.get_info()
            except NotFoundError:
                info = None
            if lifecycle.settled(goal, info):
                return
            if time.monotonic() >= deadline:
                phase = info.phase if info else "gone"
                raise TimeoutError(f"sandbox {self.name!r} is {phase}, not {goal} after "
                                   f"{self._wait:g}s")  # fmt: skip
            time.sleep(lifecycle.POLL_SECONDS)
