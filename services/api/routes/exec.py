"""A command inside a Ready sandbox, through the driver's exec (Podman's exec API): the HTTP
door beside OpenShell's ExecSandbox, held to the same bounds (services/common/exec_sessions.py:
a deadline, sessions per token, per sandbox and in all) and needing the same scope,
``sandbox:exec``.

Two forms. By default one JSON answer once the command has ended: both outputs (each cut at
``exec_output_max_bytes``, the rest read and dropped, the answer saying so) and the exit code.
With ``?stream=true``, server-sent events as the output comes (``stdout``/``stderr``, data
``{"data": text}``), then one ``exit`` event (or ``error``), then the end of the stream.

A client that goes away ends the command (either form): the driver's stream is left, and the
driver ends what it started (SIGTERM, SIGKILL after a grace). So does a token that lapses while
the command runs (checked every second, as watches and followed logs do: revoked, expired, no
longer holding ``sandbox:exec``): the JSON form answers 401 (403 for the scope) instead of the
result, the stream ends with ``event: denied``."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Annotated, Any, Final

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from drivers.protocol import BackendRefused, DriverError, ExecEvent, ExecExit, ExecOutput
from events.common import Phase
from services.api import readmodel
from services.api.deps import ApiState, Executor, State, denial, grant
from services.api.errors import ApiError, ErrorBody
from services.api.models import SSE_EVENT_SCHEMA, NamePath, responses
from services.api.readmodel import SandboxView
from services.api.routes.watch import denied_body
from services.api.wake import woken_for_http
from services.common.credentials import Vault
from services.common.exec_env import ExecEnvUnavailable, exec_environment
from services.common.exec_sessions import (
    ExecLimits,
    ExecTimedOut,
    check_argv,
    check_env,
    check_stdin,
    check_workdir,
    within,
)
from services.common.tokens import EXEC, RECHECK, Denied, Grant, while_granted

router = APIRouter()

MAX_ARGS: Final = 4096  # arguments of one command; the body size limit bounds their length


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: list[Annotated[str, Field(max_length=1 << 20)]] = Field(
        min_length=1, max_length=MAX_ARGS, description="argv: the program, then its arguments"
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment variables added")
    workdir: str | None = Field(
        default=None, min_length=1, description="absolute working directory (default: the image's)"
    )
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="seconds until the command is ended (default and most: the setting "
        "openshell_exec_timeout_seconds)",
    )
    stdin: str | None = Field(
        default=None,
        description="the command's input (UTF-8), then its end; null: no input (an immediate "
        "end of input)",
    )

    # One check for both doors (services/common/exec_sessions.py), OpenShell's ExecSandbox too.
    _argv = field_validator("command")(staticmethod(check_argv))
    _environment = field_validator("env")(staticmethod(check_env))
    _workdir = field_validator("workdir")(staticmethod(check_workdir))
    _stdin = field_validator("stdin")(staticmethod(check_stdin))


class ExecResult(BaseModel):
    exit_code: int | None = Field(description="null when the command was ended by the timeout")
    stdout: str = Field(description="UTF-8, invalid bytes replaced")
    stderr: str
    stdout_truncated: bool = Field(description="stdout was longer than the limit: cut there")
    stderr_truncated: bool
    timed_out: bool = Field(description="the timeout ended the command")


STREAM_DESCRIPTION: Final = (
    "with `?stream=true`, server-sent events: `event: stdout` / `event: stderr` with data "
    '`{"data": text}` as the output comes, then `event: exit` with `{"exit_code", '
    '"timed_out"}` (or `event: error` with `{"code", "message"}`), then the end'
)


@router.post(
    "/v1/sandboxes/{name}/exec",
    response_model=ExecResult,
    responses={
        200: {
            "description": "the command ended (JSON); "
            + STREAM_DESCRIPTION
            + "; `event: denied` with {status, code, message} when the token lapses",
            "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
        },
        **responses(401, 403, 404, 413, 422, 503),  # 401/403 also: the token lapsed mid-run
        409: {
            "model": ErrorBody,
            "description": "FAILED_PRECONDITION: the sandbox is not Ready (the message names "
            "its phase), or its runtime is gone or not running",
        },
        429: {
            "model": ErrorBody,
            "description": "RESOURCE_EXHAUSTED: too many exec sessions (per token, per "
            "sandbox, or in all)",
        },
        501: {
            "model": ErrorBody,
            "description": "NOT_IMPLEMENTED: this API's driver cannot exec",
        },
    },
    summary="Run a command in a Ready sandbox (needs sandbox:exec)",
    tags=["sandboxes"],
)
async def sandbox_exec(
    name: NamePath,
    body: ExecRequest,
    principal: Executor,
    state: State,
    request: Request,
    stream: Annotated[bool, Query(description="server-sent events as the output comes")] = False,
) -> Any:
    limits = state.exec_limits
    try:
        timeout = limits.deadline(body.timeout)
    except ValueError as exc:
        raise ApiError(422, "INVALID_ARGUMENT", f"timeout: {exc}") from exc
    view = await ready_sandbox(state, name, principal.name)
    _within_limits(limits, principal.name, view.member_key)  # sessions may have begun in a wake
    held = grant(request, EXEC)
    await state.use.begin(view.member_key, view.spec.idle_suspend_seconds)  # seen by the next scan
    vault = request.app.state.providers.vault  # a claim's providers' values (exec_env)
    session = Session(
        state, limits, principal.name, view, body, timeout, request.receive, held, vault
    )
    if stream:
        return StreamingResponse(
            session.events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await session.result(state.settings.exec_output_max_bytes)


def _within_limits(limits: ExecLimits, token: str, name: str) -> None:
    refused = limits.refusal(token, name)
    if refused is not None:
        raise ApiError(429, "RESOURCE_EXHAUSTED", refused)


async def ready_sandbox(state: ApiState, name: str, actor: str) -> SandboxView:
    """The Ready sandbox ``name``; a Suspended one is woken first (``services.api.wake``)."""
    view = await readmodel.get_sandbox(state.pool, name)
    if view is None:
        raise ApiError(404, "NOT_FOUND", f"sandbox {name!r} not found")
    if state.exec_driver is None:
        raise ApiError(501, "NOT_IMPLEMENTED", "this API's driver cannot exec")
    _within_limits(state.exec_limits, actor, view.member_key)  # a refused call wakes nothing
    view = await woken_for_http(state.gateway, view, actor, state.settings.wake_timeout_seconds)
    if view.phase is not Phase.READY:
        raise ApiError(
            409, "FAILED_PRECONDITION", f"sandbox {name!r} is {view.phase.value}, not Ready"
        )
    return view


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class Session:
    """One command's run: its session counted while it runs, its output until the exit, the
    deadline or the client's leaving."""

    def __init__(
        self,
        state: ApiState,
        limits: ExecLimits,
        token: str,
        view: SandboxView,
        body: ExecRequest,
        timeout: float,
        receive: Receive,
        held: Grant,
        vault: Callable[[], Awaitable[Vault]],
    ) -> None:
        self.state, self.limits, self.token, self.view = state, limits, token, view
        self.body, self.timeout, self.receive, self.held = body, timeout, receive, held
        self.vault = vault

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[AsyncIterator[Event]]:
        """The command's events, a Denied last if the token lapses; RESOURCE_EXHAUSTED when a
        session opened meanwhile took the last place (the check before the answer began was no
        reservation). However it ends,
        the command is ended and only then its session released, in a task of its own: the
        server cancels an answer whose client left again at every wait of its cleanup."""
        _within_limits(self.limits, self.token, self.view.member_key)
        driver = self.state.exec_driver
        assert driver is not None  # ready_sandbox checked
        try:  # a claim's env and providers' values (services/common/exec_env.py)
            env = await exec_environment(
                self.state.pool,
                self.vault,
                self.view.member_key,
                self.view.claim_part,
                self.body.env,
            )
        except ExecEnvUnavailable as exc:
            raise ApiError(503, "UNAVAILABLE", f"exec: {exc.reason}") from exc
        stdin = None if self.body.stdin is None else self.body.stdin.encode()  # before counting
        counted = contextlib.ExitStack()
        counted.enter_context(self.limits.session(self.token, self.view.member_key))
        counted.enter_context(self.state.use.using(self.view.member_key))  # idle suspend waits
        stream = driver.exec_stream(
            self.view.member_key,
            self.view.generation,
            self.body.command,
            env=env,
            workdir=self.body.workdir,
            stdin=stdin,
        )
        granted = while_granted(within(stream, self.timeout), self.held, RECHECK)
        watched = UntilGone(granted, self.receive)
        try:
            yield watched.events()
        finally:
            ending = asyncio.ensure_future(watched.close(counted))
            ENDING.add(ending)
            ending.add_done_callback(ENDING.discard)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(ending)

    async def result(self, cap: int) -> ExecResult | JSONResponse:
        outputs = {"stdout": Capped(cap), "stderr": Capped(cap)}
        exit_code: int | None = None
        timed_out = False
        try:
            async with self.run() as events:
                async for event in events:
                    if isinstance(event, ExecOutput):
                        outputs[event.stream].add(event.data)
                    elif isinstance(event, ExecExit):
                        exit_code = event.exit_code
                    elif isinstance(event, Denied):  # nothing sent yet: the answer is a 401
                        raise denial(Denied(event.status, f"exec ended: {event.message}"))
                    else:
                        timed_out = True
        except DriverError as exc:
            raise driver_error(exc) from exc
        if exit_code is None and not timed_out:  # the client left: nobody reads this
            return JSONResponse({"code": "CANCELLED", "message": "the client left"}, 499)
        out, err = outputs["stdout"], outputs["stderr"]
        return ExecResult(
            exit_code=exit_code,
            stdout=out.text(),
            stderr=err.text(),
            stdout_truncated=out.cut,
            stderr_truncated=err.cut,
            timed_out=timed_out,
        )

    async def events(self) -> AsyncIterator[str]:
        decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in STREAMS}
        lapsed: Denied | None = None
        try:
            async with self.run() as events:
                async for event in events:
                    if isinstance(event, ExecOutput):
                        text = decoders[event.stream].decode(event.data)
                        if text:
                            yield sse(event.stream, {"data": text})
                        continue
                    if isinstance(event, Denied):
                        lapsed = event
                        break  # said once the command is ended, below
                    for stream, decoder in decoders.items():  # a character cut at the end
                        if rest := decoder.decode(b"", final=True):
                            yield sse(stream, {"data": rest})
                    timed_out = isinstance(event, ExecTimedOut)
                    code = None if timed_out else getattr(event, "exit_code", None)
                    yield sse("exit", {"exit_code": code, "timed_out": timed_out})
        except DriverError as exc:
            error = driver_error(exc)
            yield sse("error", {"code": error.code, "message": error.message})
        except ApiError as exc:
            yield sse("error", {"code": exc.code, "message": exc.message})
        if lapsed is not None:
            yield sse("denied", denied_body(lapsed, "exec"))


STREAMS: Final = ("stdout", "stderr")


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def driver_error(exc: DriverError) -> ApiError:
    """The runtime failed: gone or not running (the row may lag a stop or delete) is a
    precondition; a broken connection to the runtime is worth a retry; the backend refusing
    sandstream's own account (RBAC) is the deployment's fault, not the caller's."""
    if exc.retryable or isinstance(exc, BackendRefused):
        return ApiError(503, "UNAVAILABLE", f"exec: {exc.reason}")
    return ApiError(409, "FAILED_PRECONDITION", f"exec: {exc.reason}")


class Capped:
    """At most ``cap`` bytes of one output; the rest counted as cut, not kept."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.cut = False

    def add(self, data: bytes) -> None:
        room = self.cap - len(self.kept)
        if len(data) > room:
            self.cut = True
        self.kept += data[: max(room, 0)]

    def text(self) -> str:
        return self.kept.decode("utf-8", "replace")


ENDING: Final[set[asyncio.Future[None]]] = set()  # cleanups under way (held from the GC)


Event = ExecEvent | ExecTimedOut | Denied


class UntilGone:
    """The events until they end or the client disconnects; then the wait for the next event
    is cancelled, which leaves the driver's stream (so the command is ended). Watched here, not
    left to the server: an answer that has nothing to send would never learn the client left."""

    def __init__(self, source: AsyncGenerator[Event, None], receive: Receive) -> None:
        self.source = source
        self.gone = asyncio.ensure_future(_disconnected(receive))
        self.following: asyncio.Future[Event] | None = None

    async def events(self) -> AsyncIterator[Event]:
        while True:
            self.following = following = asyncio.ensure_future(anext(self.source))
            await asyncio.wait({following, self.gone}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                return  # the client left: close() ends the command
            try:
                event = following.result()
            except StopAsyncIteration:
                return
            yield event

    async def close(self, counted: contextlib.ExitStack) -> None:
        """End the command (if it still runs), then release its session."""
        try:
            self.gone.cancel()
            if self.following is not None and not self.following.done():
                self.following.cancel()
                with contextlib.suppress(BaseException):
                    await self.following
            await self.source.aclose()
        finally:
            counted.close()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
