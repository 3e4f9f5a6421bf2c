"""The console's live feeds: server-sent events the pages' script follows (``EventSource``
cannot send a bearer header, so these are the console's own, behind its cookie). Both are woken
by the change feed the API's watches use (the processor's NOTIFY) and send the pages' own parts,
rendered again:

- ``/ui/live/fleet``: ``event: fleet`` with those of the counts, the attention list and the
  table page that changed (read again at each wake: four small queries);
- ``/ui/live/sandboxes/{name}``: ``event: row`` with the row's panel when the row changed, and
  ``event: inputs`` with the timeline's new rows (history entries of the name are committed in
  their order: one partition, one writer at a time, so a cursor on their seq misses none).

A page gets at most one update every ``MIN_GAP`` seconds.

A stream ends when the session's token stops holding ``sandbox:read`` (``event: signed-out``),
after ``MAX_STREAM`` seconds (the browser reconnects), or when the API stops."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Final

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import StreamingResponse

from projections.store import DATABASE_ERRORS
from services.api import readmodel
from services.api.console.fleet import Asked, FleetParts, asked_filters, fleet_parts
from services.api.console.render import part
from services.api.console.sandbox import SANDBOX_PARTS, checked_name, checked_position
from services.api.console.session import COOKIE, Viewer, reader, token_store
from services.api.deps import ApiState, api_state
from services.common.tokens import READ, Grant

MIN_GAP: Final = 0.5  # seconds at least between two updates of one page
HEARTBEAT: Final = 15.0  # seconds between comments that keep a quiet stream open
MAX_STREAM: Final = 3600.0  # seconds before a stream ends (the browser reconnects, re-checked)
TAIL_PAGE: Final = 200  # inputs read per update of the timeline

router = APIRouter(include_in_schema=False)

Update = Callable[[asyncio.Event], Awaitable[list[str]]]  # given the feed's mark


def sse(event: str, data: object, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n"


def still_signed_in(request: Request) -> bool:
    return Grant(token_store(request), request.cookies.get(COOKIE, ""), READ).lapsed() is None


async def follow(request: Request, state: ApiState, update: Update) -> AsyncIterator[str]:
    """Call ``update()`` at once and whenever the processor commits; send what it returns.

    Every wake counts (the history of a name moves without any row changing: an ignored
    input); ``update`` says whether anything is new. The NOTIFY that wakes it is delivered
    after the commit, so what ``update`` reads then includes it."""
    feed = state.feed
    loop = asyncio.get_running_loop()
    ends = loop.time() + MAX_STREAM
    last_sent = last_update = loop.time() - MIN_GAP
    yield ": sandstream console\nretry: 2000\n\n"
    try:
        while not feed.closed and loop.time() < ends:
            mark = feed.mark()
            if not still_signed_in(request):
                yield sse("signed-out", {"message": "the session's token is no longer valid"})
                return
            for event in await update(mark):
                yield event
                last_sent = last_update = loop.time()
            if loop.time() - last_sent >= HEARTBEAT:
                yield ": heartbeat\n\n"
                last_sent = loop.time()
            await feed.wait(mark, min(HEARTBEAT, max(ends - loop.time(), 0.001)))
            gap = MIN_GAP - (loop.time() - last_update)
            if gap > 0:  # a rate limit on updates: what changes meanwhile is sent after it
                await asyncio.sleep(gap)
    except DATABASE_ERRORS:
        return  # the browser reconnects; the page says it is not live meanwhile


def streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


@router.get("/ui/live/fleet")
async def live_fleet(
    request: Request,
    viewer: Annotated[Viewer, Depends(reader)],
    state: Annotated[ApiState, Depends(api_state)],
    asked: Annotated[Asked, Depends(asked_filters)],
    cursor: str = "0",
) -> StreamingResponse:
    since = checked_position(cursor, "cursor") or 0
    sent: dict[str, str] = {}

    async def update(_: asyncio.Event) -> list[str]:
        parts: FleetParts = await fleet_parts(state, asked.filters, asked.problem)
        now = {"counts": parts.counts, "attention": parts.attention, "table": parts.table}
        if not sent:  # the first: the page was rendered with these, at its cursor
            sent.update(now)
            return [] if parts.cursor <= since else [sse("fleet", now)]
        changed = {k: v for k, v in now.items() if sent.get(k) != v}
        sent.update(changed)
        return [sse("fleet", changed)] if changed else []

    return streaming(follow(request, state, update))


@router.get("/ui/live/sandboxes/{name}")
async def live_sandbox(
    request: Request,
    name: str,
    viewer: Annotated[Viewer, Depends(reader)],
    state: Annotated[ApiState, Depends(api_state)],
    cursor: str = "0",
    after: str = "0",
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    checked_name(name)
    change = checked_position(cursor, "cursor") or 0
    seq = checked_position(after, "after") or 0
    if last_event_id and last_event_id.count(":") == 1:  # a reconnect: resume where it was
        resumed = last_event_id.split(":")
        if all(p.isdigit() and len(p) <= 18 for p in resumed):
            change, seq = int(resumed[0]), int(resumed[1])

    async def update(mark: asyncio.Event) -> list[str]:
        nonlocal change, seq
        events = []
        horizon = await state.feed.horizon(mark) or 0  # row changes: a cursor needs the horizon
        if horizon > change:
            rows = await readmodel.changes_after(state.pool, change, horizon, names=[name])
            change = horizon
            if rows:
                row = rows[-1]
                html = part(SANDBOX_PARTS, "row_panel", row, datetime.now(UTC))
                shown = {"html": html, "version": row.version, "phase": row.phase.value}
                events.append(sse("row", shown, f"{change}:{seq}"))
        page = await readmodel.history(state.pool, name, limit=TAIL_PAGE, after=seq)
        if page is not None and page.items:
            seq = page.items[-1].seq
            html = part(SANDBOX_PARTS, "inputs", name, page.items)
            events.append(sse("inputs", {"html": html, "last": seq}, f"{change}:{seq}"))
        return events

    return streaming(follow(request, state, update))
