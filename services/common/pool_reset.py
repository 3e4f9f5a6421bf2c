"""A pool connection's reset on release, only when it may carry session state.

asyncpg resets every connection it takes back into a pool with a round trip of four
statements (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``): in a burst of
creates that was a tenth of ``sandstream up``'s CPU, as much as all its other statements'
round trips, and a statement more on the server for each one (docs/benchmarks.md). Most
acquisitions run plain queries that leave nothing behind, and an open transaction is rolled
back by asyncpg itself before any reset. ``SessionAware`` notes what can outlive a release —
a LISTEN, a session ``SET``/``RESET``, ``set_config``, a session advisory lock, a cursor
declared, a statement prepared by name, a temporary table, ``LOAD``/``DISCARD`` — and the
pool's ``reset`` runs asyncpg's full reset query only for a connection that did any of them.
The check errs one way: a statement that merely mentions such a thing resets as before.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import asyncpg

# Statements and functions whose effect outlives the transaction they ran in. A SET LOCAL
# (and a transaction-scoped advisory lock, pg_advisory_xact_lock) ends with its transaction.
_COMMENTS = r"(?:\s|--[^\n]*\n|/\*.*?\*/)*"
_SESSION = re.compile(
    rf"(?:^|;){_COMMENTS}(?:SET\s+(?!LOCAL\b)|RESET\b|LISTEN\b|DECLARE\b|PREPARE\b|LOAD\b"
    r"|DISCARD\b|CREATE\s+(?:(?:GLOBAL|LOCAL)\s+)?TEMP)"
    r"|\bset_config\s*\(|\bpg_(?:try_)?advisory_lock(?:_shared)?\s*\(",
    re.IGNORECASE | re.DOTALL,
)


@functools.lru_cache(maxsize=4096)
def leaves_session_state(query: str) -> bool:
    """Whether ``query`` may change the session beyond its transaction (the project's
    statements are constants: each is matched once)."""
    return _SESSION.search(query) is not None


class SessionAware(asyncpg.Connection):
    """A connection that notes whether it may carry session state (``carries_session``)."""

    _session = False  # a statement that may have changed the session ran
    _listening = False  # a LISTEN may be registered

    @property
    def carries_session(self) -> bool:
        return self._session or self._listening

    def forget_session(self) -> None:
        self._session = self._listening = False

    def _note(self, query: str) -> None:
        if not self._session and leaves_session_state(query):
            self._session = True

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> str:
        self._note(query)
        return await super().execute(query, *args, **kwargs)

    async def executemany(self, command: str, args: Any, **kwargs: Any) -> None:
        self._note(command)
        await super().executemany(command, args, **kwargs)

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        self._note(query)
        return await super().fetch(query, *args, **kwargs)

    async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        self._note(query)
        return await super().fetchval(query, *args, **kwargs)

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        self._note(query)
        return await super().fetchrow(query, *args, **kwargs)

    async def fetchmany(self, query: str, args: Any, **kwargs: Any) -> Any:
        self._note(query)
        return await super().fetchmany(query, args, **kwargs)

    def cursor(self, query: str, *args: Any, **kwargs: Any) -> Any:
        self._note(query)
        return super().cursor(query, *args, **kwargs)

    async def prepare(self, query: str, **kwargs: Any) -> Any:
        self._note(query)
        return await super().prepare(query, **kwargs)

    async def add_listener(self, channel: str, callback: Any) -> None:
        self._listening = True
        noted = self._session
        try:
            await super().add_listener(channel, callback)
        finally:
            self._session = noted  # its LISTEN is what _listening stands for

    async def remove_listener(self, channel: str, callback: Any) -> None:
        await super().remove_listener(channel, callback)
        if not self._listeners:  # type: ignore[attr-defined]  # every channel UNLISTENed
            self._listening = False


async def reset_if_needed(conn: asyncpg.Connection) -> None:
    """The pool's reset: asyncpg's full reset query for a connection that may carry session
    state (asyncpg has rolled back any open transaction and dropped its listener callbacks
    already), nothing for one that cannot."""
    if not isinstance(conn, SessionAware) or conn.carries_session:
        query = conn.get_reset_query()
        if query:
            await asyncpg.Connection.execute(conn, query)
        if isinstance(conn, SessionAware):
            conn.forget_session()
