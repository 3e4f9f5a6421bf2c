"""The arguments of a read: page sizes, opaque page tokens bound to the query they continue,
label filters, and ``InvalidArgument`` naming the argument a query cannot use."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

from events.common import INT64_MAX

T = TypeVar("T")

MAX_PAGE: Final = 500  # sandboxes per page of the list
MAX_HISTORY_PAGE: Final = 1000  # entries per page of a history
PAGE_TOKEN_MAX_LENGTH: Final = 2000  # characters of a page token a request may send


class InvalidArgument(ValueError):
    """A request argument the queries cannot use; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# ---------------------------------------------------------------------------------------------
# Page tokens: opaque to clients, bound to the query they continue


def _fingerprint(scope: str, filters: Any) -> str:
    raw = json.dumps([scope, filters], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def encode_page_token(scope: str, filters: Any, after: str | int) -> str:
    body = json.dumps({"a": after, "f": _fingerprint(scope, filters)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def plain_text(field: str, value: str) -> str:
    """``value`` if PostgreSQL can take it as text (no NUL character), else InvalidArgument."""
    if "\x00" in value:
        raise InvalidArgument(field, "must not contain NUL characters")
    return value


def page_position(field: str, value: Any, kind: type[str] | type[int]) -> Any:
    """A decoded page token's position, checked: a NUL-free name or an int64 sequence number."""
    if kind is str and isinstance(value, str) and "\x00" not in value and len(value) <= 253:
        return value
    if kind is int and type(value) is int and 0 <= value <= INT64_MAX:
        return value
    raise InvalidArgument(field, "malformed page token")


def decode_page_token(token: str, scope: str, filters: Any) -> Any:
    try:
        padded = token + "=" * (-len(token) % 4)
        body = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        after, fingerprint = body["a"], body["f"]
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeError):
        raise InvalidArgument("page_token", "malformed page token") from None
    if fingerprint != _fingerprint(scope, filters):
        raise InvalidArgument(
            "page_token", "the page token was issued for a different query (filters changed)"
        )
    return after


def name_after(scope: str, page_token: str | None) -> str | None:
    """The name a page of a by-name list (templates, providers) starts after."""
    if not page_token:
        return None
    return page_position("page_token", decode_page_token(page_token, scope, {}), str)  # type: ignore[no-any-return]


def name_page(
    scope: str, found: Sequence[T], limit: int, name: Callable[[T], str]
) -> tuple[list[T], str | None]:
    """A page of a by-name list read ``limit + 1`` long, and the token of the next one (None
    on the last)."""
    items = list(found[:limit])
    token = encode_page_token(scope, {}, name(items[-1])) if len(found) > limit else None
    return items, token


# ---------------------------------------------------------------------------------------------
# Label filters: "key=value" (equal) or "key" (present)


def parse_label_filters(values: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    equal: dict[str, str] = {}
    present: list[str] = []
    for item in values:
        key, sep, value = plain_text("label", item).partition("=")
        if not key:
            raise InvalidArgument("label", f"expected key=value or key, got {item!r}")
        if sep:
            if key in equal and equal[key] != value:
                raise InvalidArgument("label", f"conflicting filters for label {key!r}")
            equal[key] = value
        else:
            present.append(key)
    return equal, sorted(set(present))
