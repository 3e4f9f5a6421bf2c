"""The dead-letter record: a refused input, why it was refused and where it is, always small.

A dead letter points at the original (its topic, partition and offset: the original stays in
its topic) and keeps of its key and value only a bounded excerpt with their size and SHA-256,
so it fits in a Kafka record however large the original was (``dead_letter``, the one builder).
"""

from __future__ import annotations

import base64
import hashlib
from datetime import datetime
from typing import Final, Literal

from events.common import Strict, Timestamp

KEY_BYTES: Final = 256  # of a refused record's key kept (a sandbox name has at most 63)
VALUE_BYTES: Final = 1024  # of its value kept
REASON_CHARS: Final = 1000  # of the reason kept
# What a dead letter (its value and its record key) can take at most: each excerpt and the
# reason escaped to six bytes a character, the coordinates (a topic name has at most 249
# characters) and the field names (tests/test_deadletter.py builds the worst case).
MAX_BYTES: Final = 16 * 1024


class SourceRecord(Strict):
    topic: str
    partition: int
    offset: int
    timestamp: Timestamp


class Excerpt(Strict):
    """The start of a payload (raw bytes), with the whole payload's size and SHA-256."""

    text: str  # the first bytes: UTF-8 text, or base64 when they are not UTF-8
    encoding: Literal["utf-8", "base64"]
    size: int  # bytes of the whole payload
    sha256: str  # hex digest of the whole payload
    truncated: bool  # ``text`` holds less than the whole payload


class DeadLetter(Strict):
    type: Literal["DeadLetter"] = "DeadLetter"
    schema_version: Literal[2] = 2
    reason: str  # at most REASON_CHARS characters (a longer one ends with "…")
    source: SourceRecord
    key: Excerpt | None  # None: the record had no key
    value: Excerpt | None  # None: the record had no value


def bounded(text: str, limit: int) -> str:
    """``text``, or its first ``limit - 1`` characters and "…" when it is longer."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def excerpt(raw: bytes | None, limit: int) -> Excerpt | None:
    """The first ``limit`` bytes of ``raw`` (``head``), with the size and SHA-256 of all of it."""
    if raw is None:
        return None
    text, encoding = head(raw, limit)
    return Excerpt(text=text, encoding=encoding, size=len(raw),
                   sha256=hashlib.sha256(raw).hexdigest(), truncated=len(raw) > limit)  # fmt: skip


def head(raw: bytes, limit: int) -> tuple[str, Literal["utf-8", "base64"]]:
    """The first ``limit`` bytes of ``raw`` as UTF-8 text (less a character the cut split) or,
    when they are not UTF-8, as base64; all of ``raw`` when it is no longer."""
    first = raw[:limit]
    for drop in range(4 if len(raw) > limit else 1):  # a UTF-8 character has at most 4 bytes
        try:
            return first[: len(first) - drop].decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            continue
    return base64.b64encode(first).decode(), "base64"


def key_text(key: bytes | None) -> str | None:
    """A refused record's key as its history entry and its dead letter name it (``head``)."""
    return None if key is None else head(key, KEY_BYTES)[0]


def record_key(key: bytes | None) -> bytes | None:
    """The dead letter's own record key: the refused record's, cut to KEY_BYTES."""
    return None if key is None else key[:KEY_BYTES]


def dead_letter(
    reason: str,
    topic: str,
    partition: int,
    offset: int,
    timestamp: datetime,
    key: bytes | None,
    value: bytes | None,
) -> DeadLetter:
    """The dead letter of the record at ``topic``/``partition``/``offset``, refused for
    ``reason``: at most MAX_BYTES encoded, whatever the record holds."""
    return DeadLetter(
        reason=bounded(reason, REASON_CHARS),
        source=SourceRecord(topic=topic, partition=partition, offset=offset, timestamp=timestamp),
        key=excerpt(key, KEY_BYTES),
        value=excerpt(value, VALUE_BYTES),
    )
