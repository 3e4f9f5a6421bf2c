"""The hash chain over each sandbox's history: tamper evidence for the audit trail (pure).

Every history entry carries the hash of the entry before it in its chain and the hash of its
own content chained to that: ``entry_hash = sha256(prev_hash || canonical(content))``. A chain
is one sandbox key; entries without a key (dead letters of unkeyed records, which can land on
any partition) are chained per input partition instead, so every chain has a single writer.
Changing, removing or reordering one entry breaks the link at that entry or the one after it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

ChainId = tuple[str | None, int | None]  # (key, None), or (None, partition) for unkeyed entries
GENESIS = b""  # the "previous hash" of a chain's first entry


def chain_of(key: str | None, partition: int) -> ChainId:
    return (key, None) if key is not None else (None, partition)


def canonical(entry: Mapping[str, Any]) -> bytes:
    """The bytes an entry's hash covers: its recorded content as sorted, compact JSON.

    Timestamps are UTC with microseconds (PostgreSQL's precision), the input body is its exact
    text. ``recorded_at`` (the database's clock) is not covered.
    """
    return _content_json(entry.__getitem__)


# json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False), built once: dumps
# builds a new encoder on every call that passes options.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content_json(get: Callable[[str], Any]) -> bytes:
    occurred, sandbox_id = get("occurred_at"), get("sandbox_id")
    body = {
        "key": get("key"),
        "topic": get("topic"),
        "partition": get("partition"),
        "offset": get("offset"),
        "message_type": get("message_type"),
        "command_id": get("command_id"),
        "disposition": get("disposition"),
        "reason": get("reason"),
        "phase": get("phase"),
        "generation": get("generation"),
        "version": get("version"),
        "event_types": list(get("event_types")),
        "message": get("message"),
        "occurred_at": _utc(occurred) if occurred is not None else None,
        "sandbox_id": str(sandbox_id) if sandbox_id is not None else None,
    }
    return _ENCODER.encode(body).encode()


def _utc(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds")


def link(prev_hash: bytes | None, entry: Mapping[str, Any]) -> bytes:
    return hashlib.sha256((prev_hash or GENESIS) + canonical(entry)).digest()


R = TypeVar("R")  # a frozen dataclass with the content fields, ``prev_hash`` and ``entry_hash``


def chain_rows(rows: Sequence[R], heads: Mapping[ChainId, bytes | None]) -> list[R]:
    """``rows`` (in write order) with their links set, continuing each chain from ``heads``."""
    current = dict(heads)
    linked = []
    for row in rows:
        key, partition = getattr(row, "key"), getattr(row, "partition")  # noqa: B009
        chain = (key, None) if key is not None else (None, partition)  # chain_of, inlined
        prev = current.get(chain)
        own = hashlib.sha256((prev or GENESIS) + _content_json(row.__getattribute__)).digest()
        current[chain] = own
        linked.append(replace(row, prev_hash=prev, entry_hash=own))  # type: ignore[type-var]
    return linked


CONTENT_FIELDS = (
    "key", "topic", "partition", "offset", "message_type", "command_id", "disposition", "reason",
    "phase", "generation", "version", "event_types", "message", "occurred_at", "sandbox_id",
)  # fmt: skip
