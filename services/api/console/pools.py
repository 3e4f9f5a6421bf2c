"""The warm pools page (``/ui/pools``): every pool with its status (members by phase, claims
warm and cold, hit rate, claim latency by path, the controller's problem), read-only: pools
are written over HTTP and the CLI."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import HTMLResponse

from events.publisher import now
from services.api.console.render import html
from services.api.console.session import Viewer, reader
from services.api.deps import ApiState, api_state
from services.api.routes.pools import view
from services.common import pools

router = APIRouter(include_in_schema=False)


@router.get("/ui/pools")
async def pools_page(
    viewer: Annotated[Viewer, Depends(reader)],
    state: Annotated[ApiState, Depends(api_state)],
) -> HTMLResponse:
    async with state.pool.acquire() as conn:
        items = [await view(conn, p) for p in await pools.list_pools(conn)]
    return html("pools.html", viewer=viewer, items=items, now=now())
