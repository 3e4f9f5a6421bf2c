"""The hash chain over each sandbox's history: tamper evidence for the audit trail (pure).

Every history entry carries the hash of the entry before it in its chain and the hash of its
own content chained to that: ``entry_hash = sha256(prev_hash || canonical(content))``. A chain
is one sandbox key; entries without a key (dead letters of unkeyed records, which can land on
any partition) are chained per input partition instead, so every chain has a single writer.
Changing, removing or reordering one entry breaks the link at that entry or the one after it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic_core import to_json

from projections.records import replaced

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


def _content_json(get: Callable[[str], Any]) -> bytes:
    """What json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False) writes
    (tests/test_chain.py compares the two), from pydantic-core's serializer: a quarter of the
    cost. The keys are written in sorted order."""
    occurred, sandbox_id = get("occurred_at"), get("sandbox_id")
    return to_json(
        {
            "command_id": get("command_id"),
            "disposition": get("disposition"),
            "event_types": list(get("event_types")),
            "generation": get("generation"),
            "key": get("key"),
            "message": get("message"),
            "message_type": get("message_type"),
            "occurred_at": _utc(occurred) if occurred is not None else None,
            "offset": get("offset"),
            "partition": get("partition"),
            "phase": get("phase"),
            "reason": get("reason"),
            "sandbox_id": str(sandbox_id) if sandbox_id is not None else None,
            "topic": get("topic"),
            "version": get("version"),
        }
    )


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
        linked.append(replaced(row, prev_hash=prev, entry_hash=own))
    return linked


CONTENT_FIELDS = (
    "key", "topic", "partition", "offset", "message_type", "command_id", "disposition", "reason",
    "phase", "generation", "version", "event_types", "message", "occurred_at", "sandbox_id",
)  # fmt: skip
