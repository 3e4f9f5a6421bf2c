"""The executor's read of a sandbox's current row: the truth it checks every intent against."""

from __future__ import annotations

import asyncio
from typing import Final, TypeAlias

import asyncpg

from events.common import Phase
from projections.lifecycle import Sandbox
from projections.store import SANDBOX_COLUMNS, sandbox_from_record
from services.common.shared_errors import own_copy

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"


async def read_row(pool: Pool, key: str) -> Sandbox | None:
    """The row of ``key`` (live or its tombstone); None if the name never had one."""
    record = await pool.fetchrow(f"SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE key = $1", key)
    return sandbox_from_record(record) if record is not None else None


_ROWS_OF_KEYS: Final = f"SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE key = ANY($1::text[])"


class RowReader:
    """``read_row`` for many callers at once: the reads asked for while none is being sent go
    in one statement, so a burst of intents costs a round trip per wave instead of one each.
    A read asked for while a statement is in flight waits for the next one: every row is read
    after it was asked for, so an intent is never checked against a row older than itself."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._asked: dict[str, list[asyncio.Future[Sandbox | None]]] = {}
        self._sending: asyncio.Task[None] | None = None

    async def read(self, key: str) -> Sandbox | None:
        """The row of ``key`` as ``read_row`` reads it; its errors (PostgreSQL's) as well."""
        answer: asyncio.Future[Sandbox | None] = asyncio.get_running_loop().create_future()
        self._asked.setdefault(key, []).append(answer)
        if self._sending is None:
            self._sending = asyncio.create_task(self._send(), name="executor-row-reads")
        return await answer

    async def _send(self) -> None:
        try:
            await asyncio.sleep(0)  # the reads asked for at this moment go together
            while self._asked:
                asked, self._asked = self._asked, {}
                try:
                    records = await self.pool.fetch(_ROWS_OF_KEYS, list(asked))
                    rows = {r["key"]: sandbox_from_record(r) for r in records}
                except BaseException as exc:  # each caller gets it, as read_row would raise
                    _fail(asked, exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for key, answers in asked.items():
                    for answer in answers:
                        if not answer.done():  # its caller may have gone
                            answer.set_result(rows.get(key))
        finally:
            self._sending = None
            _fail(self._asked, asyncio.CancelledError())  # asked while it was cancelled
            self._asked = {}


def _fail(asked: dict[str, list[asyncio.Future[Sandbox | None]]], exc: BaseException) -> None:
    for answers in asked.values():
        for answer in answers:
            if answer.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                answer.cancel()
            else:
                answer.set_exception(own_copy(exc))


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
