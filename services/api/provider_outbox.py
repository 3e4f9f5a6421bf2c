"""The provider service's outbox (table ``provider_outbox``): the commands a provider change
owes its sandboxes, stored in the transaction of the change, deleted once Kafka acknowledged
them. The model is the processor's outbox (docs/adr/0002); docs/adr/0005 says who relays it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import asyncpg

from events.codec import COMMANDS, decode, encode
from events.commands import Command

Conn: TypeAlias = Any  # an asyncpg connection or pool connection proxy
Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"


async def store(conn: Conn, commands: Sequence[Command]) -> None:
    """Add ``commands`` (in the caller's transaction); an id already stored is kept as is."""
    await conn.executemany(
        "INSERT INTO provider_outbox (command_id, key, command) VALUES ($1, $2, $3) "
        "ON CONFLICT (command_id) DO NOTHING",
        [(c.command_id, c.key, encode(c).decode()) for c in commands],
    )


async def due(pool: Pool, older_than: float, limit: int = 500) -> list[Command]:
    """The stored commands at least ``older_than`` seconds old, oldest first (a request
    publishes its own commands first; the relay takes what it left)."""
    rows = await pool.fetch(
        "SELECT command FROM provider_outbox "
        "WHERE stored_at <= now() - make_interval(secs => $1) "
        "ORDER BY stored_at, command_id LIMIT $2",
        older_than,
        limit,
    )
    return [decode(COMMANDS, r["command"].encode()) for r in rows]


async def delivered(pool: Pool, command_ids: Iterable[str]) -> None:
    await pool.execute(
        "DELETE FROM provider_outbox WHERE command_id = ANY($1::text[])", list(command_ids)
    )


async def failed(pool: Pool, command_ids: Iterable[str], error: str) -> None:
    await pool.execute(
        "UPDATE provider_outbox SET attempts = attempts + 1, last_error = $2 "
        "WHERE command_id = ANY($1::text[])",
        list(command_ids),
        error,
    )


async def stored(conn: Conn, command_ids: Sequence[str]) -> list[str]:
    """Which of ``command_ids`` are still stored (not acknowledged by Kafka yet), in order."""
    rows = await conn.fetch(
        "SELECT command_id FROM provider_outbox WHERE command_id = ANY($1::text[])",
        list(command_ids),
    )
    found = {r["command_id"] for r in rows}
    return [i for i in command_ids if i in found]


async def pending(pool: Pool) -> int:
    """How many commands wait for Kafka's acknowledgement."""
    return int(await pool.fetchval("SELECT count(*) FROM provider_outbox"))
