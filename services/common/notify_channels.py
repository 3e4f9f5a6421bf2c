"""LISTEN on one of sandstream's NOTIFY channels under the name the connection's schema gives
it (``notify_channel`` in the migrations): NOTIFY channels are per database, and each
sandstream sharing one under a schema of its own has channels of its own. ``Listening`` keeps
a LISTEN up across lost connections."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from events.backoff import Backoff, pause
from projections.store import DATABASE_ERRORS

log = logging.getLogger("sandstream.notify")


async def listen(conn: Any, base: str, callback: Callable[..., None]) -> str:
    """LISTEN on channel ``base`` (``events.topics``) of ``conn``'s schema; the name listened
    on, for ``remove_listener``."""
    channel = str(await conn.fetchval("SELECT notify_channel($1)", base))
    await conn.add_listener(channel, callback)
    return channel


class Listening:
    """LISTEN on ``base`` on a connection of ``pool`` of its own, and again on a new one
    whenever that connection is lost (a database restart, a killed backend): what was notified
    meanwhile is missed, so ``callback`` is called then too and whoever it wakes looks now.
    Until the LISTEN is back, the roles run on their polls."""

    def __init__(self, pool: Any, base: str, callback: Callable[..., None], what: str) -> None:
        self.pool, self.base, self.callback, self.what = pool, base, callback, what
        self._closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.what} LISTEN")

    async def close(self) -> None:
        self._closed.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        backoff = Backoff(0.5, 10.0, log, f"{self.what} LISTEN (polling meanwhile)")
        while not self._closed.is_set():
            try:
                await self._listen_until_lost()
                delay = backoff.next()
            except DATABASE_ERRORS as exc:
                delay = backoff.failed(exc)
            self.callback()
            await pause(self._closed, delay)

    async def _listen_until_lost(self) -> None:
        lost = asyncio.Event()
        async with self.pool.acquire() as conn:
            conn.add_termination_listener(lambda *_: lost.set())
            channel = await listen(conn, self.base, self.callback)
            try:
                while not self._closed.is_set() and not lost.is_set() and not conn.is_closed():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(lost.wait(), timeout=5.0)
            finally:
                # A lost connection's proxy is detached (asyncpg releases it on close): asking
                # it anything raised, and a plain loss was logged as a failure.
                if not lost.is_set() and not conn.is_closed():
                    await conn.remove_listener(channel, self.callback)
