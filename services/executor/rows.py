"""The executor's read of a sandbox's current row: the truth it checks every intent against."""

from __future__ import annotations

from typing import TypeAlias

import asyncpg

from events.common import Phase
from projections.lifecycle import Sandbox
from projections.store import SANDBOX_COLUMNS, sandbox_from_record

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"


async def read_row(pool: Pool, key: str) -> Sandbox | None:
    """The row of ``key`` (live or its tombstone); None if the name never had one."""
    record = await pool.fetchrow(f"SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE key = $1", key)
    return sandbox_from_record(record) if record is not None else None


# The phases whose row still waits for a driver call (a launch, stop, suspend or delete).
PROGRESSING = (
    Phase.PROVISIONING, Phase.STARTING, Phase.STOPPING, Phase.SUSPENDING, Phase.DELETING,
)  # fmt: skip


async def progressing_rows(pool: Pool) -> list[Sandbox]:
    records = await pool.fetch(
        f"SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE phase = ANY($1::text[])",
        [p.value for p in PROGRESSING],
    )
    return [sandbox_from_record(r) for r in records]
