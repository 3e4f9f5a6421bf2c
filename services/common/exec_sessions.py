"""What both exec doors (the HTTP API's ``POST /v1/sandboxes/{name}/exec`` and OpenShell's
ExecSandbox) hold a command to: a deadline, and at most so many sessions open at once per
token, per sandbox and in all (each session holds a thread reading the runtime's stream while
it runs). ``sandstream up`` gives both doors one :class:`ExecLimits`, so the counts are shared.
Both check a command's argv, environment and working directory alike too (``check_*``: a
ValueError saying what is wrong, which each door answers naming its field).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from drivers.protocol import ExecEvent
from services.common.settings import Settings


def check_argv(command: list[str]) -> list[str]:
    """``command``, or ValueError: no argument may hold a NUL (the runtime cannot pass one)."""
    if any("\x00" in arg for arg in command):
        raise ValueError("an argument contains a NUL character")
    return command


def check_env(env: dict[str, str]) -> dict[str, str]:
    """``env``, or ValueError: each name non-empty, without '=' or NUL; no NUL in a value."""
    for key, value in env.items():
        if not key or "=" in key or "\x00" in key:
            raise ValueError(f"{key!r}: a name must be non-empty, without '=' or NUL")
        if "\x00" in value:
            raise ValueError(f"{key!r}: the value contains a NUL character")
    return env


def check_workdir(workdir: str | None) -> str | None:
    """``workdir`` (None: the image's), or ValueError: an absolute path, without NUL."""
    if workdir is not None and (not workdir.startswith("/") or "\x00" in workdir):
        raise ValueError("must be an absolute path, without NUL")
    return workdir


def check_stdin(stdin: str | None) -> str | None:
    """``stdin`` (text, sent as UTF-8; None: none), or ValueError: a lone surrogate has no
    UTF-8 encoding. A NUL is input like any other character."""
    try:
        if stdin is not None:
            stdin.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must not contain a lone surrogate (not encodable as UTF-8)") from None
    return stdin


@dataclass(frozen=True, slots=True)
class ExecTimedOut:
    """The deadline passed: the command was ended (always the last item)."""

    seconds: float


@dataclass
class ExecLimits:
    """The sessions open now, per token, per sandbox and in all; the bounds they are held to.
    ``timeout``: the longest a command may run, and the deadline when the client sets none."""

    timeout: float
    per_token: int
    total: int
    per_sandbox: int = 1 << 30
    open: Counter[str] = field(default_factory=Counter)
    open_in: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, settings: Settings) -> ExecLimits:
        return cls(
            timeout=float(settings.openshell_exec_timeout_seconds),
            per_token=settings.openshell_exec_sessions_per_token,
            total=settings.openshell_exec_sessions,
            per_sandbox=settings.exec_sessions_per_sandbox,
        )

    def deadline(self, requested: float | None) -> float:
        """The client's timeout, or the limit when it set none; ValueError above the limit."""
        if requested is not None and requested > self.timeout:
            raise ValueError(f"at most {self.timeout:.0f} seconds")
        return requested or self.timeout

    def refusal(self, token: str, sandbox: str | None = None) -> str | None:
        if sum(self.open.values()) >= self.total:
            return f"{self.total} exec sessions are running (the most this gateway allows)"
        if self.open[token] >= self.per_token:
            return (
                f"token {token!r} has {self.open[token]} exec sessions running (the most "
                "one token may have)"
            )
        if sandbox is not None and self.open_in[sandbox] >= self.per_sandbox:
            return (
                f"sandbox {sandbox!r} has {self.open_in[sandbox]} exec sessions running (the "
                "most one sandbox may have)"
            )
        return None

    @contextmanager
    def session(self, token: str, sandbox: str | None = None) -> Iterator[None]:
        self.open[token] += 1
        if sandbox is not None:
            self.open_in[sandbox] += 1
        try:
            yield
        finally:
            _release(self.open, token)
            if sandbox is not None:
                _release(self.open_in, sandbox)


def _release(counts: Counter[str], key: str) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


async def within(
    stream: AsyncGenerator[ExecEvent, None], seconds: float
) -> AsyncGenerator[ExecEvent | ExecTimedOut, None]:
    """The stream's events until ``seconds`` have passed, then :class:`ExecTimedOut` once the
    command is ended. Only the wait for the next event is timed, never the caller's handling
    of one (a slow reader is not cancelled by the deadline; it finds it at its next read).
    The stream is closed (and so the command ended) however the iteration ends."""
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                await stream.aclose()  # ends the command before the caller hears of it
                yield ExecTimedOut(seconds)
                return
            yield event
    finally:
        await stream.aclose()
