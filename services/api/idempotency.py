"""Idempotency keys: what the API remembers of each command it took in.

A ``command_id`` names one request: its type, sandbox, caller and body (the fingerprint: a
sha256 of the command without its id, time and caller). The first request with an id is
recorded before it is published and marked published once Kafka acknowledged it; a later one
with the same id and the same fingerprint is a retry (it gets the first outcome), one with
another fingerprint is refused, whatever happened to the sandbox in between (a re-created name
included). ``GET /v1/commands/{id}`` answers 404 for an id that is neither decided nor
published through the API.

Provider writes (services/api/providers.py) share the key: ``claim`` records one in the
write's own transaction, ``keep_outcome`` stores what it answered (a retry gets it back), and it
is never published, so the command ids and the provider write ids are one namespace.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, TypeAlias

import asyncpg

from events.commands import Command

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"
Conn: TypeAlias = Any  # a pool, a connection or a pool connection proxy


class IdempotencyConflict(Exception):
    """The command id was first used for another request."""

    def __init__(self, command_id: str, first: Recorded) -> None:
        super().__init__(
            f"command_id {command_id!r} was first used for a different request "
            f"({first.command_type} of {first.key!r}); an idempotency key names one "
            "request: use a new command_id for a new request"
        )
        self.command_id = command_id


@dataclass(frozen=True, slots=True)
class Recorded:
    key: str
    command_type: str
    actor: str
    fingerprint: str
    published: bool
    outcome: Any = None  # a provider write's answer (JSON), None for a command


def digest(body: Any) -> str:
    """The sha256 of ``body``'s canonical JSON (keys sorted, no spaces)."""
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def fingerprint(command: Command) -> str:
    """What makes two requests the same: everything but the id, the time and the caller (the
    caller is compared on its own)."""
    return digest(command.model_dump(mode="json", exclude={"command_id", "occurred_at", "actor"}))


async def recorded(conn: Conn, command_id: str) -> Recorded | None:
    row = await conn.fetchrow(
        "SELECT key, command_type, actor, fingerprint, published, outcome::text AS outcome "
        "FROM api_commands WHERE command_id = $1",
        command_id,
    )
    if row is None:
        return None
    outcome = None if row["outcome"] is None else json.loads(row["outcome"])
    return Recorded(
        row["key"], row["command_type"], row["actor"], row["fingerprint"], row["published"], outcome
    )


async def claim(
    conn: Conn, command_id: str, key: str, command_type: str, actor: str, mine: str
) -> Recorded | None:
    """Record the request with fingerprint ``mine`` under ``command_id``; the earlier record
    if the id was known (a retry), ``IdempotencyConflict`` if that record is of another request.
    In a transaction, a concurrent claim of the same id waits for it to end."""
    inserted = await conn.fetchval(
        "INSERT INTO api_commands (command_id, key, command_type, actor, fingerprint) "
        "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (command_id) DO NOTHING RETURNING true",
        command_id,
        key,
        command_type,
        actor,
        mine,
    )
    if inserted:
        return None
    first = await recorded(conn, command_id)
    assert first is not None  # records are never removed
    if first.fingerprint != mine or first.actor != actor or first.command_type != command_type:
        raise IdempotencyConflict(command_id, first)
    return first


async def record(pool: Pool, command: Command) -> Recorded | None:
    """Record ``command`` under its id (``claim``)."""
    mine = fingerprint(command)
    return await claim(pool, command.command_id, command.key, command.type, command.actor, mine)


async def keep_outcome(conn: Conn, command_id: str, outcome: Any) -> None:
    """Store what a provider write answered, for its retries (in the write's transaction)."""
    await conn.execute(
        "UPDATE api_commands SET outcome = $2::jsonb WHERE command_id = $1",
        command_id,
        json.dumps(outcome, sort_keys=True),
    )


async def mark_published(pool: Pool, command_id: str) -> None:
    await pool.execute(
        "UPDATE api_commands SET published = true WHERE command_id = $1 AND NOT published",
        command_id,
    )
