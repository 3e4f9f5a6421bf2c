"""The templates page (``/ui/templates``): every template at its newest revision, its spec in
full (environment variables by name), read-only: templates are written over HTTP and the CLI."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import HTMLResponse

from events.publisher import now
from services.api.console.render import html
from services.api.console.session import Viewer, reader
from services.api.deps import ApiState, api_state
from services.common import templates

router = APIRouter(include_in_schema=False)


@router.get("/ui/templates")
async def templates_page(
    viewer: Annotated[Viewer, Depends(reader)],
    state: Annotated[ApiState, Depends(api_state)],
) -> HTMLResponse:
    async with state.pool.acquire() as conn:
        items = await templates.list_templates(conn)
    return html("templates.html", viewer=viewer, items=items, now=now())
