"""The HTTP API: commands go to Kafka, reads come from the PostgreSQL projection.

``create_app(settings, pool, publisher, tokens)`` builds the FastAPI application. Commands are
built here (``occurred_at`` is the time at this edge, ``actor`` the token's name), published
with the idempotent producer and answered with 202 once Kafka acknowledged them; with
``?wait=<seconds>`` the answer is the command's outcome. Reads only query PostgreSQL; nothing
here calls a driver. Every error is JSON ``{"code": ..., "message": ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, Final, TypeAlias

import asyncpg
import uvicorn
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from fastapi import Body, Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from events.commands import (
    Command,
    CreateSandbox,
    DeleteSandbox,
    RestartSandbox,
    StartSandbox,
    StopSandbox,
)
from events.common import (
    SANDBOX_NAME_PATTERN,
    CommandId,
    Phase,
    ProviderName,
    SandboxName,
    SandboxSpec,
)
from events.outcomes import Code, CommandOutcome
from events.publisher import CommandPublisher, new_command_id, now
from projections.store import CONNECTION_ERRORS
from services import metrics, readmodel
from services.auth import READ, WRITE, Principal, TokenStore
from services.readmodel import (
    ChangeFeed,
    CommandStatus,
    HistoryPage,
    InvalidArgument,
    SandboxList,
    SandboxView,
)
from services.settings import Settings

log = logging.getLogger("sandstream.api")

MAX_WAIT: Final = 60.0  # seconds a command request may wait for its outcome
PUBLISH_TIMEOUT: Final = 15.0
HEARTBEAT: Final = 15.0  # seconds between watch bookmarks when nothing changes
Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"

STATUS_OF: Final[dict[Code, int]] = {
    Code.OK: 200,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.ABORTED: 409,
    Code.FAILED_PRECONDITION: 412,
    Code.INVALID_ARGUMENT: 422,
}

# Friendlier words for the patterns of the wire types than "should match pattern '^...$'".
_PATTERN_WORDS: Final = {
    SANDBOX_NAME_PATTERN: "must be a DNS label: 1-63 lowercase letters, digits or '-', "
    "starting and ending with a letter or digit",
    r"^[A-Za-z0-9._:-]{1,128}$": "must be 1-128 characters from A-Z a-z 0-9 . _ : -",
    r"^[A-Za-z0-9._-]{1,128}$": "must be 1-128 characters from A-Z a-z 0-9 . _ -",
}


# ---------------------------------------------------------------------------------------------
# Errors


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


class ErrorBody(BaseModel):
    code: str = Field(description="NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, ...")
    message: str = Field(description="what went wrong, naming the field or the phase")


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, **extra}, status, headers=headers)


_BODY_MODELS: Final = frozenset({"CreateSandboxRequest", "LifecycleRequest"})


def _where(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = list(loc)
    source = parts.pop(0) if parts and parts[0] in ("body", "query", "path", "header") else "body"
    if source == "body" and len(parts) > 1 and parts[0] in _BODY_MODELS:
        parts = parts[1:]
    name = ".".join(str(p) for p in parts)
    if source == "body":
        return f"field {name!r}" if name else "request body"
    return f"{source} parameter {name!r}"


def describe_validation(errors: list[Any], limit: int = 5) -> str:
    """One line naming each offending field, e.g. ``field 'spec.image': Field required``."""
    parts = []
    for item in errors[:limit]:
        kind = item.get("type", "")
        msg = str(item.get("msg", "invalid"))
        if kind == "json_invalid":
            parts.append(f"request body is not valid JSON: {item.get('ctx', {}).get('error', msg)}")
            continue
        if kind == "string_pattern_mismatch":
            pattern = str((item.get("ctx") or {}).get("pattern"))
            msg = _PATTERN_WORDS.get(pattern, msg)
        elif tuple(item.get("loc", ())) == ("body",):
            if kind == "missing":
                parts.append("request body is required")
            else:
                parts.append(f"request body must be a JSON object ({msg})")
            continue
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{_where(item.get('loc', ()))}: {msg}")
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more")
    return "; ".join(parts) or "invalid request"


# ---------------------------------------------------------------------------------------------
# Auth

_bearer = HTTPBearer(
    auto_error=False,
    description="A token from the tokens file; `sandstream up` writes an admin token.",
)


def check_auth(request: Request, scope: str, credentials: str | None) -> Principal:
    tokens: TokenStore = request.app.state.tokens
    challenge = {"WWW-Authenticate": 'Bearer realm="sandstream"'}
    if not credentials:
        raise ApiError(401, "UNAUTHENTICATED", "missing bearer token (Authorization: Bearer "
                       "<token>)", challenge)  # fmt: skip
    principal = tokens.authenticate(credentials)
    if principal is None:
        raise ApiError(401, "UNAUTHENTICATED", "invalid bearer token", challenge)
    if scope not in principal.scopes:
        raise ApiError(
            403, "PERMISSION_DENIED", f"token {principal.name!r} lacks the scope {scope}"
        )
    return principal


def _bearer_value(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _known_query(route: Any) -> frozenset[str]:
    known: frozenset[str] | None = getattr(route, "_sandstream_query", None)
    if known is None:
        names: set[str] = set()
        pending = [route.dependant]
        while pending:
            dependant = pending.pop()
            names.update(p.alias for p in dependant.query_params)
            pending.extend(dependant.dependencies)
        known = frozenset(names)
        route._sandstream_query = known
    return known


def check_query(request: Request) -> None:
    """Unknown query parameters are errors, not ignored: ``?lable=x`` must not list everything."""
    route = request.scope.get("route")
    if route is None or not hasattr(route, "dependant"):
        return
    unknown = sorted(set(request.query_params) - _known_query(route))
    if unknown:
        names = ", ".join(repr(u) for u in unknown)
        raise ApiError(422, "INVALID_ARGUMENT", f"unknown query parameter {names}")


def require(scope: str) -> Callable[..., Awaitable[Principal]]:
    async def dependency(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        principal = check_auth(request, scope, credentials.credentials if credentials else None)
        check_query(request)
        return principal

    return dependency


Reader = Annotated[Principal, Depends(require(READ))]
Writer = Annotated[Principal, Depends(require(WRITE))]


# ---------------------------------------------------------------------------------------------
# Request models


class SandboxSpecRequest(SandboxSpec):
    """The spec as a request carries it: JSON types are not coerced (``"3"`` is no integer)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class CreateSandboxRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: SandboxName = Field(description="the sandbox name: a DNS label, unique among live ones")
    spec: SandboxSpecRequest
    providers: list[ProviderName] = Field(default_factory=list, max_length=64)
    command_id: CommandId | None = Field(
        default=None, description="idempotency key; a retry with the same id gets the same outcome"
    )


class LifecycleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    command_id: CommandId | None = Field(
        default=None, description="idempotency key; a retry with the same id gets the same outcome"
    )
    expected_version: int | None = Field(
        default=None,
        ge=0,
        description="reject with ABORTED (409) unless the row is at this version",
    )


class HealthBody(BaseModel):
    status: str


class Check(BaseModel):
    ok: bool
    detail: str


class ReadyBody(BaseModel):
    status: str
    checks: dict[str, Check]
    lag: int | None = Field(description="records the processor has still to apply")
    max_lag: int


# ---------------------------------------------------------------------------------------------
# Readiness probe of Kafka


class KafkaProbe:
    """End offsets of the input topics, from a group-less consumer started on first use."""

    def __init__(self, settings: Settings, publisher: CommandPublisher) -> None:
        self.settings = settings
        self.publisher = publisher
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    async def end_offsets(self, topics: list[str]) -> dict[tuple[str, int], int]:
        async with self._lock:
            if self._consumer is None:
                consumer = AIOKafkaConsumer(
                    bootstrap_servers=self.settings.kafka_bootstrap,
                    enable_auto_commit=False,
                    request_timeout_ms=5000,
                    client_id="sandstream-api-readiness",
                )
                try:
                    await consumer.start()
                except BaseException:
                    await consumer.stop()
                    raise
                self._consumer = consumer
            consumer = self._consumer
        try:
            partitions = []
            for topic in topics:
                # The producer waits for the topic's metadata (the consumer's cache may lack it).
                found = await self.publisher.producer.partitions_for(topic)
                partitions += [TopicPartition(topic, p) for p in sorted(found)]
            ends = await consumer.end_offsets(partitions)
        except BaseException:
            await self.close()  # start over next time (the broker may have restarted)
            raise
        return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def close(self) -> None:
        async with self._lock:
            consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await consumer.stop()


# ---------------------------------------------------------------------------------------------
# Metrics middleware


class MetricsMiddleware:
    """Counts requests and their time by route template (not by raw path: names vary)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_wrapper(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            metrics.API_REQUESTS.labels(scope["method"], template, str(status[0])).inc()
            metrics.API_REQUEST_SECONDS.labels(scope["method"], template).observe(
                time.perf_counter() - started
            )


# ---------------------------------------------------------------------------------------------
# The application


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    described = {
        401: "missing or invalid token",
        403: "the token lacks the scope",
        404: "no such sandbox (NOT_FOUND)",
        409: "ALREADY_EXISTS, or ABORTED (expected_version mismatch)",
        412: "FAILED_PRECONDITION: the phase does not admit the command",
        422: "INVALID_ARGUMENT: the request names the offending field",
        503: "UNAVAILABLE: Kafka or PostgreSQL cannot be reached",
    }
    return {c: {"model": ErrorBody, "description": described[c]} for c in codes}


_COMMAND_RESPONSES = {
    202: {"model": CommandStatus, "description": "published; the outcome is pending"},
    **_responses(401, 403, 404, 409, 412, 422, 503),
}

WaitQuery = Annotated[
    float | None,
    Query(
        ge=0,
        le=MAX_WAIT,
        description="seconds to wait for the outcome; without it the answer is 202 at once",
    ),
]
# OpenAPI 3.1: the schema of an event stream describes one event.
SSE_EVENT_SCHEMA: Final = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": ["sandbox", "bookmark"]},
        "id": {"type": "string", "pattern": "^[0-9]+$", "description": "the change_seq"},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "a SandboxView (event: sandbox) or {cursor} (event: bookmark)",
        },
        "retry": {"type": "integer"},
    },
}
NamePath = Annotated[str, Path(pattern=SANDBOX_NAME_PATTERN, description="the sandbox name")]
LifecycleBody = Annotated[LifecycleRequest | None, Body()]


def create_app(
    settings: Settings,
    pool: Pool,
    publisher: CommandPublisher,
    tokens: TokenStore,
    *,
    poll_interval: float = 1.0,
    publish_timeout: float = PUBLISH_TIMEOUT,
) -> FastAPI:
    feed = ChangeFeed(pool, poll_interval=poll_interval)
    probe = KafkaProbe(settings, publisher)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await feed.start()
        try:
            yield
        finally:
            await feed.close()
            await probe.close()

    app = FastAPI(
        title="sandstream",
        version="1",
        summary="Control plane for agent sandboxes: commands in, phases out.",
        description="Commands are published to Kafka and decided by the lifecycle processor; "
        "reads come from the PostgreSQL projection. Errors are `{code, message}`.",
        lifespan=lifespan,
    )
    app.state.tokens = tokens
    app.state.feed = feed
    app.add_middleware(MetricsMiddleware)
    _install_error_handlers(app)

    # -- commands ------------------------------------------------------------------------------

    async def wait_outcome(
        command_id: str, key: str | None, timeout: float
    ) -> CommandOutcome | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            mark = feed.mark()
            outcome = await readmodel.get_outcome(pool, command_id, key)
            remaining = deadline - loop.time()
            if outcome is not None or remaining <= 0:
                return outcome
            await feed.wait(mark, min(remaining, poll_interval))

    def outcome_response(outcome: CommandOutcome, created: bool) -> JSONResponse:
        status = STATUS_OF[outcome.code]
        headers = {}
        if created and outcome.accepted:
            status = 201
            headers["Location"] = f"/v1/sandboxes/{outcome.key}"
        body = readmodel.command_status(outcome).model_dump(mode="json")
        return JSONResponse(body, status, headers=headers)

    async def submit(command: Command, wait: float | None) -> JSONResponse:
        created = isinstance(command, CreateSandbox)
        known = await readmodel.get_outcome(pool, command.command_id, command.key)
        if known is not None:  # a retry: the first outcome stands, nothing is published again
            metrics.API_COMMANDS.labels(command.type, "retry").inc()
            return outcome_response(known, created)
        try:
            await asyncio.wait_for(publisher.publish(command), publish_timeout)
        except (KafkaError, TimeoutError) as exc:
            metrics.API_COMMANDS.labels(command.type, "unavailable").inc()
            log.warning("publishing %s %s failed: %r", command.type, command.command_id, exc)
            return error_response(
                503,
                "UNAVAILABLE",
                f"Kafka did not acknowledge the command ({type(exc).__name__}); it may still be "
                f"applied: retry with the same command_id {command.command_id!r}",
                command_id=command.command_id,
            )
        metrics.API_COMMANDS.labels(command.type, "published").inc()
        if wait:
            outcome = await wait_outcome(command.command_id, command.key, wait)
            if outcome is not None:
                return outcome_response(outcome, created)
        body = readmodel.pending_status(
            command.command_id,
            command.key,
            command.type,
            "published; the outcome is pending",
        )
        return JSONResponse(
            body.model_dump(mode="json"),
            202,
            headers={"Location": f"/v1/commands/{command.command_id}"},
        )

    def lifecycle(kind: type[StartSandbox | StopSandbox | RestartSandbox | DeleteSandbox]) -> Any:
        type_name = kind.__name__

        async def handler(
            name: NamePath,
            principal: Writer,
            body: LifecycleBody = None,
            wait: WaitQuery = None,
        ) -> JSONResponse:
            request = body or LifecycleRequest()
            command = kind(
                type=type_name,
                command_id=request.command_id or new_command_id(),
                key=name,
                occurred_at=now(),
                actor=principal.name,
                expected_version=request.expected_version,
            )
            return await submit(command, wait)

        handler.__name__ = f"{type_name[:-7].lower()}_sandbox"
        return handler

    @app.post(
        "/v1/sandboxes",
        status_code=201,
        response_model=CommandStatus,
        responses=_COMMAND_RESPONSES,
        summary="Create a sandbox",
        tags=["commands"],
    )
    async def create_sandbox(
        body: CreateSandboxRequest, principal: Writer, wait: WaitQuery = None
    ) -> JSONResponse:
        command = CreateSandbox(
            type="CreateSandbox",
            command_id=body.command_id or new_command_id(),
            key=body.name,
            occurred_at=now(),
            actor=principal.name,
            spec=SandboxSpec.model_validate(body.spec.model_dump()),
            providers=body.providers,
        )
        return await submit(command, wait)

    for verb, kind in (("stop", StopSandbox), ("start", StartSandbox), ("restart", RestartSandbox)):
        app.post(
            f"/v1/sandboxes/{{name}}:{verb}",
            response_model=CommandStatus,
            responses=_COMMAND_RESPONSES,
            summary=f"{verb.capitalize()} a sandbox",
            tags=["commands"],
        )(lifecycle(kind))
    app.delete(
        "/v1/sandboxes/{name}",
        response_model=CommandStatus,
        responses=_COMMAND_RESPONSES,
        summary="Delete a sandbox",
        tags=["commands"],
    )(lifecycle(DeleteSandbox))

    @app.get(
        "/v1/commands/{command_id}",
        response_model=CommandStatus,
        responses=_responses(401, 403, 422, 503),
        summary="A command's outcome (pending until the processor decided it)",
        tags=["commands"],
    )
    async def get_command(
        command_id: Annotated[str, Path(pattern=r"^[A-Za-z0-9._:-]{1,128}$")],
        principal: Reader,
        sandbox: Annotated[
            str | None,
            Query(pattern=SANDBOX_NAME_PATTERN, description="the sandbox the command was for"),
        ] = None,
        wait: WaitQuery = None,
    ) -> CommandStatus:
        if wait:
            outcome = await wait_outcome(command_id, sandbox, wait)
        else:
            outcome = await readmodel.get_outcome(pool, command_id, sandbox)
        if outcome is not None:
            return readmodel.command_status(outcome)
        return readmodel.pending_status(
            command_id,
            sandbox or "",
            "",
            "no outcome recorded: not decided yet (or never published)",
        )

    # -- reads ---------------------------------------------------------------------------------

    @app.get(
        "/v1/sandboxes",
        response_model=SandboxList,
        responses=_responses(401, 403, 422, 503),
        summary="List sandboxes (live ones unless asked otherwise)",
        tags=["sandboxes"],
    )
    async def list_sandboxes(
        principal: Reader,
        phase: Annotated[list[Phase], Query(description="only these phases (repeatable)")] = [],  # noqa: B006
        label: Annotated[
            list[str], Query(description="`key=value` or `key` (present); repeatable, ANDed")
        ] = [],  # noqa: B006
        include_deleted: Annotated[bool, Query(description="include tombstones")] = False,
        limit: Annotated[int, Query(ge=1, le=readmodel.MAX_PAGE)] = 100,
        page_token: Annotated[str | None, Query(max_length=2000)] = None,
    ) -> SandboxList:
        return await readmodel.list_sandboxes(
            pool,
            phases=phase,
            labels=label,
            include_deleted=include_deleted,
            limit=limit,
            page_token=page_token,
        )

    @app.get(
        "/v1/sandboxes/{name}",
        response_model=SandboxView,
        responses=_responses(401, 403, 404, 422, 503),
        summary="One sandbox",
        tags=["sandboxes"],
    )
    async def get_sandbox(name: NamePath, principal: Reader) -> SandboxView:
        view = await readmodel.get_sandbox(pool, name)
        if view is None:
            raise ApiError(404, "NOT_FOUND", f"sandbox {name!r} not found")
        return view

    @app.get(
        "/v1/sandboxes/{name}/history",
        response_model=HistoryPage,
        responses=_responses(401, 403, 404, 422, 503),
        summary="Every input about a sandbox, in order, ignored ones with their reason",
        tags=["sandboxes"],
    )
    async def get_history(
        name: NamePath,
        principal: Reader,
        limit: Annotated[int, Query(ge=1, le=readmodel.MAX_HISTORY_PAGE)] = 100,
        page_token: Annotated[str | None, Query(max_length=2000)] = None,
    ) -> HistoryPage:
        page = await readmodel.history(pool, name, limit=limit, page_token=page_token)
        if page is None:
            raise ApiError(404, "NOT_FOUND", f"sandbox {name!r} not found")
        return page

    @app.get(
        "/v1/watch",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "server-sent events: `event: sandbox` with the row as data and "
                "`id:` its change_seq; `event: bookmark` every 15 s",
                "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
            },
            **_responses(401, 403, 422),
        },
        summary="Follow row changes as server-sent events, resumable from a cursor",
        tags=["sandboxes"],
    )
    async def watch(
        principal: Reader,
        cursor: Annotated[
            int | None,
            Query(ge=0, le=2**63 - 1, description="resume after this change_seq (an event id)"),
        ] = None,
        name: Annotated[
            list[Annotated[str, Query(pattern=SANDBOX_NAME_PATTERN)]],
            Query(description="only these sandboxes (repeatable)"),
        ] = [],  # noqa: B006
        include_deleted: Annotated[
            bool, Query(description="without a cursor: also replay tombstones")
        ] = False,
        timeout: Annotated[
            float | None, Query(gt=0, le=86400, description="end the stream after this many s")
        ] = None,
        last_event_id: Annotated[
            str | None, Header(alias="Last-Event-ID", description="overrides cursor")
        ] = None,
    ) -> StreamingResponse:
        start = cursor
        if last_event_id is not None and last_event_id.strip():
            try:
                start = int(last_event_id)
                if start < 0:
                    raise ValueError
            except ValueError:
                raise ApiError(
                    422,
                    "INVALID_ARGUMENT",
                    "header 'Last-Event-ID': must be a non-negative integer (an event id)",
                ) from None
        return StreamingResponse(
            _watch_stream(pool, feed, start, name, include_deleted, timeout),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- operations ----------------------------------------------------------------------------

    @app.get("/healthz", response_model=HealthBody, tags=["operations"], summary="Liveness")
    async def healthz() -> HealthBody:
        return HealthBody(status="ok")

    @app.get(
        "/readyz",
        response_model=ReadyBody,
        responses={503: {"model": ReadyBody, "description": "not ready (see checks)"}},
        tags=["operations"],
        summary="Readiness: Kafka, PostgreSQL and the processor's lag",
    )
    async def readyz() -> JSONResponse:
        topics = [settings.topic_commands, settings.topic_observations]
        checks: dict[str, Check] = {}
        ends: dict[tuple[str, int], int] | None = None
        stored: dict[tuple[str, int], int] | None = None
        # Both probes at once: a dead backend costs its timeout once, not twice.
        kafka, postgres = await asyncio.gather(
            asyncio.wait_for(probe.end_offsets(topics), 5.0),
            asyncio.wait_for(readmodel.stored_input_offsets(pool, topics), 5.0),
            return_exceptions=True,
        )
        if isinstance(kafka, BaseException):
            checks["kafka"] = Check(ok=False, detail=f"{type(kafka).__name__}: {kafka}")
        else:
            ends = kafka
            checks["kafka"] = Check(ok=True, detail=settings.kafka_bootstrap)
        if isinstance(postgres, BaseException):
            checks["postgres"] = Check(ok=False, detail=f"{type(postgres).__name__}: {postgres}")
        else:
            stored = postgres
            checks["postgres"] = Check(ok=True, detail=f"schema {settings.pg_schema}")
        lag = None
        if ends is not None and stored is not None:
            lag = sum(max(0, end - stored.get(tp, 0)) for tp, end in ends.items())
            ok = lag <= settings.readiness_max_lag
            checks["processor_lag"] = Check(
                ok=ok, detail=f"{lag} input records behind (max {settings.readiness_max_lag})"
            )
        else:
            checks["processor_lag"] = Check(ok=False, detail="unknown: needs Kafka and PostgreSQL")
        ready = all(c.ok for c in checks.values())
        body = ReadyBody(
            status="ready" if ready else "not ready",
            checks=checks,
            lag=lag,
            max_lag=settings.readiness_max_lag,
        ).model_dump(mode="json")
        if ready:
            return JSONResponse(body, 200)
        failing = "; ".join(f"{k}: {c.detail}" for k, c in checks.items() if not c.ok)
        return JSONResponse(
            {"code": "UNAVAILABLE", "message": f"not ready: {failing}", **body}, 503
        )

    @app.get(
        "/metrics",
        response_class=Response,
        tags=["operations"],
        summary="Prometheus metrics",
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def get_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


# ---------------------------------------------------------------------------------------------
# The watch stream


def _sse(event: str, data: str, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {data}\n\n"


async def _watch_stream(
    pool: Pool,
    feed: ChangeFeed,
    start: int | None,
    names: list[str],
    include_deleted: bool,
    timeout: float | None,
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout else None
    metrics.API_WATCHERS.inc()
    try:
        yield ": sandstream watch\nretry: 2000\n\n"
        cursor = start or 0
        live_only = start is None and not include_deleted  # the first replay is a list
        last_sent = loop.time()
        while not feed.closed:
            mark = feed.mark()
            horizon = await feed.horizon(mark)
            if horizon is not None:
                while horizon > cursor:
                    rows = await readmodel.changes_after(
                        pool, cursor, horizon, names=names, live_only=live_only
                    )
                    for row in rows:
                        yield _sse("sandbox", row.model_dump_json(), row.change_seq)
                        last_sent = loop.time()
                    full = len(rows) == readmodel.CHANGES_PAGE  # more may follow the page
                    cursor = rows[-1].change_seq if full else horizon
                live_only = False  # the first replay (a list) is over: deletions are news
            now_ = loop.time()
            if deadline is not None and now_ >= deadline:
                return
            if now_ - last_sent >= HEARTBEAT:
                yield _sse("bookmark", json.dumps({"cursor": cursor}), cursor)
                last_sent = now_
            wait = min(feed.poll_interval, HEARTBEAT - (now_ - last_sent))
            if deadline is not None:
                wait = min(wait, deadline - now_)
            await feed.wait(mark, max(wait, 0.001))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        log.warning("watch stream ended: %r", exc)
    finally:
        metrics.API_WATCHERS.dec()


# ---------------------------------------------------------------------------------------------
# Error handlers


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(InvalidArgument)
    async def invalid_argument(_: Request, exc: InvalidArgument) -> JSONResponse:
        return error_response(422, "INVALID_ARGUMENT", f"query parameter {exc.field!r}: "
                              f"{exc.message}")  # fmt: skip

    def _denied(request: Request) -> JSONResponse | None:
        # A malformed body is rejected before dependencies run: authenticate first anyway, so
        # an unauthenticated caller learns nothing about the request's shape.
        if not request.url.path.startswith("/v1/"):
            return None
        scope = READ if request.method == "GET" else WRITE
        try:
            check_auth(request, scope, _bearer_value(request))
        except ApiError as denied:
            return error_response(denied.status, denied.code, denied.message, denied.headers)
        return None

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        denied = _denied(request)
        if denied is not None:
            return denied
        return error_response(422, "INVALID_ARGUMENT", describe_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            # FastAPI's "error parsing the body" (e.g. not UTF-8): a validation error like
            # any other malformed body, after authentication.
            denied = _denied(request)
            if denied is not None:
                return denied
            return error_response(422, "INVALID_ARGUMENT", "request body is not valid JSON")
        codes = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}
        code = codes.get(
            exc.status_code, "INVALID_ARGUMENT" if exc.status_code < 500 else "INTERNAL"
        )
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, code, message, getattr(exc, "headers", None))

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("%s %s: backend unavailable: %r", request.method, request.url.path, exc)
        return error_response(503, "UNAVAILABLE", f"backend unavailable: {type(exc).__name__}")

    # Registered per class, so they are answered inside the app (and counted as 503 by the
    # metrics middleware); a handler for Exception runs outside it and re-raises.
    for connection_error in CONNECTION_ERRORS:
        app.add_exception_handler(connection_error, unavailable)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "INTERNAL", "internal error (see the server log)")


# ---------------------------------------------------------------------------------------------
# Serving


class ApiServer(uvicorn.Server):
    """uvicorn without its own signal handling: the embedding process owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: an ephemeral port); raises OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class RunningApi:
    """A started API server in this event loop; ``stop`` ends watch streams, then the server."""

    def __init__(self, app: FastAPI, server: ApiServer, task: asyncio.Task[None], url: str):
        self.app = app
        self.server = server
        self.task = task
        self.url = url

    async def stop(self) -> None:
        feed: ChangeFeed = self.app.state.feed
        await feed.close()  # ends the watch streams, so no connection holds the shutdown up
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self.task


async def start_api(
    app: FastAPI,
    host: str,
    port: int,
    *,
    access_log: bool = True,
    sock: socket.socket | None = None,
) -> RunningApi:
    sock = sock or bind(host, port)
    actual = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = ApiServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="api")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the API server stopped during startup")
        if loop.time() > deadline:
            raise RuntimeError("the API server did not start within 30s")
        await asyncio.sleep(0.01)
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", ""):
        shown = "127.0.0.1"
    return RunningApi(app, server, task, f"http://{shown}:{actual}")
