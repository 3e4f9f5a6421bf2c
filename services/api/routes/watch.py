"""The watches: row changes (``/v1/watch``, a change_seq cursor) and every decided event
(``/v1/watch/events``, an outbox id cursor) as server-sent events, resumable from a cursor.

A stream re-checks its token at every wake (at least once per poll interval of the change
feed, 1 s): once the token is revoked, expired or no longer holds ``sandbox:read``, or the
tokens file is not valid, it sends ``event: denied`` (``{"status", "code", "message"}``, as
the error body of a refused request) and ends."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Final
from uuid import UUID

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from events.common import INT32_MAX, INT64_MAX, SANDBOX_NAME_PATTERN
from projections.store import DATABASE_ERRORS
from services.api import readmodel
from services.api.deps import Reader, State, grant
from services.api.errors import ApiError
from services.api.models import SSE_EVENT_SCHEMA, responses
from services.api.readmodel import ChangeFeed
from services.common import metrics
from services.common.database import Pool
from services.common.names import resolve_all
from services.common.tokens import READ, Denied, Grant

log = logging.getLogger("sandstream.api")

HEARTBEAT: Final = 15.0  # seconds between watch bookmarks when nothing changes
MAX_WATCH_SECONDS: Final = 86400  # the longest ?timeout= a stream may ask for

router = APIRouter()


@router.get(
    "/v1/watch",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "server-sent events: `event: sandbox` with the row as data and "
            "`id:` its change_seq; `event: bookmark` every 15 s; `event: denied` (then the "
            "end) once the token is revoked, expires or loses sandbox:read",
            "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
        },
        **responses(401, 403, 422),
    },
    summary="Follow row changes as server-sent events, resumable from a cursor",
    tags=["sandboxes"],
)
async def watch(
    request: Request,
    principal: Reader,
    state: State,
    cursor: Annotated[
        int | None,
        Query(ge=0, le=INT64_MAX, description="resume after this change_seq (an event id)"),
    ] = None,
    name: Annotated[
        list[Annotated[str, Query(pattern=SANDBOX_NAME_PATTERN)]],
        Query(description="only these sandboxes (repeatable)"),
    ] = [],  # noqa: B006
    include_deleted: Annotated[
        bool, Query(description="without a cursor: also replay tombstones")
    ] = False,
    incarnation: Annotated[
        UUID | None, Query(description="only this incarnation's row (a sandbox_id)")
    ] = None,
    generation: Annotated[
        int | None, Query(ge=1, le=INT32_MAX, description="only while at this generation")
    ] = None,
    timeout: Annotated[
        float | None,
        Query(gt=0, le=MAX_WATCH_SECONDS, description="end the stream after this many s"),
    ] = None,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", description="overrides cursor")
    ] = None,
) -> StreamingResponse:
    start = _resume_point(cursor, last_event_id)
    return StreamingResponse(
        watch_stream(
            state.pool,
            state.feed,
            start,
            name,
            include_deleted,
            timeout,
            Narrow(incarnation, generation),
            grant(request, READ),
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@dataclass(frozen=True, slots=True)
class Narrow:
    """One incarnation (sandbox id) and/or one generation."""

    incarnation: UUID | None = None
    generation: int | None = None


def _sse(event: str, data: str, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {data}\n\n"


def denied_body(denied: Denied, what: str) -> dict[str, object]:
    """Why a stream whose token lapsed ended (the body of a 401 or 403 answer, and status)."""
    code = "UNAUTHENTICATED" if denied.status == 401 else "PERMISSION_DENIED"
    return {"status": denied.status, "code": code, "message": f"{what} ended: {denied.message}"}


def denied_event(denied: Denied) -> str:
    """The last event of a watch whose token lapsed."""
    return _sse("denied", json.dumps(denied_body(denied, "watch")))


async def watch_stream(
    pool: Pool,
    feed: ChangeFeed,
    start: int | None,
    names: list[str],
    include_deleted: bool,
    timeout: float | None,
    narrow: Narrow | None = None,
    grant: Grant | None = None,
) -> AsyncIterator[str]:
    narrow = narrow or Narrow()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout else None
    metrics.API_WATCHERS.inc()
    try:
        yield ": sandstream watch\nretry: 2000\n\n"
        cursor = start or 0
        live_only = start is None and not include_deleted  # the first replay is a list
        last_sent = loop.time()
        while not feed.closed:
            if grant is not None and (lapsed := grant.lapsed()) is not None:
                yield denied_event(lapsed)
                return
            mark = feed.mark()
            horizon = await feed.horizon(mark)
            if horizon is not None:
                while horizon > cursor:
                    rows = await readmodel.changes_after(
                        pool, cursor, horizon, names=names, live_only=live_only,
                        incarnation=narrow.incarnation, generation=narrow.generation,
                    )  # fmt: skip
                    for row in rows:
                        yield _sse("sandbox", row.model_dump_json(), row.change_seq)
                        last_sent = loop.time()
                    full = len(rows) == readmodel.CHANGES_PAGE  # more may follow the page
                    cursor = rows[-1].change_seq if full else horizon
                live_only = False  # the first replay (a list) is over: deletions are news
            now_ = loop.time()
            if deadline is not None and now_ >= deadline:
                return
            if now_ - last_sent >= HEARTBEAT:
                yield _sse("bookmark", json.dumps({"cursor": cursor}), cursor)
                last_sent = now_
            wait = min(feed.poll_interval, HEARTBEAT - (now_ - last_sent))
            if deadline is not None:
                wait = min(wait, deadline - now_)
            await feed.wait(mark, max(wait, 0.001))
    except DATABASE_ERRORS as exc:
        log.warning("watch stream ended: %r", exc)
    finally:
        metrics.API_WATCHERS.dec()


# OpenAPI 3.1: the schema of an event stream describes one event.
DECIDED_EVENT_SCHEMA: Final = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": ["decided", "gap", "bookmark", "denied"]},
        "id": {"type": "string", "pattern": "^[0-9]+$", "description": "the sequence number"},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "a decided event (event: decided), {cursor, retained_from, message} "
            "(event: gap), {cursor} (event: bookmark) or {status, code, message} (event: "
            "denied)",
        },
        "retry": {"type": "integer"},
    },
}


@router.get(
    "/v1/watch/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "server-sent events: `event: decided` with a decided event (as "
            "published on the events topic) as data and `id:` its sequence number, in commit "
            "order; `event: gap` when the cursor is older than what is retained; `event: "
            "bookmark` every 15 s; `event: denied` (then the end) once the token is revoked, "
            "expires or loses sandbox:read",
            "content": {"text/event-stream": {"schema": DECIDED_EVENT_SCHEMA}},
        },
        **responses(401, 403, 422),
    },
    summary="Follow every decided event in order, resumable from a cursor",
    tags=["sandboxes"],
)
async def watch_events(
    request: Request,
    principal: Reader,
    state: State,
    cursor: Annotated[
        int | None,
        Query(ge=0, le=INT64_MAX, description="resume after this sequence number (an event id)"),
    ] = None,
    name: Annotated[
        list[Annotated[str, Query(pattern=SANDBOX_NAME_PATTERN)]],
        Query(description="only these sandboxes (repeatable)"),
    ] = [],  # noqa: B006
    incarnation: Annotated[
        UUID | None, Query(description="only this incarnation's events (a sandbox_id)")
    ] = None,
    generation: Annotated[
        int | None, Query(ge=1, le=INT32_MAX, description="only events at this generation")
    ] = None,
    timeout: Annotated[
        float | None,
        Query(gt=0, le=MAX_WATCH_SECONDS, description="end the stream after this many s"),
    ] = None,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", description="overrides cursor")
    ] = None,
) -> StreamingResponse:
    start = _resume_point(cursor, last_event_id)
    return StreamingResponse(
        decided_stream(
            state.pool,
            state.feed,
            state.settings.topic_events,
            start or 0,
            name,
            Narrow(incarnation, generation),
            timeout,
            grant(request, READ),
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _resume_point(cursor: int | None, last_event_id: str | None) -> int | None:
    if last_event_id is None or not last_event_id.strip():
        return cursor
    try:
        start = int(last_event_id)
        if not 0 <= start <= INT64_MAX:
            raise ValueError
    except ValueError:
        raise ApiError(
            422,
            "INVALID_ARGUMENT",
            "header 'Last-Event-ID': must be a non-negative integer below 2^63 (an event id)",
        ) from None
    return start


async def decided_stream(
    pool: Pool,
    feed: ChangeFeed,
    topic: str,
    cursor: int,
    names: list[str],
    narrow: Narrow,
    timeout: float | None,
    grant: Grant | None = None,
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout else None
    metrics.API_WATCHERS.inc()
    try:
        yield ": sandstream decided events\nretry: 2000\n\n"
        if names:  # a bound name: its own events (bound, released) and its member's
            names = sorted({*names, *await resolve_all(pool, names)})
        oldest = await readmodel.retained_from(pool, topic)
        if oldest is not None and cursor < oldest - 1:
            gap = {"cursor": cursor, "retained_from": oldest,
                   "message": f"events after {cursor} and before {oldest} are no longer "
                   "retained (outbox housekeeping); the stream is complete from "
                   f"{oldest} on"}  # fmt: skip
            yield _sse("gap", json.dumps(gap), oldest - 1)
            cursor = oldest - 1
        last_sent = loop.time()
        while not feed.closed:
            if grant is not None and (lapsed := grant.lapsed()) is not None:
                yield denied_event(lapsed)
                return
            mark = feed.mark()
            horizon = await readmodel.event_horizon(pool)
            while horizon is not None and horizon > cursor:
                found = await readmodel.events_after(
                    pool, topic, cursor, horizon, names=names,
                    incarnation=narrow.incarnation, generation=narrow.generation,
                )  # fmt: skip
                for event in found:
                    yield _sse("decided", event.body, event.seq)
                    last_sent = loop.time()
                full = len(found) == readmodel.EVENTS_PAGE
                cursor = found[-1].seq if full else horizon
            now_ = loop.time()
            if deadline is not None and now_ >= deadline:
                return
            if now_ - last_sent >= HEARTBEAT:
                yield _sse("bookmark", json.dumps({"cursor": cursor}), cursor)
                last_sent = now_
            wait = min(feed.poll_interval, HEARTBEAT - (now_ - last_sent))
            if deadline is not None:
                wait = min(wait, deadline - now_)
            await feed.wait(mark, max(wait, 0.001))
    except DATABASE_ERRORS as exc:
        log.warning("decided-event stream ended: %r", exc)
    finally:
        metrics.API_WATCHERS.dec()
