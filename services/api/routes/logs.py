"""A sandbox's output: read from its runtime (Podman's container log, the Pod's log), never
stored. JSON Lines, one ``{"at", "stream", "text"}`` per line of output; with ``follow=true``
the answer stays open and streams new lines as they are written, until the runtime stops,
the client leaves, or its token lapses (checked every second, as the watches do: revoked,
expired, no longer holding ``sandbox:read``): then a last line ``{"denied": {"status",
"code", "message"}}`` says why. Readable with ``sandbox:read`` (docs/security.md says what
that shows)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from drivers.logs import MAX_TAIL, LogLine, LogsUnavailable
from services.api import readmodel
from services.api.deps import Reader, State, grant
from services.api.errors import ApiError, query_time
from services.api.models import NamePath, responses
from services.api.routes.watch import denied_body
from services.common.tokens import READ, RECHECK, Denied, while_granted

router = APIRouter()


def line_json(line: LogLine) -> str:
    return json.dumps({"at": line.at.isoformat(), "stream": line.stream, "text": line.text}) + "\n"


@router.get(
    "/v1/sandboxes/{name}/logs",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "one JSON object per line of output: `at`, `stream` (stdout or "
            "stderr), `text`; a followed log whose token lapses ends with "
            '`{"denied": {status, code, message}}`',
            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
        },
        **responses(401, 403, 404, 422, 503),
    },
    summary="The sandbox's output (its current runtime's), optionally followed",
    tags=["sandboxes"],
)
async def sandbox_logs(
    request: Request,
    name: NamePath,
    principal: Reader,
    state: State,
    tail: Annotated[int | None, Query(ge=0, le=MAX_TAIL, description="the last N lines")] = None,
    since: Annotated[datetime | None, Query(description="lines written at or after")] = None,
    follow: Annotated[bool, Query(description="stream new lines until the runtime stops")] = False,
) -> StreamingResponse:
    since = query_time("since", since)
    view = await readmodel.get_sandbox(state.pool, name)
    if view is None:
        raise ApiError(404, "NOT_FOUND", f"sandbox {name!r} not found")
    source = state.logs
    if source is None:
        raise ApiError(503, "UNAVAILABLE", "this API has no log source")
    lines = source.read(view.member_key, view.generation, tail=tail, since=since, follow=follow)
    try:
        first = await anext(aiter(lines), None)
    except LogsUnavailable as exc:
        raise ApiError(503, "UNAVAILABLE", f"logs of {name!r}: {exc}") from exc

    held = grant(request, READ)

    async def body() -> AsyncIterator[str]:
        if first is None:
            return
        yield line_json(first)
        try:
            async for line in while_granted(lines, held, RECHECK):
                if isinstance(line, Denied):
                    yield json.dumps({"denied": denied_body(line, "logs")}) + "\n"
                    return
                yield line_json(line)
        except LogsUnavailable:
            return  # the runtime's stream broke off after the answer began: it ends here

    return StreamingResponse(body(), media_type="application/x-ndjson")
