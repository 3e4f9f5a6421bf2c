"""The recorded history, read in decision order: one entry per input record."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

import asyncpg

if TYPE_CHECKING:
    from projections.store import Connection


ENTRY_COLUMNS = (
    'id, key, topic, partition, "offset", message_type, command_id, disposition, reason, phase, '
    "generation, version, event_types, message, occurred_at, recorded_at, sandbox_id, prev_hash, "
    "entry_hash"
)


@dataclass(frozen=True, slots=True)
class Entry:
    id: int
    key: str | None
    topic: str
    partition: int
    offset: int
    message_type: str | None
    command_id: str | None
    disposition: str
    reason: str
    phase: str | None
    generation: int | None
    version: int | None
    event_types: list[str]
    message: str | None  # the input body, verbatim (None when dead-lettered)
    occurred_at: datetime | None
    recorded_at: datetime
    sandbox_id: UUID | None
    prev_hash: bytes | None
    entry_hash: bytes | None

    @property
    def body(self) -> dict[str, Any]:
        """The input body as JSON (empty when it was dead-lettered)."""
        parsed = json.loads(self.message) if self.message is not None else {}
        return parsed if isinstance(parsed, dict) else {}

    @property
    def actor(self) -> str | None:
        actor = self.body.get("actor")
        return actor if isinstance(actor, str) else None

    def content(self) -> dict[str, Any]:
        """The fields the hash chain covers (projections/chain.py)."""
        return {
            "key": self.key, "topic": self.topic, "partition": self.partition,
            "offset": self.offset, "message_type": self.message_type,
            "command_id": self.command_id, "disposition": self.disposition,
            "reason": self.reason, "phase": self.phase, "generation": self.generation,
            "version": self.version, "event_types": self.event_types, "message": self.message,
            "occurred_at": self.occurred_at, "sandbox_id": self.sandbox_id,
        }  # fmt: skip


def entry_from_record(r: asyncpg.Record) -> Entry:
    fields: dict[str, Any] = dict(r.items())
    fields["event_types"] = list(fields["event_types"])
    return Entry(**fields)


@dataclass(frozen=True, slots=True)
class Filter:
    """Which entries: one sandbox, an occurred-at window, some input types."""

    key: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    types: Sequence[str] = ()
    partition: int | None = None

    def where(self) -> tuple[str, list[Any]]:
        clauses, args = [], []
        for clause, value in (
            ("key = ${}", self.key),
            ("occurred_at >= ${}", self.since),
            ("occurred_at < ${}", self.until),
            ("message_type = ANY(${}::text[])", list(self.types) or None),
            ("partition = ${}", self.partition),
        ):
            if value is not None:
                args.append(value)
                clauses.append(clause.format(len(args)))
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


async def count(conn: Connection, which: Filter) -> int:
    where, args = which.where()
    return int(await conn.fetchval(f"SELECT count(*) FROM history{where}", *args))


async def stream(conn: Connection, which: Filter, chunk: int = 1000) -> AsyncIterator[list[Entry]]:
    """Entries in decision order, ``chunk`` at a time, by keyset pages on the history id: the
    memory held is one chunk whatever the table's size, and no transaction stays open."""
    where, args = which.where()
    glue = " AND " if where else " WHERE "
    after = 0
    while True:
        rows = await conn.fetch(
            f"SELECT {ENTRY_COLUMNS} FROM history{where}{glue}id > ${len(args) + 1} "
            f"ORDER BY id LIMIT ${len(args) + 2}",
            *args,
            after,
            chunk,
        )
        if not rows:
            return
        yield [entry_from_record(r) for r in rows]
        after = rows[-1]["id"]


async def of_sandbox(conn: Connection, key: str) -> list[Entry]:
    rows = await conn.fetch(f"SELECT {ENTRY_COLUMNS} FROM history WHERE key = $1 ORDER BY id", key)
    return [entry_from_record(r) for r in rows]
