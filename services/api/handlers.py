"""Exception handlers: every error is JSON ``{code, message}``; a malformed request is answered
only after authentication; a lost backend is a 503 answered inside the app."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from projections.store import CONNECTION_ERRORS
from services.api.deps import check_auth, request_scope
from services.api.errors import ApiError, describe_validation, error_response
from services.api.readmodel import InvalidArgument

log = logging.getLogger("sandstream.api")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers, **exc.extra)

    @app.exception_handler(InvalidArgument)
    async def invalid_argument(_: Request, exc: InvalidArgument) -> JSONResponse:
        return error_response(422, "INVALID_ARGUMENT", f"query parameter {exc.field!r}: "
                              f"{exc.message}")  # fmt: skip

    def _denied(request: Request) -> JSONResponse | None:
        # A malformed body is rejected before dependencies run: authenticate first anyway, so
        # an unauthenticated caller learns nothing about the request's shape.
        if not request.url.path.startswith("/v1/"):
            return None
        try:
            check_auth(request, request_scope(request.method, request.url.path))
        except ApiError as denied:
            return error_response(denied.status, denied.code, denied.message, denied.headers)
        return None

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        denied = _denied(request)
        if denied is not None:
            return denied
        return error_response(422, "INVALID_ARGUMENT", describe_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            # FastAPI's "error parsing the body" (e.g. not UTF-8): a validation error like
            # any other malformed body, after authentication.
            denied = _denied(request)
            if denied is not None:
                return denied
            return error_response(422, "INVALID_ARGUMENT", "request body is not valid JSON")
        codes = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}
        code = codes.get(
            exc.status_code, "INVALID_ARGUMENT" if exc.status_code < 500 else "INTERNAL"
        )
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, code, message, getattr(exc, "headers", None))

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("%s %s: backend unavailable: %r", request.method, request.url.path, exc)
        return error_response(503, "UNAVAILABLE", f"backend unavailable: {type(exc).__name__}")

    # Registered per class, so they are answered inside the app (and counted as 503 by the
    # metrics middleware); a handler for Exception runs outside it and re-raises.
    for connection_error in CONNECTION_ERRORS:
        app.add_exception_handler(connection_error, unavailable)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "INTERNAL", "internal error (see the server log)")
