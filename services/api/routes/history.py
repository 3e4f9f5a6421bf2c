"""A sandbox's history: every input about it, in order, ignored ones with their reason."""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, Query

from events.common import INT32_MAX
from services.api import readmodel
from services.api.deps import Reader, State
from services.api.errors import ApiError
from services.api.models import NamePath, responses
from services.api.readmodel import HistoryPage

router = APIRouter()


@router.get(
    "/v1/sandboxes/{name}/history",
    response_model=HistoryPage,
    responses=responses(401, 403, 404, 422, 503),
    summary="Every input about a sandbox, in order, ignored ones with their reason",
    tags=["sandboxes"],
)
async def get_history(
    name: NamePath,
    principal: Reader,
    state: State,
    limit: Annotated[int, Query(ge=1, le=readmodel.MAX_HISTORY_PAGE)] = 100,
    page_token: Annotated[str | None, Query(max_length=readmodel.PAGE_TOKEN_MAX_LENGTH)] = None,
    incarnation: Annotated[
        UUID | None, Query(description="only this incarnation (a sandbox_id)")
    ] = None,
    generation: Annotated[
        int | None,
        Query(ge=1, le=INT32_MAX, description="only inputs about this generation"),
    ] = None,
) -> HistoryPage:
    page = await readmodel.history(
        state.pool,
        name,
        limit=limit,
        page_token=page_token,
        incarnation=incarnation,
        generation=generation,
    )
    if page is None:
        raise ApiError(404, "NOT_FOUND", f"sandbox {name!r} not found")
    return page
