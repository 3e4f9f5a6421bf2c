"""The health endpoint of a role process: liveness, readiness and Prometheus metrics.

Every role run as its own process (``sandstream processor|executor|watcher|scheduler|api``)
serves the same three routes on its own small HTTP server:

- ``GET /healthz``: 200 while the process's event loop answers (liveness);
- ``GET /readyz``: 200 or 503; the role's own readiness (``Readiness``: reason and detail)
  only for a token with the ops:read scope, else just ready or not (as the HTTP API's);
- ``GET /metrics``: the process's Prometheus metrics, for a token with the ops:read scope.

Tokens are the API's tokens file (``settings.tokens_file``, re-read when it changes); without
that file only the bare liveness and readiness answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.serving import (
    EmbeddedServer,
    bind,
    http_config,
    serve_started,
    url_of,
)
from services.common.tokens import OPS, Denied, TokenStore, authorize_header, sees_operations

# A readiness check answering later than this counts as not ready.
READINESS_TIMEOUT = 5.0
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class _NoProbes(logging.Filter):
    """Leaves the probes' requests out of the access log. uvicorn has one access logger per
    process, and its ``access_log=False`` switches it off for every server in the process (the
    API role's requests went unlogged)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = str(args[2]).partition("?")[0] if isinstance(args, tuple) and len(args) > 2 else ""
        return path not in PROBE_PATHS


def _quiet_probes() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _NoProbes) for f in access.filters):
        access.addFilter(_NoProbes())


@dataclass(frozen=True)
class Readiness:
    """A role's readiness: whether it does its work now, and what it reports about it."""

    ready: bool
    reason: str = ""  # why not, when not ready
    detail: dict[str, Any] = field(default_factory=dict)


ReadinessCheck = Callable[[], Awaitable[Readiness]]


def health_app(role: str, readiness: ReadinessCheck, tokens: TokenStore | None = None) -> Starlette:
    """The three routes of a role process."""

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "role": role, "pid": os.getpid()})

    async def readyz(request: Request) -> JSONResponse:
        detailed = sees_operations(tokens, request.headers.getlist("authorization"))
        if isinstance(detailed, Denied):
            return _denied(detailed)
        try:
            found = await asyncio.wait_for(readiness(), READINESS_TIMEOUT)
        except Exception as exc:  # the check itself failed: not ready, and why
            found = Readiness(False, f"readiness check failed: {exc!r}")
        body: dict[str, Any] = {"status": "ready" if found.ready else "not ready", "role": role}
        if detailed:
            body |= {"reason": found.reason, **found.detail}
        return JSONResponse(body, 200 if found.ready else 503)

    async def get_metrics(request: Request) -> Response:
        if tokens is None:
            return _denied(Denied(403, "no tokens file: the metrics need a token with " + OPS))
        checked = authorize_header(tokens, request.headers.getlist("authorization"), OPS)
        if isinstance(checked, Denied):
            return _denied(checked)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", get_metrics),
        ]
    )


def _tokens(tokens_file: Path | None) -> TokenStore | None:
    return TokenStore.from_file(tokens_file) if tokens_file and tokens_file.exists() else None


def _denied(denied: Denied) -> JSONResponse:
    code = "UNAUTHENTICATED" if denied.status == 401 else "PERMISSION_DENIED"
    return JSONResponse({"code": code, "message": denied.message}, denied.status)


@dataclass
class HealthEndpoint:
    """A started health server; ``port`` is the one bound (a free one when asked for 0)."""

    server: EmbeddedServer
    task: asyncio.Task[None]
    url: str
    port: int
    port_file: Path | None = None

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self.task
        if self.port_file is not None:
            self.port_file.unlink(missing_ok=True)


async def start_health(
    role: str,
    readiness: ReadinessCheck,
    host: str,
    port: int,
    port_file: Path | None = None,
    tokens_file: Path | None = None,
) -> HealthEndpoint:
    """Serve ``role``'s health routes on ``host:port``; OSError when the port is taken. The
    bound port is written to ``port_file`` (atomically) once the server accepts connections."""
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    tokens = _tokens(tokens_file)
    _quiet_probes()
    config = http_config(
        health_app(role, readiness, tokens),
        lifespan="off",
        proxy_headers=False,  # uvicorn believes X-Forwarded-* from 127.0.0.1 by default
    )
    server = EmbeddedServer(config)
    task = await serve_started(server, sock, name="health")
    if port_file is not None:
        port_file.parent.mkdir(parents=True, exist_ok=True)
        partial = port_file.with_name(port_file.name + ".partial")
        partial.write_text(f"{actual}\n")
        partial.replace(port_file)
    return HealthEndpoint(server, task, url_of(host, actual), actual, port_file)
