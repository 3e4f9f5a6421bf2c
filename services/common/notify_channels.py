"""LISTEN on one of sandstream's NOTIFY channels under the name the connection's schema gives
it (``notify_channel`` in the migrations): NOTIFY channels are per database, and each
sandstream sharing one under a schema of its own has channels of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


async def listen(conn: Any, base: str, callback: Callable[..., None]) -> str:
    """LISTEN on channel ``base`` (``events.topics``) of ``conn``'s schema; the name listened
    on, for ``remove_listener``."""
    channel = str(await conn.fetchval("SELECT notify_channel($1)", base))
    await conn.add_listener(channel, callback)
    return channel
