"""JSON (de)serialization of every message, with errors that name the offending field."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from events.commands import Command
from events.decided import DecidedEvent
from events.observations import Observation

T = TypeVar("T")

COMMANDS: TypeAdapter[Command] = TypeAdapter(Command)
OBSERVATIONS: TypeAdapter[Observation] = TypeAdapter(Observation)
EVENTS: TypeAdapter[DecidedEvent] = TypeAdapter(DecidedEvent)


class DecodeError(ValueError):
    """A record that is not a valid message; ``reason`` is fit for a dead-letter record."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def describe(error: ValidationError, limit: int = 5) -> str:
    """One line naming each offending field, e.g. ``field 'spec.image': Field required``."""
    parts = []
    for item in error.errors()[:limit]:
        path = list(item["loc"])
        if len(path) > 1 and isinstance(path[0], str) and path[0][:1].isupper():
            path = path[1:]  # drop the union tag pydantic puts first
        loc = ".".join(str(p) for p in path) or "<root>"
        msg = item["msg"]
        if item["type"] == "union_tag_invalid":
            ctx: dict[str, Any] = item.get("ctx") or {}
            expected = ctx.get("expected_tags")
            msg = f"unknown message type {ctx.get('tag')!r} (expected one of {expected})"
            loc = "type"
        elif item["type"] == "union_tag_not_found":
            loc, msg = "type", "Field required"
        parts.append(f"field {loc!r}: {msg}")
    more = error.error_count() - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


def decode(adapter: TypeAdapter[T], raw: bytes | str | None) -> T:
    if raw is None or raw in (b"", ""):
        raise DecodeError("empty record value")
    try:
        # Strict: a wrong JSON type is an error, not coerced ("3" or true for an integer,
        # a number for a timestamp). Python-side construction stays lax.
        # The core validator itself: TypeAdapter's wrapper costs a tenth of a small record.
        return adapter.validator.validate_json(raw, strict=True)  # type: ignore[no-any-return]
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise DecodeError("not valid JSON: " + exc.errors()[0]["msg"]) from None
        raise DecodeError(describe(exc)) from None


def check_key(record_key: bytes | None, body_key: str) -> None:
    """Partitioning relies on the record key being the sandbox name in the body."""
    got = record_key.decode("utf-8", "replace") if record_key is not None else None
    if got != body_key:
        raise DecodeError(f"record key {got!r} does not match body key {body_key!r}")


def encode(message: BaseModel) -> bytes:
    """``message.model_dump_json().encode()``, straight from the model's serializer (which
    writes bytes: no round trip through ``str``)."""
    return message.__pydantic_serializer__.to_json(message)


def storable(text: str) -> str:
    """``text`` with what PostgreSQL text cannot hold (NUL, lone surrogates) escaped, for
    history columns that record a refused record's key or the reason it was refused."""
    text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
