"""The asynchronous face: :class:`AsyncSandbox`, its ``commands`` and ``files`` (the same
calls as the synchronous face, awaited)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Literal, overload

import httpx

from sandstream_sdk import commands as _commands
from sandstream_sdk import files as _files
from sandstream_sdk import lifecycle
from sandstream_sdk._transport import AsyncTransport, Call, Config, SseParser
from sandstream_sdk.errors import NotFoundError, NotReadyError, TimeoutError
from sandstream_sdk.logs import lines_of, logs_call
from sandstream_sdk.models import CommandResult, EntryInfo, LogLine, SandboxInfo


class AsyncCommands:
    """``sb.commands``: run commands inside the sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        on_stdout: _commands.AsyncOutputHandler | None = None,
        on_stderr: _commands.AsyncOutputHandler | None = None,
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
            result = CommandResult.model_validate((await transport.send(call)).json())
            return _commands.checked(result, check)
        folded, parser = _commands.Streamed(), SseParser()
        handlers = {"stdout": on_stdout, "stderr": on_stderr}
        async with transport.stream(call) as response:
            async for line in response.aiter_lines():
                event = parser.feed(line)
                if event is None:
                    continue
                output = folded.take(*event)
                if output is not None and (handler := handlers[output[0]]) is not None:
                    done = handler(output[1])
                    if inspect.isawaitable(done):
                        await done
        return _commands.checked(folded.finish(), check)


class AsyncFiles:
    """``sb.files``: read and write files inside the sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def _send(self, call: Call) -> httpx.Response:
        return await self._sandbox._transport.send(call)

    async def write(self, path: str, data: str | bytes) -> EntryInfo:
        """Write the file (its parents made); a str is written as UTF-8."""
        response = await self._send(_files.write_call(self._sandbox.name, path, data))
        return _files.entry_of(response.json())

    @overload
    async def read(self, path: str, format: Literal["text"] = "text") -> str: ...
    @overload
    async def read(self, path: str, format: Literal["bytes"]) -> bytes: ...
    async def read(self, path: str, format: str = "text") -> str | bytes:
        """The whole file, in memory (a large one: :meth:`read_stream`, :meth:`download`)."""
        response = await self._send(_files.read_call(self._sandbox.name, path))
        return _files.decoded(response.content, format)

    @contextlib.asynccontextmanager
    async def read_stream(
        self, path: str, *, chunk_size: int = _files.CHUNK_SIZE
    ) -> AsyncIterator[_files.AsyncFileChunks]:
        """The file's bytes in chunks as they arrive (``async with ... as chunks: async for
        chunk in chunks``); as the synchronous face's ``read_stream``."""
        call = _files.stream_call(self._sandbox.name, path, chunk_size)
        async with self._sandbox._transport.stream(call) as response:
            yield _files.AsyncFileChunks(response, path, chunk_size)

    async def download(
        self,
        path: str,
        local_path: str | os.PathLike[str],
        *,
        chunk_size: int = _files.CHUNK_SIZE,
    ) -> Path:
        """Stream the file to ``local_path``; as the synchronous face's ``download`` (each
        chunk is written to the local file as it arrives, from the event loop's thread)."""
        target, partial = _files.landing(path, local_path)
        try:
            # The stream's errors come first: no part is made for a download refused.
            async with self.read_stream(path, chunk_size=chunk_size) as chunks:
                with partial.open("wb") as handle:
                    async for chunk in chunks:
                        handle.write(chunk)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    async def list(self, path: str = ".") -> list[EntryInfo]:
        return _files.entries_of(
            (await self._send(_files.list_call(self._sandbox.name, path))).json()
        )

    async def get_info(self, path: str) -> EntryInfo:
        return _files.entry_of(
            (await self._send(_files.stat_call(self._sandbox.name, path))).json()
        )

    async def exists(self, path: str) -> bool:
        try:
            await self.get_info(path)
        except NotFoundError:
            return False
        return True

    async def make_dir(self, path: str) -> bool:
        """Make the directory and its parents: True, or False when it existed already."""
        if await self.exists(path):
            return False
        await self._send(_files.mkdir_call(self._sandbox.name, path))
        return True

    async def remove(self, path: str) -> None:
        """Remove a file, or a directory with all in it."""
        await self._send(_files.remove_call(self._sandbox.name, path))

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        response = await self._send(_files.move_call(self._sandbox.name, old_path, new_path))
        return _files.entry_of(response.json())


class AsyncSandbox:
    """A sandbox: made with :meth:`create` or found with :meth:`connect`. As a context
    manager it is killed (deleted) when the block ends, as E2B's is."""

    def __init__(self, info: SandboxInfo, transport: AsyncTransport, wait: float) -> None:
        self.info = info
        self._transport = transport
        self._wait = wait
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def sandbox_id(self) -> str:
        """The name: sandstream addresses a sandbox by it (``info.id`` is the incarnation)."""
        return self.info.name

    @classmethod
    async def create(
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
    ) -> AsyncSandbox:
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
        transport = AsyncTransport(Config.of(api_url, token, request_timeout))
        created = False
        try:
            await transport.send(call)
            created = True
            info = lifecycle.info_of((await transport.send(lifecycle.get_call(name))).json())
            sandbox = cls(info, transport, wait_timeout)
            await sandbox._until("Ready")
        except BaseException:
            if created:  # never handed out, so nobody else would delete it
                with contextlib.suppress(Exception):
                    await transport.send(lifecycle.delete_call(name))
            await transport.close()
            raise
        return sandbox

    @classmethod
    async def connect(cls, name: str, *, auto_resume: bool = True, api_url: str | None = None,
                token: str | None = None, request_timeout: float | None = None,
                wait_timeout: float = lifecycle.DEFAULT_WAIT) -> AsyncSandbox:  # fmt: skip
        """The existing sandbox ``name`` (NotFoundError when there is none). A suspended one
        (Suspended, or Suspending: waited for) is resumed and waited for until Ready, as E2B's
        connect does with a paused sandbox (not one whose time to live ended: NotReadyError,
        as for a wake on access); ``auto_resume=False`` leaves it as it is."""
        transport = AsyncTransport(Config.of(api_url, token, request_timeout))
        try:
            info = lifecycle.info_of((await transport.send(lifecycle.get_call(name))).json())
            sandbox = cls(info, transport, wait_timeout)
            if auto_resume and info.phase in ("Suspending", "Suspended"):
                await sandbox._resume(implicit=True)
        except BaseException:
            await transport.close()
            raise
        return sandbox

    async def get_info(self) -> SandboxInfo:
        self.info = lifecycle.info_of(
            (await self._transport.send(lifecycle.get_call(self.name))).json()
        )
        return self.info

    async def is_running(self) -> bool:
        try:
            return (await self.get_info()).phase == "Ready"
        except NotFoundError:
            return False

    async def stop(self, *, expected_version: int | None = None) -> None:
        """Stop it (its files stay) and wait until it is Stopped; ``expected_version``: only
        if the sandbox is at that version (else VersionConflictError)."""
        body = lifecycle.versioned(expected_version)
        await self._transport.send(lifecycle.command_call(self.name, "stop", body))
        await self._until("Stopped")

    async def start(self, *, expected_version: int | None = None) -> None:
        """Start it again (a new runtime, the same workspace) and wait until it is Ready;
        ``expected_version`` as for :meth:`stop`."""
        body = lifecycle.versioned(expected_version)
        await self._transport.send(lifecycle.command_call(self.name, "start", body))
        await self._until("Ready")

    async def pause(self, *, expected_version: int | None = None) -> str:
        """Suspend it (E2B's pause) and wait until it is Suspended: its runtime removed, its
        workspace and everything it is kept; its name, for :meth:`connect`. On Podman with
        memory kept (the server's setting) its processes resume where they were; else they
        start afresh on the kept workspace. ``expected_version`` as for :meth:`stop`."""
        body = lifecycle.versioned(expected_version)
        await self._transport.send(lifecycle.command_call(self.name, "suspend", body))
        await self._until("Suspended")
        return self.name

    async def resume(self) -> None:
        """Resume it and wait until it is Ready (a Suspending one is waited for first; a
        Ready one, or one another caller resumes, is waited for only). A command or file call
        resumes it too, on the server."""
        await self._resume(implicit=False)

    async def _resume(self, *, implicit: bool) -> None:
        """``implicit`` (``connect``): a sandbox whose time to live ended is not brought back
        (NotReadyError), as the server's wake on access does not."""
        info = await self.get_info()
        if info.phase == "Suspending":  # it may end Suspended, or Ready (the suspend failed)
            await self._until("suspend settled")
            info = self.info
        if implicit and (why := lifecycle.expired_while_suspended(info)) is not None:
            raise NotReadyError(why, status=412, code="FAILED_PRECONDITION")
        if lifecycle.resumable(info):
            call = lifecycle.command_call(self.name, "resume", lifecycle.wake_body(info))
            await self._transport.send(call)
        await self._until("Ready")

    async def set_idle_suspend(self, seconds: int | None) -> None:
        """Suspend it after ``seconds`` without use through sandstream; None: never."""
        body = {"idle_suspend_seconds": seconds}
        await self._transport.send(lifecycle.command_call(self.name, "idle-suspend", body))

    async def kill(self) -> bool:
        """Delete it and wait until it is gone: True, or False when it was gone already."""
        try:
            await self._transport.send(lifecycle.delete_call(self.name))
        except NotFoundError:
            return False
        await self._until("gone")
        return True

    async def set_timeout(self, timeout: float) -> None:
        """A new time to live: ``timeout`` seconds from now."""
        await self._transport.send(
            lifecycle.command_call(self.name, "extend", {"ttl_seconds": timeout})
        )

    async def logs(
        self, *, tail: int | None = None, since: datetime | None = None
    ) -> list[LogLine]:
        """What its main process wrote (stdout and stderr), oldest first."""
        return lines_of((await self._transport.send(logs_call(self.name, tail, since))).text)

    async def close(self) -> None:
        """Close the connection (the sandbox stays)."""
        await self._transport.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        try:
            await self.kill()
        finally:
            await self.close()

    async def _until(self, goal: lifecycle.Goal) -> None:
        deadline = time.monotonic() + self._wait
        while True:
            try:
                info: SandboxInfo | None = await self.get_info()
            except NotFoundError:
                info = None
            if lifecycle.settled(goal, info):
                return
            if time.monotonic() >= deadline:
                phase = info.phase if info else "gone"
                raise TimeoutError(f"sandbox {self.name!r} is {phase}, not {goal} after "
                                   f"{self._wait:g}s")  # fmt: skip
            await asyncio.sleep(lifecycle.POLL_SECONDS)
