"""Warm pools: create, list, get (with the pool's status), update (size, strategy, template:
only from the newest revision, ``expected_revision``), delete.

A pool is configuration: these routes write the ``pools`` table, and the pool controller (in
the scheduler role) turns it into commands on the log. Pools take the sandbox scopes, as
templates do: reading needs sandbox:read, writing sandbox:write (and provider:write for a
template that names providers, whose values its members get).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from events.common import SandboxName
from events.publisher import now
from services.api.deps import Reader, State, Writer, require_also
from services.api.errors import ApiError
from services.api.models import responses
from services.common import pools as store
from services.common import templates
from services.common.pools import (
    POOL_NAME_PATTERN,
    POOL_SIZE_MAX,
    PoolExists,
    PoolInfo,
    PoolMissing,
    RevisionMismatch,
    Strategy,
)
from services.common.settings import Settings
from services.common.suspend import members_suspend_refusal
from services.common.tokens import PROVIDER_WRITE, Principal, stop_timeout_refusal

router = APIRouter()

PoolName = Annotated[str, StringConstraints(pattern=POOL_NAME_PATTERN)]
PoolPath = Annotated[str, Path(pattern=POOL_NAME_PATTERN, description="the pool name")]
Size = Annotated[int, Field(ge=0, le=POOL_SIZE_MAX)]
Revision = Annotated[int, Field(ge=1, le=2**31 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CreatePoolRequest(_Strict):
    name: PoolName = Field(
        description="the pool name: a DNS label of at most 54 characters (members are named "
        "`<pool>-<8 random>`)"
    )
    template: SandboxName = Field(description="the template every member is created from")
    size: Size = Field(description="how many unclaimed members to keep Ready")
    strategy: Strategy = Field(
        default="Recreate",
        description="when the template changes: Recreate replaces the unclaimed members now "
        "(each old one deleted once a new one is Ready); OnReplenish only as they are claimed",
    )


class UpdatePoolRequest(_Strict):
    expected_revision: Revision = Field(
        description="the revision this update is based on: 409 ABORTED unless it is the newest"
    )
    size: Size | None = None
    strategy: Strategy | None = None
    template: SandboxName | None = None


class PathLatency(BaseModel):
    count: int = Field(description="claims served on this path since the pool was created")
    p50_seconds: float | None
    p90_seconds: float | None
    p99_seconds: float | None


class ClaimsView(BaseModel):
    warm: PathLatency = Field(description="a Ready member adopted")
    cold: PathLatency = Field(description="none available: a cold create from the template")
    hit_rate: float | None = Field(description="warm / all claims (None before the first)")


class PoolStatus(BaseModel):
    members: dict[str, int] = Field(description="unclaimed members by phase")
    ready: int = Field(description="unclaimed members Ready, not held: what a claim can adopt now")
    held: int = Field(
        description="unclaimed members an operator holds: no claim takes them, so the pool "
        "makes others in their place (they count among `members`)"
    )
    requested: int = Field(description="creates asked for and not decided yet")
    outdated: int = Field(description="unclaimed live members of another template revision")
    template_revision: int | None = Field(description="the template's current revision")
    claimed: int = Field(description="live sandboxes adopted out of this pool")
    problem: str | None = Field(description="why the controller cannot fill the pool now")
    claims: ClaimsView


class PoolView(BaseModel):
    name: str
    template: str
    size: int
    strategy: Strategy
    revision: int
    created_at: datetime
    updated_at: datetime
    created_by: str
    updated_by: str
    status: PoolStatus


class PoolList(BaseModel):
    items: list[PoolView]


@contextmanager
def refusals() -> Iterator[None]:
    try:
        yield
    except PoolMissing as exc:
        raise ApiError(404, "NOT_FOUND", str(exc)) from exc
    except PoolExists as exc:
        raise ApiError(409, "ALREADY_EXISTS", str(exc)) from exc
    except RevisionMismatch as exc:
        raise ApiError(409, "ABORTED", f"field 'expected_revision': {exc}") from exc


async def status(conn: Any, info: PoolInfo) -> PoolStatus:
    members = await store.members(conn, [info.name])
    revision = (await store.template_revisions(conn, [info.template])).get(info.template)
    stats = await store.claim_stats(conn, info.name)
    counts: dict[str, int] = {}
    for m in members:
        counts[m.phase] = counts.get(m.phase, 0) + 1
    warm, cold = stats[True], stats[False]
    total = warm.count + cold.count
    return PoolStatus(
        members=counts,
        ready=sum(m.phase == "Ready" and not m.held for m in members),
        held=sum(m.held for m in members),
        requested=await store.pending_count(conn, info.name),
        outdated=sum(
            m.phase != "Deleting" and (m.template, m.template_revision) != (info.template, revision)
            for m in members
        ),
        template_revision=revision,
        claimed=await store.claimed_count(conn, info.name),
        problem=info.problem,
        claims=ClaimsView(
            warm=_latency(warm), cold=_latency(cold), hit_rate=warm.count / total if total else None
        ),
    )


def _latency(stats: store.PathStats) -> PathLatency:
    return PathLatency(
        count=stats.count, p50_seconds=stats.p50, p90_seconds=stats.p90, p99_seconds=stats.p99
    )


async def view(conn: Any, info: PoolInfo) -> PoolView:
    return PoolView(
        name=info.name,
        template=info.template,
        size=info.size,
        strategy=info.strategy,
        revision=info.revision,
        created_at=info.created_at,
        updated_at=info.updated_at,
        created_by=info.created_by,
        updated_by=info.updated_by,
        status=await status(conn, info),
    )


async def _require_template(
    conn: Any, name: str, principal: Principal, settings: Settings, pool: str
) -> None:
    """The pool's template exists, the principal may keep members of it (its providers, its
    grace period: the token's cap on a create's stop_timeout_seconds), and its idle timeout
    (if any) can be acted on for the pool's members. Call it in the transaction that writes the
    pool: the template row is locked against an update until then (the update's own check,
    routes/templates.py, sees this pool)."""
    await conn.execute("SELECT 1 FROM templates WHERE name = $1 FOR SHARE", name)
    info = await templates.get_template(conn, name)
    if info is None:
        raise ApiError(404, "NOT_FOUND", f"field 'template': template {name!r} not found")
    if info.body.providers:  # its members get those values, as a create attaching them does
        require_also(principal, PROVIDER_WRITE, "to keep members of a template naming providers")
    grace, cap = info.body.spec.stop_timeout_seconds, settings.api_max_stop_timeout_seconds
    # The pool controller creates the members unchecked: the cap holds here, as at a create.
    if (why := stop_timeout_refusal(principal, cap, grace)) is not None:
        raise ApiError(
            422,
            "INVALID_ARGUMENT",
            f"field 'template': template {name!r} has spec.stop_timeout_seconds {grace}, "
            f"more than this token's creates may ask for: {why}",
        )
    idle = info.body.spec.idle_suspend_seconds
    if idle is not None and (why := members_suspend_refusal(settings, pool)) is not None:
        raise ApiError(
            422,
            "INVALID_ARGUMENT",
            f"field 'template': template {name!r} has an idle timeout "
            f"(spec.idle_suspend_seconds {idle}), which suspends a claimed member, and the "
            f"members of pool {pool!r} cannot be suspended here: {why} (every claim from the "
            "pool would be refused)",
        )


POOL_RESPONSES = responses(401, 403, 404, 409, 413, 422, 503)


@router.post(
    "/v1/pools",
    status_code=201,
    response_model=PoolView,
    responses=POOL_RESPONSES,
    summary="Create a warm pool: the controller keeps `size` members of the template Ready",
    tags=["pools"],
)
async def create_pool(body: CreatePoolRequest, principal: Writer, state: State) -> JSONResponse:
    async with state.pool.acquire() as conn:
        async with conn.transaction():
            await _require_template(conn, body.template, principal, state.settings, body.name)
            with refusals():
                info = await store.create_pool(
                    conn, body.name, body.template, body.size, body.strategy, principal.name, now()
                )
        created = await view(conn, info)
    return JSONResponse(
        created.model_dump(mode="json"), 201, headers={"Location": f"/v1/pools/{body.name}"}
    )


@router.get(
    "/v1/pools",
    response_model=PoolList,
    responses=responses(401, 403, 422, 503),
    summary="List warm pools with their status",
    tags=["pools"],
)
async def list_pools(principal: Reader, state: State) -> PoolList:
    async with state.pool.acquire() as conn:
        return PoolList(items=[await view(conn, i) for i in await store.list_pools(conn)])


@router.get(
    "/v1/pools/{name}",
    response_model=PoolView,
    responses=responses(401, 403, 404, 422, 503),
    summary="One warm pool: members by phase, claims warm and cold, hit rate, claim latency",
    tags=["pools"],
)
async def get_pool(name: PoolPath, principal: Reader, state: State) -> PoolView:
    async with state.pool.acquire() as conn:
        info = await store.get_pool(conn, name)
        if info is None:
            raise ApiError(404, "NOT_FOUND", f"pool {name!r} not found")
        return await view(conn, info)


@router.patch(
    "/v1/pools/{name}",
    response_model=PoolView,
    responses=POOL_RESPONSES,
    summary="Scale a pool, change its strategy or template (only from the newest revision)",
    tags=["pools"],
)
async def update_pool(
    name: PoolPath, body: UpdatePoolRequest, principal: Writer, state: State
) -> PoolView:
    if body.size is None and body.strategy is None and body.template is None:
        raise ApiError(
            422, "INVALID_ARGUMENT", "body: give at least one of 'size', 'strategy', 'template'"
        )
    async with state.pool.acquire() as conn:
        async with conn.transaction():
            if body.template is not None:
                await _require_template(conn, body.template, principal, state.settings, name)
            with refusals():
                info = await store.update_pool(
                    conn,
                    name,
                    expected_revision=body.expected_revision,
                    actor=principal.name,
                    now=now(),
                    size=body.size,
                    strategy=body.strategy,
                    template=body.template,
                )
        return await view(conn, info)


@router.delete(
    "/v1/pools/{name}",
    response_model=PoolView,
    responses=responses(401, 403, 404, 409, 422, 503),
    summary="Delete a pool: its unclaimed members are deleted, claimed sandboxes stay",
    tags=["pools"],
)
async def delete_pool(
    name: PoolPath,
    principal: Writer,
    state: State,
    expected_revision: Annotated[
        int | None,
        Query(ge=1, le=2**31 - 1, description="when given, 409 ABORTED unless it is the newest"),
    ] = None,
) -> PoolView:
    async with state.pool.acquire() as conn:
        with refusals():
            info = await store.delete_pool(conn, name, expected_revision)
        return await view(conn, info)
