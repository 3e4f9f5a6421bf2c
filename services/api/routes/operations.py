"""Operations: liveness, readiness (Kafka, PostgreSQL, the processor's lag) and metrics."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from events.publisher import now
from projections.store import CONNECTION_ERRORS
from services.api import readmodel
from services.api.deps import State
from services.api.models import Check, HealthBody, ReadyBody
from services.common import metrics

router = APIRouter()


@router.get("/healthz", response_model=HealthBody, tags=["operations"], summary="Liveness")
async def healthz() -> HealthBody:
    return HealthBody(status="ok")


@router.get(
    "/readyz",
    response_model=ReadyBody,
    responses={503: {"model": ReadyBody, "description": "not ready (see checks)"}},
    tags=["operations"],
    summary="Readiness: Kafka, PostgreSQL and the processor's lag",
)
async def readyz(state: State) -> JSONResponse:
    topics = [state.settings.topic_commands, state.settings.topic_observations]
    checks: dict[str, Check] = {}
    ends: dict[tuple[str, int], int] | None = None
    stored: dict[tuple[str, int], int] | None = None
    # Both probes at once: a dead backend costs its timeout once, not twice.
    kafka, postgres = await asyncio.gather(
        asyncio.wait_for(state.probe.end_offsets(topics), 5.0),
        asyncio.wait_for(readmodel.stored_input_offsets(state.pool, topics), 5.0),
        return_exceptions=True,
    )
    if isinstance(kafka, BaseException):
        checks["kafka"] = Check(ok=False, detail=f"{type(kafka).__name__}: {kafka}")
    else:
        ends = kafka
        checks["kafka"] = Check(ok=True, detail=state.settings.kafka_bootstrap)
    if isinstance(postgres, BaseException):
        checks["postgres"] = Check(ok=False, detail=f"{type(postgres).__name__}: {postgres}")
    else:
        stored = postgres
        checks["postgres"] = Check(ok=True, detail=f"schema {state.settings.pg_schema}")
    lag = None
    if ends is not None and stored is not None:
        lag = sum(max(0, end - stored.get(tp, 0)) for tp, end in ends.items())
        ok = lag <= state.settings.readiness_max_lag
        checks["processor_lag"] = Check(
            ok=ok, detail=f"{lag} input records behind (max {state.settings.readiness_max_lag})"
        )
    else:
        checks["processor_lag"] = Check(ok=False, detail="unknown: needs Kafka and PostgreSQL")
    ready = all(c.ok for c in checks.values())
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


@router.get(
    "/metrics",
    response_class=Response,
    tags=["operations"],
    summary="Prometheus metrics",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def get_metrics(state: State) -> Response:
    # The attention gauges are counted when read (one indexed query): rows are the truth.
    with contextlib.suppress(*CONNECTION_ERRORS, TimeoutError):
        counts = await asyncio.wait_for(
            readmodel.attention(state.pool, now(), state.settings.expiring_soon_seconds), 5.0
        )
        for name in ("past_deadline", "held", "expiring_soon"):
            metrics.SANDBOXES_ATTENTION.labels(name).set(getattr(counts, name))
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
