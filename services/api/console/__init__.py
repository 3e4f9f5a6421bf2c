"""The operator's console: HTML pages under ``/ui/``, served by the API process, over the read
model and the audit, following the change feed live; the actions run the API's own handlers.
Part of the API role (imports common and audit only). docs/console.md says what it shows.

- ``session``: the sign-in cookie (the token, HttpOnly, SameSite=Strict, path /ui), the scope
  checks, the CSRF token and the same-site check of the forms.
- ``login``: the sign-in form, signing in and out.
- ``render``: the Jinja2 templates (``templates/``), their filters, the pages' security headers.
- ``fleet``: the fleet page: counts per phase, attention list, filtered paged table, chart.
- ``chart``: the chart of phase counts over the last hours, drawn as SVG.
- ``sandbox``: the sandbox page (row, conditions, timeline, audit chain) and a command's page.
- ``catalog``: the templates page (read-only).
- ``pools``: the warm pools page (read-only): each pool's status.
- ``actions``: stop, start, restart, hold, release, delete through the API's route handlers.
- ``live``: the pages' server-sent events, woken by the API's change feed.

``static/`` holds the stylesheet and the script (no framework, nothing fetched from elsewhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from fastapi import FastAPI, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from services.api.console import actions, catalog, fleet, live, login, pools, sandbox
from services.api.console.render import html
from services.api.console.session import ROOT, Refused, SignInNeeded, sign_in_url

STATIC: Final = Path(__file__).parent / "static"


def mount(app: FastAPI) -> None:
    """Serve the console under ``/ui/`` (its routes stay out of the OpenAPI document)."""
    for module in (login, fleet, catalog, pools, sandbox, actions, live):
        app.include_router(module.router)
    app.mount(f"{ROOT}/static", StaticFiles(directory=STATIC), name="console-static")

    @app.exception_handler(SignInNeeded)
    async def sign_in(request: Request, exc: SignInNeeded) -> Response:
        if request.headers.get("accept", "").startswith("text/event-stream"):
            return Response(exc.message or "sign in", 401)  # a live feed: the page says so
        target = sign_in_url(exc.next_path) + ("&ended=1" if exc.message else "")
        return RedirectResponse(target, 303)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> HTMLResponse:
        title = {403: "Not allowed", 404: "Not found"}.get(exc.status, "Cannot do that")
        return html("error.html", exc.status, viewer=None, title=title, message=exc.message)
