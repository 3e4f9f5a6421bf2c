"""The API's errors: every one is JSON ``{"code": ..., "message": ...}``, naming the field or
the phase; malformed requests are answered after authentication."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, Final

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from events.common import COMMAND_ID_PATTERN, PROVIDER_NAME_PATTERN, SANDBOX_NAME_PATTERN
from events.outcomes import Code
from services.common.pools import POOL_NAME_PATTERN

log = logging.getLogger("sandstream.api")

STATUS_OF: Final[dict[Code, int]] = {
    Code.OK: 200,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.ABORTED: 409,
    Code.FAILED_PRECONDITION: 412,
    Code.INVALID_ARGUMENT: 422,
}

# Friendlier words for the patterns of the wire types than "should match pattern '^...$'".
_PATTERN_WORDS: Final = {
    SANDBOX_NAME_PATTERN: "must be a DNS label: 1-63 lowercase letters, digits or '-', "
    "starting and ending with a letter or digit",
    COMMAND_ID_PATTERN: "must be 1-128 characters from A-Z a-z 0-9 . _ : -",
    PROVIDER_NAME_PATTERN: "must be 1-128 characters from A-Z a-z 0-9 . _ -",
    POOL_NAME_PATTERN: "must be a DNS label of at most 54 characters: lowercase letters, "
    "digits or '-', starting and ending with a letter or digit (members are named "
    "<pool>-<8 random>)",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        **extra: Any,  # more fields of the error body, e.g. command_id
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.extra = extra


def query_time(name: str, value: datetime | None) -> datetime | None:
    """A time query parameter in UTC; a 422 naming it when it has no time zone or when its UTC
    time falls outside 0001-01-01 to 9999-12-31 (``0001-01-01T00:00:00+14:00`` is in year 0
    in UTC), which neither Python nor PostgreSQL's driver can hold: never a 5xx, nor an empty
    200 from a stream that broke once it had begun."""
    if value is None:
        return None
    if value.tzinfo is None:
        raise ApiError(422, "INVALID_ARGUMENT", f"query parameter {name!r}: needs a time zone")
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ApiError(
            422,
            "INVALID_ARGUMENT",
            f"query parameter {name!r}: out of range: in UTC it must fall within "
            "0001-01-01T00:00:00Z and 9999-12-31T23:59:59.999999Z",
        ) from None


class ErrorBody(BaseModel):
    code: str = Field(description="NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, ...")
    message: str = Field(description="what went wrong, naming the field or the phase")


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, **extra}, status, headers=headers)


_BODY_MODELS: Final = frozenset({"CreateSandboxRequest", "LifecycleRequest"})


def _where(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = list(loc)
    source = parts.pop(0) if parts and parts[0] in ("body", "query", "path", "header") else "body"
    if source == "body" and len(parts) > 1 and parts[0] in _BODY_MODELS:
        parts = parts[1:]
    name = ".".join(str(p) for p in parts)
    if source == "body":
        return f"field {name!r}" if name else "request body"
    return f"{source} parameter {name!r}"


def describe_validation(errors: list[Any], limit: int = 5) -> str:
    """One line naming each offending field, e.g. ``field 'spec.image': Field required``."""
    parts = []
    for item in errors[:limit]:
        kind = item.get("type", "")
        msg = str(item.get("msg", "invalid"))
        if kind == "json_invalid":
            parts.append(f"request body is not valid JSON: {item.get('ctx', {}).get('error', msg)}")
            continue
        if kind == "string_pattern_mismatch":
            pattern = str((item.get("ctx") or {}).get("pattern"))
            msg = _PATTERN_WORDS.get(pattern, msg)
        elif tuple(item.get("loc", ())) == ("body",):
            if kind == "missing":
                parts.append("request body is required")
            else:
                parts.append(f"request body must be a JSON object ({msg})")
            continue
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{_where(item.get('loc', ()))}: {msg}")
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more")
    return "; ".join(parts) or "invalid request"
