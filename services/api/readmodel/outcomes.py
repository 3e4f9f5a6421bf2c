"""Command outcomes: the processor's decision about a command id, read once or awaited
(woken by the processor's per-batch NOTIFY)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from events.outcomes import CommandOutcome
from events.topics import CHANGES_CHANNEL
from services.common.database import Pool
from services.common.names import resolve
from services.common.notify_channels import listen


async def fetch_outcome(
    conn: Any, command_id: str, key: str | None = None
) -> CommandOutcome | None:
    """The outcome of a command; ``key`` narrows it when a client reused the id across sandboxes."""
    raw = await conn.fetchval(
        "SELECT outcome FROM command_outcomes WHERE command_id = $1 "
        "AND ($2::text IS NULL OR key = $2) ORDER BY decided_at LIMIT 1",
        command_id,
        key,
    )
    return CommandOutcome.model_validate_json(raw) if raw is not None else None


async def get_outcome(
    pool: Pool, command_id: str, name: str | None = None
) -> CommandOutcome | None:
    """The outcome of a command about ``name`` (a bound name: decided on its member's key)."""
    async with pool.acquire() as conn:
        key = await resolve(conn, name) if name is not None else None
        return await fetch_outcome(conn, command_id, key)


async def await_outcome(
    pool: Pool,
    command_id: str,
    timeout: float = 10.0,
    key: str | None = None,
) -> CommandOutcome | None:
    """Wait until the processor has decided the command; None if the timeout passes first.

    Woken by the processor's per-batch NOTIFY, with a slow poll as a safety net.
    """
    woken = asyncio.Event()

    def _wake(*_: object) -> None:
        woken.set()

    async with pool.acquire() as conn:
        channel = await listen(conn, CHANGES_CHANNEL, _wake)
        try:
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                woken.clear()
                outcome = await fetch_outcome(conn, command_id, key)
                remaining = deadline - asyncio.get_running_loop().time()
                if outcome is not None or remaining <= 0:
                    return outcome
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), timeout=min(remaining, 0.5))
        finally:
            await conn.remove_listener(channel, _wake)
