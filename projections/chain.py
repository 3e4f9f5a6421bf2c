"""The hash chain over each sandbox's history: tamper evidence for the audit trail (pure).

Every history entry carries the hash of the entry before it in its chain and the hash of its
own content chained to that: ``entry_hash = sha256(prev_hash || canonical(content))``. A chain
is one sandbox key; entries without a key (dead letters of unkeyed records, which can land on
any partition) are chained per input partition instead. A keyed chain can have two writers at
once (a record dead-lettered on a partition its key is not on joins its key's chain from that
partition's owner): the database refuses a second link to one entry (``CHAIN_LINKS``), and
the refused writer links again onto the new head. Changing, removing or reordering one entry
breaks the link at that entry or the one after it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from operator import attrgetter
from typing import Any, Final, TypeVar
from uuid import UUID

import orjson

from projections.records import replaced

ChainId = tuple[str | None, int | None]  # (key, None), or (None, partition) for unkeyed entries
GENESIS = b""  # the "previous hash" of a chain's first entry
# The unique indexes that keep every chain one line: no two entries after one entry, one first
# entry per chain (compose/migrations/0135_history_chain_links.sql).
CHAIN_LINKS: Final = frozenset(
    {"history_chain_next", "history_chain_first", "history_chain_first_unkeyed"}
)


def chain_of(key: str | None, partition: int) -> ChainId:
    return (key, None) if key is not None else (None, partition)


# A chain as the log's checkpoints name it: by its key, or, for a key longer than this (only
# a dead letter's key can be), by the key's sha256, so that a checkpoint stays small.
LABEL_MAX: Final = 255


def chain_label(chain: ChainId) -> ChainId:
    key = chain[0]
    if key is None or len(key) <= LABEL_MAX:
        return chain
    return ("sha256:" + hashlib.sha256(key.encode()).hexdigest(), None)


# The content an entry's hash covers, in the order of the history row's fields.
CONTENT_FIELDS: Final = (
    "key", "topic", "partition", "offset", "message_type", "command_id", "disposition", "reason",
    "phase", "generation", "version", "event_types", "message", "occurred_at", "sandbox_id",
)  # fmt: skip
# Those values, in that order (what ``content_of`` reads from a row).
HistoryContent = tuple[
    str | None, str, int, int, str | None, str | None, str, str, str | None, int | None,
    int | None, list[str], str | None, datetime | None, UUID | None,
]  # fmt: skip
content_of = attrgetter(*CONTENT_FIELDS)  # a row's content as one tuple (read in C)


def canonical(entry: Mapping[str, Any]) -> bytes:
    """The bytes an entry's hash covers: its recorded content as sorted, compact JSON.

    Timestamps are UTC with microseconds (PostgreSQL's precision), the input body is its exact
    text. ``recorded_at`` (the database's clock) is not covered.
    """
    return content_json(*(entry[name] for name in CONTENT_FIELDS))


def content_json(
    key: str | None, topic: str, partition: int, offset: int, message_type: str | None,
    command_id: str | None, disposition: str, reason: str, phase: str | None,
    generation: int | None, version: int | None, event_types: Sequence[str],
    message: str | None, occurred_at: datetime | None, sandbox_id: UUID | None,
) -> bytes:  # fmt: skip
    """``canonical`` of the content given in CONTENT_FIELDS order. What json.dumps(sort_keys=
    True, separators=(",", ":"), ensure_ascii=False) writes (tests/test_chain.py compares the
    two), from orjson (pydantic-core's serializer cost 25 % more). Keys in sorted order; orjson
    writes a ``uuid.UUID`` as ``str`` does, without the Python call, and asyncpg's own UUID
    type (a row read back) through ``_uuid_text``."""
    return orjson.dumps(
        {
            "command_id": command_id,
            "disposition": disposition,
            "event_types": list(event_types),
            "generation": generation,
            "key": key,
            "message": message,
            "message_type": message_type,
            "occurred_at": _utc(occurred_at) if occurred_at is not None else None,
            "offset": offset,
            "partition": partition,
            "phase": phase,
            "reason": reason,
            "sandbox_id": sandbox_id,
            "topic": topic,
            "version": version,
        },
        default=_uuid_text,
    )


def _uuid_text(value: object) -> str:
    """A UUID of a type orjson does not write itself; anything else is refused, as json.dumps
    refuses it (a silent ``str`` would hash a value no reader could check)."""
    if isinstance(value, UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_ZERO: Final = timedelta(0)


def _utc(value: datetime) -> str:
    """The time in UTC with microseconds. A time at offset zero already (what clients and
    drivers write) keeps its text: converting it would change only its tzinfo object."""
    if value.utcoffset() == _ZERO:
        return value.isoformat(timespec="microseconds")
    return value.astimezone(UTC).isoformat(timespec="microseconds")


def link(prev_hash: bytes | None, entry: Mapping[str, Any]) -> bytes:
    return hashlib.sha256((prev_hash or GENESIS) + canonical(entry)).digest()


class Chains:
    """The newest hash of each chain while entries are linked on in write order, from
    ``heads`` (the stored newest hash of each chain; absent or None: an empty chain)."""

    __slots__ = ("_current",)

    def __init__(self, heads: Mapping[ChainId, bytes | None]) -> None:
        self._current = dict(heads)

    def link(self, key: str | None, partition: int, content: bytes) -> tuple[bytes | None, bytes]:
        """(the previous hash, this entry's hash) of the next entry of its chain."""
        chain = (key, None) if key is not None else (None, partition)  # chain_of, inlined
        prev = self._current.get(chain)
        own = hashlib.sha256((prev or GENESIS) + content).digest()
        self._current[chain] = own
        return prev, own

    def linked(self, content: HistoryContent) -> tuple[bytes | None, bytes]:
        """``link`` of an entry given by its content in CONTENT_FIELDS order."""
        return self.link(content[0], content[2], content_json(*content))


R = TypeVar("R")  # a frozen dataclass with the content fields, ``prev_hash`` and ``entry_hash``


def chain_rows(rows: Sequence[R], heads: Mapping[ChainId, bytes | None]) -> list[R]:
    """``rows`` (in write order) with their links set, continuing each chain from ``heads``."""
    chains = Chains(heads)
    linked = []
    for row in rows:
        prev, own = chains.linked(content_of(row))
        linked.append(replaced(row, prev_hash=prev, entry_hash=own))
    return linked
