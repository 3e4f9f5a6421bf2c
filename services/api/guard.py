"""The API's front gate, before any route or body parsing: authentication and a body size
limit. A request under ``/v1/`` without a valid token for its method's scope is answered 401
or 403 before a byte of its body is read; a body above the limit (under ``/v1/`` and the
console's ``/ui/``) is answered 413 (from its Content-Length at once, or as soon as the streamed
bytes pass it) and never parsed."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from starlette.requests import Request

from services.api.deps import READ_METHODS, check_auth, request_scope
from services.api.errors import ApiError, error_response

# The JSON API and the console: bodies above the limit are refused under both.
GUARDED: Final = ("/v1/", "/ui/")
# A file upload's body is streamed on to the sandbox, never read here: only its declared
# length is checked, against its own limit (the route counts the bytes as they pass).
STREAMED_UPLOAD: Final = re.compile(r"^/v1/sandboxes/[^/]+/files/content$")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class GuardMiddleware:
    def __init__(self, app: Any, max_body_bytes: int, max_upload_bytes: int | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not path.startswith(GUARDED):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        try:
            if path.startswith("/v1/"):  # the console (/ui/) signs in with its own cookie
                check_auth(request, request_scope(request.method, request.url.path))
        except ApiError as denied:
            await _answer(scope, receive, send, denied)
            return
        if request.method in READ_METHODS:
            await self.app(scope, receive, send)
            return
        declared = request.headers.get("content-length")
        if self.max_upload_bytes is not None and STREAMED_UPLOAD.match(path):
            if declared is not None and (
                not declared.isdigit() or int(declared) > self.max_upload_bytes
            ):
                await _answer(scope, receive, send, upload_too_large(self.max_upload_bytes))
                return
            await self.app(scope, receive, send)
            return
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _answer(scope, receive, send, self._too_large())
            return
        # Read the body here (bounded), then hand it on: a chunked body is counted as it
        # comes and refused once it passes the limit.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _answer(scope, receive, send, self._too_large())
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            "PAYLOAD_TOO_LARGE",
            f"request body: larger than {self.max_body_bytes} bytes (the API's limit)",
        )


def upload_too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        "PAYLOAD_TOO_LARGE",
        f"upload: larger than {limit} bytes (the files_max_upload_bytes setting)",
    )


async def _answer(scope: Message, receive: Receive, send: Send, error: ApiError) -> None:
    response = error_response(error.status, error.code, error.message, error.headers)
    await response(scope, receive, send)
