"""Commands inside a sandbox (``POST /v1/sandboxes/{name}/exec``): the call, and the reading
of its answer (one JSON answer, or server-sent events when the caller wants the output as it
comes), shared by both faces."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from sandstream_sdk._transport import Call
from sandstream_sdk.errors import CommandExitError, SandstreamError, TimeoutError, error_of
from sandstream_sdk.models import CommandResult

OutputHandler = Callable[[str], object]
AsyncOutputHandler = Callable[[str], Awaitable[object] | object]
SLACK = 30.0  # seconds a JSON answer may take beyond the command's timeout


def argv(cmd: str | Sequence[str]) -> list[str]:
    """A string runs through ``sh -c`` (as E2B's does through a shell); a list is the argv."""
    return ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def run_call(
    name: str,
    cmd: str | Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
    stdin: str | None,
    stream: bool,
) -> Call:
    body: dict[str, Any] = {"command": argv(cmd)}
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["workdir"] = cwd
    if timeout is not None:
        body["timeout"] = timeout
    if stdin is not None:
        body["stdin"] = stdin
    read = None if stream or timeout is None else timeout + SLACK
    params = {"stream": "true"} if stream else {}
    return Call("POST", f"/v1/sandboxes/{name}/exec", params, body, read_timeout=read)


class Streamed:
    """The events of a streamed run, folded into its result."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.err: list[str] = []
        self.result: CommandResult | None = None

    def take(self, event: str, data: Any) -> tuple[str, str] | None:
        """The (stream, text) to hand to a callback, if any; the result once the exit came."""
        if event in ("stdout", "stderr"):
            text = str(data["data"])
            (self.out if event == "stdout" else self.err).append(text)
            return event, text
        if event == "exit":
            self.result = CommandResult(
                exit_code=data.get("exit_code"), stdout="".join(self.out),
                stderr="".join(self.err), timed_out=bool(data.get("timed_out")),
            )  # fmt: skip
        elif event == "error":
            raise error_of(409 if data.get("code") == "FAILED_PRECONDITION" else 503, data, "")
        return None

    def finish(self) -> CommandResult:
        if self.result is None:
            raise SandstreamError("the command's stream ended without its exit")
        return self.result


def checked(result: CommandResult, check: bool) -> CommandResult:
    """The result; TimeoutError when the timeout ended the command, CommandExitError for a
    non-zero exit (unless ``check`` is False)."""
    if result.timed_out:
        error = TimeoutError("the command ran past its timeout: it was ended")
        error.result = result
        raise error
    if check and result.exit_code != 0:
        raise CommandExitError(result)
    return result
