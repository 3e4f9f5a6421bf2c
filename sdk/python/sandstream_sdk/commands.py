"""Commands inside a sandbox (``POST /v1/sandboxes/{name}/exec``): the call, and the reading
of its answer (one JSON answer, or server-sent events when the caller wants the output as it
comes), shared by both faces."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

from sandstream_sdk._transport import Call
from sandstream_sdk.errors import CommandExitError, SandstreamError, TimeoutError, error_of
from sandstream_sdk.models import CommandResult

OutputHandler = Callable[[str], object]
AsyncOutputHandler = Callable[[str], Awaitable[object] | object]
SLACK = 30.0  # seconds a JSON answer may take beyond the command's timeout
# Of each output of a streamed run, the result keeps this much (the callbacks get all of it):
# as much as the server's JSON answer holds by default, so memory stays bounded however much
# a command prints.
KEPT_BYTES: Final = 1024 * 1024


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
    return Call("POST", f"/v1/sandboxes/{name}/exec", params, body, read_timeout=read, wakes=True)


# The status of the API's answer that an ``error`` event of a stream stands for (the stream
# itself began with 200): the runtime gone (409), a session limit reached meanwhile (429).
_ERROR_STATUS: Final = {"FAILED_PRECONDITION": 409, "RESOURCE_EXHAUSTED": 429}


class Kept:
    """The first ``cap`` bytes of one output; the rest only counted as cut."""

    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.cut = cap, bytearray(), False

    def add(self, text: str) -> None:
        data = text.encode()
        room = self.cap - len(self.data)
        self.cut = self.cut or len(data) > room
        self.data += data[: max(room, 0)]

    def text(self) -> str:
        return self.data.decode(errors="ignore")  # a character cut at the cap is left out


class Streamed:
    """The events of a streamed run, folded into its result (each output kept up to ``cap``
    bytes, the result's ``*_truncated`` saying when cut)."""

    def __init__(self, cap: int = KEPT_BYTES) -> None:
        self.out, self.err = Kept(cap), Kept(cap)
        self.result: CommandResult | None = None

    def take(self, event: str, data: Any) -> tuple[str, str] | None:
        """The (stream, text) to hand to a callback, if any; the result once the exit came."""
        if event in ("stdout", "stderr"):
            text = str(data["data"])
            (self.out if event == "stdout" else self.err).add(text)
            return event, text
        if event == "exit":
            self.result = CommandResult(
                exit_code=data.get("exit_code"), stdout=self.out.text(), stderr=self.err.text(),
                stdout_truncated=self.out.cut, stderr_truncated=self.err.cut,
                timed_out=bool(data.get("timed_out")),
            )  # fmt: skip
        elif event == "error":
            raise error_of(_ERROR_STATUS.get(str(data.get("code")), 503), data, "")
        elif event == "denied":  # the token lapsed mid-run: the command was ended
            raise error_of(int(data.get("status", 401)), data, "")
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
