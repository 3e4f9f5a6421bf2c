"""Idempotency keys: what the API remembers of each command it took in.

A ``command_id`` names one request: its type, sandbox, caller and body (the fingerprint: a
sha256 of the command without its id, time and caller). The first request with an id is
recorded before it is published and marked published once Kafka acknowledged it; a later one
with the same id and the same fingerprint is a retry (it gets the first outcome), one with
another fingerprint is refused, whatever happened to the sandbox in between (a re-created name
included). ``GET /v1/commands/{id}`` answers 404 for an id that is neither decided nor
published through the API.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TypeAlias

import asyncpg

from events.commands import Command

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"


class IdempotencyConflict(Exception):
    """The command id was first used for another request."""

    def __init__(self, command_id: str, first: Recorded) -> None:
        super().__init__(
            f"command_id {command_id!r} was first used for a different request "
            f"({first.command_type} of sandbox {first.key!r}); an idempotency key names one "
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


def fingerprint(command: Command) -> str:
    """What makes two requests the same: everything but the id, the time and the caller (the
    caller is compared on its own)."""
    body = command.model_dump(mode="json", exclude={"command_id", "occurred_at", "actor"})
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


async def recorded(pool: Pool, command_id: str) -> Recorded | None:
    row = await pool.fetchrow(
        "SELECT key, command_type, actor, fingerprint, published FROM api_commands "
        "WHERE command_id = $1",
        command_id,
    )
    if row is None:
        return None
    return Recorded(
        row["key"], row["command_type"], row["actor"], row["fingerprint"], row["published"]
    )


async def record(pool: Pool, command: Command) -> Recorded | None:
    """Record ``command`` under its id; the earlier record if the id was known (a retry),
    ``IdempotencyConflict`` if that record is of another request."""
    mine = fingerprint(command)
    inserted = await pool.fetchval(
        "INSERT INTO api_commands (command_id, key, command_type, actor, fingerprint) "
        "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (command_id) DO NOTHING RETURNING true",
        command.command_id,
        command.key,
        command.type,
        command.actor,
        mine,
    )
    if inserted:
        return None
    first = await recorded(pool, command.command_id)
    assert first is not None  # records are never removed
    if first.fingerprint != mine or first.actor != command.actor:
        raise IdempotencyConflict(command.command_id, first)
    return first


async def mark_published(pool: Pool, command_id: str) -> None:
    await pool.execute(
        "UPDATE api_commands SET published = true WHERE command_id = $1 AND NOT published",
        command_id,
    )
