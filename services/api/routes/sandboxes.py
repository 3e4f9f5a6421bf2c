"""Sandbox reads: the list (live ones unless asked otherwise) and one sandbox by name."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from events.common import Phase
from services.api import readmodel
from services.api.deps import Reader, State
from services.api.errors import ApiError
from services.api.models import NamePath, responses
from services.api.readmodel import SandboxList, SandboxView

router = APIRouter()


@router.get(
    "/v1/sandboxes",
    response_model=SandboxList,
    responses=responses(401, 403, 422, 503),
    summary="List sandboxes (live ones unless asked otherwise)",
    tags=["sandboxes"],
)
async def list_sandboxes(
    principal: Reader,
    state: State,
    phase: Annotated[list[Phase], Query(description="only these phases (repeatable)")] = [],  # noqa: B006
    label: Annotated[
        list[str], Query(description="`key=value` or `key` (present); repeatable, ANDed")
    ] = [],  # noqa: B006
    include_deleted: Annotated[bool, Query(description="include tombstones")] = False,
    limit: Annotated[int, Query(ge=1, le=readmodel.MAX_PAGE)] = 100,
    page_token: Annotated[str | None, Query(max_length=readmodel.PAGE_TOKEN_MAX_LENGTH)] = None,
) -> SandboxList:
    return await readmodel.list_sandboxes(
        state.pool,
        phases=phase,
        labels=label,
        include_deleted=include_deleted,
        limit=limit,
        page_token=page_token,
    )


@router.get(
    "/v1/sandboxes/{name}",
    response_model=SandboxView,
    responses=responses(401, 403, 404, 422, 503),
    summary="One sandbox",
    tags=["sandboxes"],
)
async def get_sandbox(name: NamePath, principal: Reader, state: State) -> SandboxView:
    view = await readmodel.get_sandbox(state.pool, name)
    if view is None:
        raise ApiError(404, "NOT_FOUND", f"sandbox {name!r} not found")
    return view
