"""The console's HTML: the Jinja2 templates (autoescaped, shipped in the package), the filters
they use, and the pages' answers with their security headers."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from starlette.responses import HTMLResponse

from events.common import LIVE_PHASES
from services.api.readmodel import input_label
from services.audit.page import COLOURS

# Scripts and styles only from the console itself; no frames, no forms to elsewhere.
HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def age(moment: datetime | None, now: datetime | None = None) -> str:
    """How long ago, in one unit: ``42s``, ``5m``, ``3h``, ``2d``."""
    if moment is None:
        return "-"
    seconds = max(int(((now or datetime.now(UTC)) - moment).total_seconds()), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def clock(moment: datetime | None) -> str:
    """A time of day in UTC with milliseconds (the timeline's)."""
    if moment is None:
        return "-"
    return moment.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3]


def stamp(moment: datetime | None) -> str:
    """A full time in UTC, to the second."""
    if moment is None:
        return "-"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def iso(moment: datetime | None) -> str:
    return moment.isoformat() if moment is not None else ""


def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("services.api.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(age=age, clock=clock, stamp=stamp, iso=iso)
    env.globals.update(
        phases=[p.value for p in LIVE_PHASES], colours=COLOURS, input_label=input_label
    )
    return env


TEMPLATES: Final = environment()


def html(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    """A whole page."""
    body = TEMPLATES.get_template(template).render(**context)
    return HTMLResponse(body, status, headers=HEADERS)


def part(template: str, macro: str, *args: Any, **kwargs: Any) -> str:
    """One macro of a template, rendered alone (the live updates send the page's own parts)."""
    rendered: str = getattr(TEMPLATES.get_template(template).module, macro)(*args, **kwargs)
    return str(rendered)
