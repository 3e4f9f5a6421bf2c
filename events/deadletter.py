"""The dead-letter record: a malformed input, why it was refused, and where it came from."""

from __future__ import annotations

from typing import Literal

from events.common import SCHEMA_VERSION, Strict, Timestamp


class SourceRecord(Strict):
    topic: str
    partition: int
    offset: int
    timestamp: Timestamp


class DeadLetter(Strict):
    type: Literal["DeadLetter"] = "DeadLetter"
    schema_version: Literal[1] = SCHEMA_VERSION
    reason: str
    source: SourceRecord
    key: str | None
    value: str | None
    value_encoding: Literal["utf-8", "base64", "none"]
