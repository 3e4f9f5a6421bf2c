"""Dependencies declared once: the bearer-token check with its scope, the query-parameter
check, and the application's shared state (pool, publisher, change feed, gateway)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, TypeAlias

import asyncpg
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from drivers.files import FilesBackend
from drivers.logs import LogSource
from drivers.protocol import ExecDriver
from services.api.errors import ApiError
from services.api.gateway import CommandGateway
from services.api.probe import KafkaProbe
from services.api.readmodel import ChangeFeed
from services.common.exec_sessions import ExecLimits
from services.common.settings import Settings
from services.common.tokens import (
    AUDIT,
    EXEC,
    FILES_READ,
    FILES_WRITE,
    OPS,
    PROVIDER_READ,
    PROVIDER_WRITE,
    READ,
    WRITE,
    Denied,
    Grant,
    Principal,
    TokenStore,
    authorize_header,
    grant_of,
)
from services.common.usage import UseRecorder

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"

READ_METHODS: Final = frozenset({"GET", "HEAD"})
# Resources whose routes ask for scopes of their own (the routes check them again, exactly).
SCOPED_PREFIXES: Final = (
    ("/v1/audit/", AUDIT, AUDIT),
    ("/v1/providers", PROVIDER_READ, PROVIDER_WRITE),
)
# A sandbox's files: /v1/sandboxes/{name}/files and below.
FILES_PATH: Final = re.compile(r"^/v1/sandboxes/[^/]+/files(/|$)")


def request_scope(method: str, path: str) -> str:
    """The scope a request must hold before anything of it is read or validated: the front
    gate and the answer to a malformed request both ask it (the routes check theirs again)."""
    reading = method in READ_METHODS
    if FILES_PATH.match(path):
        return FILES_READ if reading else FILES_WRITE
    if not reading and _is_exec(path):
        return EXEC
    for prefix, read_scope, write_scope in SCOPED_PREFIXES:
        if path.startswith(prefix):
            return read_scope if reading else write_scope
    return READ if reading else WRITE


def _is_exec(path: str) -> bool:
    """``/v1/sandboxes/{name}/exec``: sandbox:exec, not sandbox:write."""
    parts = path.split("/")
    return len(parts) == 5 and parts[:3] == ["", "v1", "sandboxes"] and parts[4] == "exec"


_bearer = HTTPBearer(
    auto_error=False,
    description="A token from the tokens file; `sandstream up` writes an admin token.",
)


CHALLENGE: Final = {"WWW-Authenticate": 'Bearer realm="sandstream"'}


def denial(denied: Denied) -> ApiError:
    if denied.status == 401:
        return ApiError(401, "UNAUTHENTICATED", denied.message, CHALLENGE)
    return ApiError(403, "PERMISSION_DENIED", denied.message)


def check_auth(request: Request, scope: str) -> Principal:
    tokens: TokenStore = request.app.state.tokens
    checked = authorize_header(tokens, request.headers.getlist("authorization"), scope)
    if isinstance(checked, Denied):
        raise denial(checked)
    return checked


def grant(request: Request, scope: str) -> Grant:
    """What a long stream re-checks at every wake: the token it was let in with, and scope."""
    return grant_of(request.app.state.tokens, request.headers.getlist("authorization"), scope)


def require_also(principal: Principal, scope: str, needed_for: str) -> None:
    """A second scope a request needs beyond its route's (403 without it): attaching a
    provider, at create or later, also needs provider:write."""
    if scope not in principal.scopes:
        raise ApiError(
            403,
            "PERMISSION_DENIED",
            f"token {principal.name!r} lacks the scope {scope} (needed {needed_for})",
        )


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
        # Declared for the OpenAPI document; the check reads the header itself.
        _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        principal = check_auth(request, scope)
        check_query(request)
        return principal

    return dependency


Reader = Annotated[Principal, Depends(require(READ))]
Writer = Annotated[Principal, Depends(require(WRITE))]
Auditor = Annotated[Principal, Depends(require(AUDIT))]
ProviderReader = Annotated[Principal, Depends(require(PROVIDER_READ))]
ProviderWriter = Annotated[Principal, Depends(require(PROVIDER_WRITE))]
Operator = Annotated[Principal, Depends(require(OPS))]
Executor = Annotated[Principal, Depends(require(EXEC))]
FilesReader = Annotated[Principal, Depends(require(FILES_READ))]
FilesWriter = Annotated[Principal, Depends(require(FILES_WRITE))]


# ---------------------------------------------------------------------------------------------
# The application's shared state


@dataclass(frozen=True, slots=True)
class ApiState:
    """What the routes share: set once by ``create_app`` on ``app.state.api``."""

    settings: Settings
    pool: Pool
    feed: ChangeFeed
    gateway: CommandGateway
    probe: KafkaProbe
    # Under `sandstream up`: the control plane's parts now down (restarting), with their error.
    down: Callable[[], dict[str, str]] | None = None
    # The runtime's logs (GET /v1/sandboxes/{name}/logs); None: this API serves no logs.
    logs: LogSource | None = None
    # The sandboxes' files (/v1/sandboxes/{name}/files); None: this API serves no files.
    files: FilesBackend | None = None
    # The driver POST /v1/sandboxes/{name}/exec runs commands through (None: it cannot exec),
    # and the exec sessions' bounds and counts (shared with OpenShell's door under `up`).
    exec_driver: ExecDriver | None = None
    exec_limits: ExecLimits = field(
        default_factory=lambda: ExecLimits(timeout=1.0, per_token=1, total=1)
    )
    # Use of the sandboxes through the doors, for idle suspend (shared with OpenShell's door
    # under `up`; one without a pool records nothing).
    use: UseRecorder = field(default_factory=lambda: UseRecorder(None, 10.0))


async def api_state(request: Request) -> ApiState:
    # A coroutine: FastAPI runs a plain function dependency in a worker thread, a thread hop
    # (and a wait for the GIL) on every request.
    state: ApiState = request.app.state.api
    return state


State = Annotated[ApiState, Depends(api_state)]
