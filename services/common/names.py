"""A user's sandbox name resolved at the doors (docs/adr/0009): a name a claim bound to an
adopted pool member stands for the member's key, which everything inside (the log's key, the
executor, the drivers, the history) keeps using. Every other name is its own key.

The binding is the name's own row (``bound_to``), written by the fold of the name's key; it is
read here as of one moment, so a command for a name bound an instant later is decided on the
name's key and refused there (NOT_FOUND, naming the member), never lost or misdirected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

# The key a name stands for: its binding's member, or itself. One index probe.
KEY_OF: Final = (
    "coalesce((SELECT bound_to FROM sandboxes WHERE key = {0} AND bound_to IS NOT NULL), {0})"
)


async def resolve(conn: Any, name: str) -> str:
    """The key ``name`` stands for (``conn``: a connection or a pool)."""
    key = await conn.fetchval(f"SELECT {KEY_OF.format('$1::text')}", name)
    return str(key)


async def resolve_all(conn: Any, names: Sequence[str]) -> list[str]:
    """The keys ``names`` stand for, in order (one round trip)."""
    if not names:
        return []
    rows = await conn.fetch(
        "SELECT coalesce(s.bound_to, n.name) AS key FROM unnest($1::text[]) WITH ORDINALITY "
        "AS n(name, i) LEFT JOIN sandboxes s ON s.key = n.name AND s.bound_to IS NOT NULL "
        "ORDER BY n.i",
        list(names),
    )
    return [r["key"] for r in rows]
