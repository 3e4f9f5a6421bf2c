"""Signing in to the console: the token itself in an HttpOnly, SameSite=Strict cookie whose path
is ``/ui``, checked against the same token store and scopes as the API on every request; the
forms' CSRF token (an HMAC of the session's token); and the fetch-metadata check of every POST.

The cookie adds no power to a token: the JSON API (``/v1/``) never reads it, and each console
route asks the scope of the API route it stands for (``sandbox:read`` to look,
``sandbox:write`` to act, ``audit:read`` for the audit chain). docs/security.md has the design.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qs, quote

from fastapi import Request
from starlette.responses import Response

from services.common.tokens import AUDIT, READ, WRITE, Denied, Principal, TokenStore

COOKIE: Final = "sandstream_console"
ROOT: Final = "/ui"
CSRF_FIELD: Final = "csrf"
MAX_FORM_FIELDS: Final = 20
# Requests a browser says came from another site (or a sibling one) never act: fetch metadata.
SAME_SITE: Final = frozenset({"same-origin", "none"})


class SignInNeeded(Exception):
    """No valid session: the browser goes to the sign-in page (and back to ``next`` after)."""

    def __init__(self, next_path: str, message: str | None = None) -> None:
        super().__init__(message or "sign in")
        self.next_path = next_path
        self.message = message


class Refused(Exception):
    """A console request that is not allowed or not well formed: an error page with the words."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who is looking: the token's principal, and the token (never shown: only its HMAC)."""

    principal: Principal
    token: str

    @property
    def name(self) -> str:
        return self.principal.name

    @property
    def can_write(self) -> bool:
        return WRITE in self.principal.scopes

    @property
    def can_audit(self) -> bool:
        return AUDIT in self.principal.scopes

    @property
    def csrf(self) -> str:
        return csrf_token(self.token)


def csrf_token(token: str) -> str:
    """The forms' CSRF token of a session: unforgeable without the token, and no way back to it."""
    return hmac.new(token.encode(), b"sandstream console form", hashlib.sha256).hexdigest()


def token_store(request: Request) -> TokenStore:
    store: TokenStore = request.app.state.tokens
    return store


def here(request: Request) -> str:
    """The path and query of this request, to come back to after signing in."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def authorize(request: Request, scope: str) -> Viewer:
    """The viewer of this request's session if its token is live and holds ``scope``."""
    value = request.cookies.get(COOKIE)
    if not value:
        raise SignInNeeded(here(request))
    checked = token_store(request).authorize(value, scope)
    if isinstance(checked, Denied):
        if checked.status == 401:
            raise SignInNeeded(here(request), checked.message)
        raise Refused(403, checked.message)
    return Viewer(checked, value)


async def reader(request: Request) -> Viewer:
    return authorize(request, READ)


def check_same_site(request: Request) -> None:
    """Refuse a state-changing request the browser marks as coming from another site."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in SAME_SITE:
        raise Refused(403, f"refused: a {site} request may not act through the console")


async def read_form(request: Request) -> dict[str, str]:
    """The fields of an urlencoded form (the last value of each), after the same-site check."""
    check_same_site(request)
    try:
        text = (await request.body()).decode("utf-8")
        fields = parse_qs(text, keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS)
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, "the form could not be read (not UTF-8, or too many fields)") from None
    return {key: values[-1] for key, values in fields.items()}


async def acting_form(request: Request, scope: str) -> tuple[Viewer, dict[str, str]]:
    """An action's viewer (holding ``scope``) and its form, whose CSRF token must match."""
    viewer = authorize(request, scope)
    form = await read_form(request)
    if not hmac.compare_digest(form.get(CSRF_FIELD, ""), viewer.csrf):
        raise Refused(403, "refused: the form's CSRF token does not match this session (reload)")
    return viewer, form


def safe_next(path: str | None) -> str:
    """Where to go after signing in: a console path only (never another site)."""
    if path and path.startswith(f"{ROOT}/") and not path.startswith("//") and "\\" not in path:
        return path
    return f"{ROOT}/"


def sign_in_url(next_path: str) -> str:
    return f"{ROOT}/login?next={quote(next_path, safe='/')}"


def start_session(response: Response, request: Request, token: str) -> None:
    response.set_cookie(
        COOKIE,
        token,
        path=ROOT,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def end_session(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE, path=ROOT, httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )
