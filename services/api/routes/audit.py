"""The audit over HTTP (scope audit:read): a sandbox's state as of a moment, the causal chain
of its current incarnation, the history's hash chains, and the export as JSON Lines.

These read PostgreSQL only: the inputs are the history's verbatim, hash-chained copies of the
log records (`sandstream audit verify` proves them equal to the log and re-decides it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from events.common import INT64_MAX, SANDBOX_NAME_PATTERN
from services.api.deps import Auditor, State
from services.api.errors import ApiError, query_time
from services.api.models import NamePath, responses
from services.audit import entries, export, timeline
from services.audit.chains import check_chains
from services.common.names import resolve

router = APIRouter()


class AuditState(BaseModel):
    sandbox_id: UUID
    phase: str
    generation: int
    version: int
    providers: list[str]
    exit_code: int | None
    reason: str | None
    updated_at: datetime


class DriverCall(BaseModel):
    operation: str = Field(description="what the executor was asked to do: launch, stop, delete")
    generation: int
    results: list[AuditStep] = Field(description="the results it reported, as observations")


class AuditStep(BaseModel):
    topic: str
    partition: int
    offset: int
    occurred_at: datetime | None
    actor: str | None = Field(description="for a command: the token name the API set")
    input: str = Field(description="what the input was and who sent it, in words")
    disposition: str
    reason: str
    phase: str | None = Field(description="the row's phase after this input, decided again")
    generation: int | None
    version: int | None
    events: list[str]
    agrees_with_record: bool = Field(description="deciding it again gave what was recorded")
    driver_calls: list[DriverCall] = []


DriverCall.model_rebuild()


class AuditAnswer(BaseModel):
    name: str
    source: Literal["history"] = "history"
    state: AuditState | None
    inputs: list[AuditStep]


class BrokenLink(BaseModel):
    history_id: int
    key: str | None
    topic: str
    partition: int
    offset: int
    problem: str


class ChainAnswer(BaseModel):
    intact: bool
    chains: int
    checked: int
    unchained: int = Field(description="entries written before the chain existed")
    broken: list[BrokenLink] = Field(description="the first broken link of each broken chain")


def _state(step: timeline.Step | None) -> AuditState | None:
    s = step.state if step is not None else None
    if s is None:
        return None
    return AuditState(
        sandbox_id=s.sandbox_id, phase=s.phase.value, generation=s.generation,
        version=s.version, providers=list(s.providers), exit_code=s.exit_code,
        reason=s.reason, updated_at=s.updated_at,
    )  # fmt: skip


def _step(step: timeline.Step, calls: Sequence[timeline.DriverCall] = ()) -> AuditStep:
    e, s = step.entry, step.state
    return AuditStep(
        topic=e.topic, partition=e.partition, offset=e.offset, occurred_at=e.occurred_at,
        actor=e.actor, input=timeline.describe_input(e), disposition=step.disposition,
        reason=step.reason, phase=s.phase.value if s else None,
        generation=s.generation if s else None, version=s.version if s else None,
        events=[ev.type for ev in step.events], agrees_with_record=step.agrees,
        driver_calls=[
            DriverCall(operation=c.operation, generation=c.generation,
                       results=[_step(r) for r in c.results])
            for c in calls
        ],
    )  # fmt: skip


async def _steps(state: State, name: str) -> list[timeline.Step]:
    async with state.pool.acquire() as conn:  # a bound name: its adopted member's inputs
        found = await entries.of_sandbox(conn, await resolve(conn, name))
    if not found:
        raise ApiError(404, "NOT_FOUND", f"sandbox {name!r} has no recorded inputs")
    return timeline.replay(
        found, state.settings.topic_commands, limits=state.settings.lifecycle_limits
    )


@router.get(
    "/v1/audit/sandboxes/{name}/at",
    response_model=AuditAnswer,
    responses=responses(401, 403, 404, 422, 503),
    summary="A sandbox's state as of a time or one of its inputs, with the inputs behind it",
    tags=["audit"],
)
async def state_at(
    name: NamePath,
    principal: Auditor,
    state: State,
    time: Annotated[
        datetime | None, Query(description="as of the last input that occurred by then")
    ] = None,
    topic: Annotated[
        Literal["commands", "observations"] | None, Query(description="with offset: the input")
    ] = None,
    offset: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None,
) -> AuditAnswer:
    if (time is None) == (offset is None) or (offset is None) != (topic is None):
        raise ApiError(422, "INVALID_ARGUMENT", "give either 'time', or 'topic' and 'offset'")
    time = query_time("time", time)
    steps = await _steps(state, name)
    settings = state.settings
    position = None
    if offset is not None:
        position = (
            settings.topic_commands if topic == "commands" else settings.topic_observations,
            offset,
        )
    try:
        prefix = timeline.at(steps, time=time, position=position)
    except timeline.NotRecorded as exc:
        raise ApiError(404, "NOT_FOUND", str(exc)) from None
    return AuditAnswer(name=name, state=_state(prefix[-1]), inputs=[_step(s) for s in prefix])


@router.get(
    "/v1/audit/sandboxes/{name}/explain",
    response_model=AuditAnswer,
    responses=responses(401, 403, 404, 422, 503),
    summary="The causal chain of a sandbox's current incarnation, with the driver calls made",
    tags=["audit"],
)
async def explain(name: NamePath, principal: Auditor, state: State) -> AuditAnswer:
    story = timeline.explain(name, await _steps(state, name))
    return AuditAnswer(
        name=name,
        state=_state(story.steps[-1] if story.steps else None),
        inputs=[_step(s, story.calls.get(i, [])) for i, s in enumerate(story.steps)],
    )


@router.get(
    "/v1/audit/chains",
    response_model=ChainAnswer,
    responses=responses(401, 403, 422, 503),
    summary="Check the history's hash chains and name the first broken link of each",
    description="From PostgreSQL alone: altered, removed, reordered entries and removed hashes; "
    "not a chain whose newest entries were deleted, which takes the log's checkpoints "
    "(`sandstream audit chain`, docs/audit.md).",
    tags=["audit"],
)
async def chains(
    principal: Auditor,
    state: State,
    name: Annotated[str | None, Query(pattern=SANDBOX_NAME_PATTERN)] = None,
) -> ChainAnswer:
    async with state.pool.acquire() as conn:  # a bound name: its adopted member's chain
        report = await check_chains(conn, name and await resolve(conn, name))
    return ChainAnswer(
        intact=report.intact, chains=report.chains, checked=report.checked,
        unchained=report.unchained,
        broken=[
            BrokenLink(history_id=b.entry.id, key=b.entry.key, topic=b.entry.topic,
                       partition=b.entry.partition, offset=b.entry.offset, problem=b.problem)
            for b in report.broken
        ],
    )  # fmt: skip


@router.get(
    "/v1/audit/export",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "one JSON object per line: an input and its decision, in order",
            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
        },
        **responses(401, 403, 422),
    },
    summary="Every input and its decision as JSON Lines, streamed",
    tags=["audit"],
)
async def export_history(
    principal: Auditor,
    state: State,
    name: Annotated[str | None, Query(pattern=SANDBOX_NAME_PATTERN)] = None,
    since: Annotated[datetime | None, Query(description="inputs that occurred at or after")] = None,
    until: Annotated[datetime | None, Query(description="inputs that occurred before")] = None,
    type: Annotated[
        list[Annotated[str, Query(max_length=100)]], Query(description="input types (repeatable)")
    ] = [],  # noqa: B006
) -> StreamingResponse:
    since, until = query_time("since", since), query_time("until", until)
    which = entries.Filter(key=name, since=since, until=until, types=type)

    async def lines() -> AsyncIterator[str]:
        async with state.pool.acquire() as conn:
            async for text in export.json_lines(conn, which):
                yield text

    return StreamingResponse(lines(), media_type="application/x-ndjson")
