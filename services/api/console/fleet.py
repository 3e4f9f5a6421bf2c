"""The fleet page (``/ui/``): live sandboxes per phase, the attention list, a filtered, paged
table of the sandboxes, and the chart of the phase counts over the last hours. Its parts are
rendered here for the page and, as they change, for its live feed (``live``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Final
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Query
from starlette.responses import HTMLResponse, RedirectResponse, Response

from events.common import Phase
from events.publisher import now
from services.api import readmodel
from services.api.console.chart import Chart, draw
from services.api.console.render import html, part
from services.api.console.session import ROOT, Viewer, reader
from services.api.deps import ApiState, api_state
from services.api.readmodel import InvalidArgument, SandboxList

PAGE_SIZE: Final = 50  # sandboxes per page of the table, unless the page asks for another size
FLEET_PARTS: Final = "_fleet.html"

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True, slots=True)
class Filters:
    """The table's filters as the page's query carries them."""

    phases: list[str] = field(default_factory=list)
    labels: str = ""  # "key=value key2" as typed
    page_token: str | None = None
    limit: int = PAGE_SIZE

    @property
    def label_list(self) -> list[str]:
        return self.labels.replace(",", " ").split()

    def query(self, **changes: Any) -> str:
        """This filter's query string, with ``changes`` (None drops a parameter)."""
        params: dict[str, Any] = {
            "phase": self.phases,
            "label": self.labels or None,
            "limit": self.limit if self.limit != PAGE_SIZE else None,
            "page_token": self.page_token,
            **changes,
        }
        return urlencode({k: v for k, v in params.items() if v}, doseq=True)


@dataclass(frozen=True, slots=True)
class Asked:
    """The filters a request asked for, and what is wrong with them in words (None: nothing)."""

    filters: Filters
    problem: str | None


async def asked_filters(
    phase: Annotated[list[str], Query()] = [],  # noqa: B006
    label: str | None = None,
    page_token: str | None = None,
    limit: str | None = None,
) -> Asked:
    """The table's filters from the query (the page's and its live feed's); a coroutine, as
    every dependency is (``api_state``)."""
    known = {p.value for p in Phase}
    wrong = [p for p in phase if p not in known]
    size = int(limit) if limit and limit.isdigit() and len(limit) < 4 else PAGE_SIZE
    size = min(max(size, 1), readmodel.MAX_PAGE)
    filters = Filters([p for p in phase if p in known], (label or "")[:1000], page_token or None,
                      size)  # fmt: skip
    return Asked(filters, f"phase: unknown phase {', '.join(map(repr, wrong))}" if wrong else None)


async def table_of(state: ApiState, filters: Filters) -> tuple[SandboxList, str | None]:
    try:
        found = await readmodel.list_sandboxes(
            state.pool,
            phases=[Phase(p) for p in filters.phases],
            labels=filters.label_list,
            limit=filters.limit,
            page_token=filters.page_token,
        )
    except InvalidArgument as exc:
        return SandboxList(items=[], next_page_token=None, cursor=0), str(exc)
    return found, None


@dataclass(frozen=True, slots=True)
class FleetParts:
    """The parts of the page that change as the fleet does, rendered."""

    counts: str
    attention: str
    table: str
    cursor: int


async def fleet_parts(state: ApiState, filters: Filters, problem: str | None) -> FleetParts:
    moment = now()
    soon = state.settings.expiring_soon_seconds
    counts, summary, needing, (table, wrong) = await asyncio.gather(  # four connections at once
        readmodel.live_counts(state.pool),
        readmodel.attention(state.pool, moment, soon),
        readmodel.needing_attention(state.pool, moment, soon),
        table_of(state, filters),
    )
    return FleetParts(
        counts=part(FLEET_PARTS, "counts", {p.value: n for p, n in counts.items()}),
        attention=part(FLEET_PARTS, "attention", summary, needing),
        table=part(FLEET_PARTS, "table", table, filters, problem or wrong, datetime.now(UTC)),
        cursor=table.cursor,
    )


@router.get("/ui")
async def console_root() -> Response:
    return RedirectResponse(f"{ROOT}/", 308)


@router.get("/ui/")
async def fleet_page(
    viewer: Annotated[Viewer, Depends(reader)],
    state: Annotated[ApiState, Depends(api_state)],
    asked: Annotated[Asked, Depends(asked_filters)],
    hours: str = "1",
) -> HTMLResponse:
    filters, problem = asked.filters, asked.problem
    window = int(hours) if hours.isdigit() and int(hours) in readmodel.TREND_WINDOWS else 1
    parts = await fleet_parts(state, filters, problem)
    try:
        drawing: Chart | str = draw(await readmodel.phase_trend(state.pool, window))
    except readmodel.TrendTooLarge as exc:
        drawing = f"No chart: {exc}. A shorter window reads less of it."
    live = f"{ROOT}/live/fleet?{filters.query(cursor=parts.cursor)}"
    return html(
        "fleet.html",
        422 if problem else 200,
        viewer=viewer,
        parts=parts,
        filters=filters,
        chart=drawing,
        hours=window,
        windows=readmodel.TREND_WINDOWS,
        live=live,
    )
