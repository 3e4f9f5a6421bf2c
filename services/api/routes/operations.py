"""Operations: liveness, readiness (Kafka, PostgreSQL, the processor's lag and stopped
partitions) and metrics.

``/healthz`` and the bare answer of ``/readyz`` (ready or not, nothing else) are open, for
probes. The checks of ``/readyz`` (addresses, lag, what failed and why) and ``/metrics`` need a
token with the ``ops:read`` scope: they name backends and errors an outsider should not see."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from events.publisher import now
from projections.stopped import StoppedPartition, stopped_partitions
from projections.store import CONNECTION_ERRORS
from services.api import readmodel
from services.api.deps import Operator, State, denial
from services.api.models import Check, HealthBody, ReadyBody, responses
from services.common import metrics
from services.common.log_identity import differences, recorded_identity
from services.common.tokens import OPS, TOKENS_UNAVAILABLE, Denied, bearer_of, sees_operations

router = APIRouter()


@router.get("/healthz", response_model=HealthBody, tags=["operations"], summary="Liveness")
async def healthz() -> HealthBody:
    return HealthBody(status="ok")


@router.get(
    "/readyz",
    response_model=ReadyBody,
    responses={
        503: {"model": ReadyBody, "description": "not ready (see checks)"},
        **responses(401),
    },
    tags=["operations"],
    summary="Readiness: Kafka, PostgreSQL, the log's identity, the processor's lag and "
    "stopped partitions",
    description="Without a token: only the status (for probes). With a token: that token must "
    "be valid (else 401); with the ops:read scope the answer has the checks, the lag and, when "
    "not ready, what failed and why.",
)
async def readyz(request: Request, state: State) -> JSONResponse:
    if request.app.state.tokens.problem is not None:
        return _tokens_unavailable(request)
    detailed = _detailed(request)
    topics = [state.settings.topic_commands, state.settings.topic_observations]
    checks: dict[str, Check] = {}
    ends: dict[tuple[str, int], int] | None = None
    stored: dict[tuple[str, int], int] | None = None
    # Both probes at once: a dead backend costs its timeout once, not twice.
    kafka, postgres, stopped, log_differences = await asyncio.gather(
        asyncio.wait_for(state.probe.end_offsets(topics), 5.0),
        asyncio.wait_for(readmodel.stored_input_offsets(state.pool, topics), 5.0),
        asyncio.wait_for(_stopped(state, topics), 5.0),
        asyncio.wait_for(_log_differences(state, topics), 5.0),
        return_exceptions=True,
    )
    if isinstance(kafka, BaseException):
        detail = f"{type(kafka).__name__}: {kafka}"
        if state.gateway.refused:  # (the probe may only time out on a topic it may not read)
            detail += f"; the last command was refused: {state.gateway.refused}"
        checks["kafka"] = Check(ok=False, detail=detail)
    else:
        ends = kafka
        checks["kafka"] = Check(ok=True, detail=state.settings.kafka_bootstrap)
    if isinstance(postgres, BaseException):
        checks["postgres"] = Check(ok=False, detail=f"{type(postgres).__name__}: {postgres}")
    else:
        stored = postgres
        checks["postgres"] = Check(ok=True, detail=f"schema {state.settings.pg_schema}")
    if isinstance(log_differences, BaseException):
        checks["log"] = Check(ok=False, detail=f"unknown: {type(log_differences).__name__}")
    elif log_differences:
        checks["log"] = Check(
            ok=False,
            detail="not the log the stored offsets belong to (`sandstream log adopt` after a "
            "replaced log): " + "; ".join(log_differences),
        )
    else:
        checks["log"] = Check(ok=True, detail="the log the stored offsets belong to")
    if state.down is not None:
        down = state.down()
        checks["control_plane"] = Check(
            ok=not down,
            detail="; ".join(f"{part} restarting after {error}" for part, error in down.items())
            or "processor and driver side running",
        )
    lag = None
    if ends is not None and stored is not None:
        lag = sum(max(0, end - stored.get(tp, 0)) for tp, end in ends.items())
        ok = lag <= state.settings.readiness_max_lag
        checks["processor_lag"] = Check(
            ok=ok, detail=f"{lag} input records behind (max {state.settings.readiness_max_lag})"
        )
    else:
        checks["processor_lag"] = Check(ok=False, detail="unknown: needs Kafka and PostgreSQL")
    if isinstance(stopped, list) and stopped:
        # A partition stopped at a record PostgreSQL refuses: named until an operator acts.
        detail = "; ".join(s.describe() for s in stopped)
        checks["stopped_partitions"] = Check(ok=False, detail=detail)
    ready = all(c.ok for c in checks.values())
    if not detailed:
        if ready:
            return JSONResponse({"status": "ready"}, 200)
        return _bare_not_ready(NEEDS_OPS)
    body = ReadyBody(
        status="ready" if ready else "not ready",
        checks=checks,
        lag=lag,
        max_lag=state.settings.readiness_max_lag,
    ).model_dump(mode="json")
    if ready:
        return JSONResponse(body, 200)
    failing = "; ".join(f"{k}: {c.detail}" for k, c in checks.items() if not c.ok)
    return JSONResponse({"code": "UNAVAILABLE", "message": f"not ready: {failing}", **body}, 503)


def _tokens_unavailable(request: Request) -> JSONResponse:
    """Not ready: the tokens file is not valid, so every token is refused. Nobody can be
    known to hold ops:read now: a probe gets the bare answer, a caller that sent a token the
    cause without its details (the log has them), where it would otherwise get a 401."""
    if bearer_of(request.headers.get("authorization")) is None:
        return _bare_not_ready(NEEDS_OPS)
    return _bare_not_ready(f"not ready: tokens: {TOKENS_UNAVAILABLE}")


NEEDS_OPS = f"not ready (the checks need a token with the {OPS} scope)"


def _bare_not_ready(message: str) -> JSONResponse:
    return JSONResponse({"code": "UNAVAILABLE", "message": message, "status": "not ready"}, 503)


def _detailed(request: Request) -> bool:
    """Whether this caller may see the checks. A token, when sent, must be valid."""
    seen = sees_operations(request.app.state.tokens, request.headers.getlist("authorization"))
    if isinstance(seen, Denied):
        raise denial(seen)
    return seen


async def _stopped(state: State, topics: list[str]) -> list[StoppedPartition]:
    async with state.pool.acquire() as conn:
        return await stopped_partitions(conn, topics)


@router.get(
    "/metrics",
    response_class=Response,
    tags=["operations"],
    summary="Prometheus metrics (scope ops:read)",
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **responses(401, 403),
    },
)
async def get_metrics(_: Operator, state: State) -> Response:
    # The attention gauges are counted when read (one indexed query): rows are the truth.
    with contextlib.suppress(*CONNECTION_ERRORS, TimeoutError):
        counts = await asyncio.wait_for(
            readmodel.attention(state.pool, now(), state.settings.expiring_soon_seconds), 5.0
        )
        for name in ("past_deadline", "held", "expiring_soon"):
            metrics.SANDBOXES_ATTENTION.labels(name).set(getattr(counts, name))
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _log_differences(state: State, topics: list[str]) -> list[str]:
    current = await state.probe.log_identity(topics)
    async with state.pool.acquire() as conn:
        recorded = await recorded_identity(conn, topics)
    return differences(recorded, current)
