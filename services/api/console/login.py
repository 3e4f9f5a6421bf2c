"""Signing in and out of the console: a form that takes a token (checked like any API request,
it must hold ``sandbox:read``) and keeps it in the session cookie; signing out forgets it."""

from __future__ import annotations

import hmac
from typing import Final

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from services.api.console.render import html
from services.api.console.session import (
    COOKIE,
    CSRF_FIELD,
    ROOT,
    Refused,
    csrf_token,
    end_session,
    read_form,
    safe_next,
    start_session,
    token_store,
)
from services.common.tokens import READ, Denied

router = APIRouter(include_in_schema=False)


# Said when a session's token stopped being valid (the page takes no words from its URL).
ENDED: Final = (
    "Your session's token is no longer valid (revoked, expired or unknown): sign in again."
)


@router.get("/ui/login")
async def login_page(next: str | None = None, ended: str | None = None) -> HTMLResponse:
    return html("login.html", viewer=None, next=safe_next(next), message=ENDED if ended else "")


@router.post("/ui/login")
async def login(request: Request) -> Response:
    form = await read_form(request)
    token = form.get("token", "").strip()
    target = safe_next(form.get("next"))
    checked = token_store(request).authorize(token, READ) if token else None
    if checked is None or isinstance(checked, Denied):
        status = checked.status if checked is not None else 401
        message = checked.message if checked is not None else "enter a token"
        if status == 401:
            message = f"Not signed in: {message}."
        else:
            message = f"Not signed in: {message} (the console needs it to show anything)."
        return html("login.html", status, viewer=None, next=target, message=message)
    response = RedirectResponse(target, 303)
    start_session(response, request, token)
    return response


@router.post("/ui/logout")
async def logout(request: Request) -> Response:
    form = await read_form(request)
    value = request.cookies.get(COOKIE, "")
    if not hmac.compare_digest(form.get(CSRF_FIELD, ""), csrf_token(value)):
        raise Refused(403, "refused: the form's CSRF token does not match this session (reload)")
    response = RedirectResponse(f"{ROOT}/login", 303)
    end_session(response, request)
    return response
