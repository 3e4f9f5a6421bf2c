"""Every version of one sandbox's row, rebuilt from its decided events: what OpenShell's
WatchSandbox sends, one snapshot per change, also for the changes a resuming client missed.

The row table keeps each sandbox's latest state only, and the history one entry per input (an
input may decide several events, and an entry records the phase, generation and version it
left, not the row). Each decided event is one version of its row (events/decided.py); the
outbox keeps them, per key in version order (a key's events are committed by its partition's
writers, one batch after the other); and the processor's own ``evolve`` applied to a version
gives the next one exactly. Both reads walk the outbox's key index (``outbox_key``) backwards
from the key's newest event and stop where they have what they need:

- ``versions_after(base, upto)``: the versions after a row the caller holds, up to ``upto``
  (reads those events, and the key's events newer than ``upto``);
- ``incarnation_versions(key, sandbox_id, upto)``: every version of one incarnation, folded
  from its creation (the one version a fold can start from without a row in hand), at most
  ``REPLAY_EVENTS`` events.

Either raises ``VersionsLost`` when the outbox no longer holds the events (housekeeping may
delete published ones, docs/operations.md) or when there are more than the bound.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final
from uuid import UUID

from events.codec import EVENTS, decode
from events.decided import DecidedEvent, SandboxCreated
from projections.lifecycle import Sandbox, evolve
from services.common.database import Pool, planned_for_now

REPLAY_EVENTS: Final = 10_000  # events one replay of an incarnation reads, at most
_FIRST_PAGE: Final = 16
_MAX_PAGE: Final = 1_000

# One page of a key's events, newest first, below an outbox id (a walk of outbox_key).
NEWEST_FIRST: Final = (
    "SELECT id, convert_from(value, 'UTF8') AS body FROM outbox "
    "WHERE key = convert_to($1, 'UTF8') AND id < $2 AND topic = $3 ORDER BY id DESC LIMIT $4"
)
_TOP: Final = 2**63 - 1


class VersionsLost(LookupError):
    """The events asked for are not all kept (or are more than a replay reads)."""


async def _newest_first(
    pool: Pool, topic: str, key: str, first_page: int = _FIRST_PAGE
) -> AsyncIterator[DecidedEvent]:
    """The key's decided events, newest first, a page at a time (each twice the last)."""
    below, size = _TOP, max(1, first_page)
    while True:
        async with planned_for_now(pool) as conn:  # the outbox may have been analysed empty
            records = await conn.fetch(NEWEST_FIRST, key, below, topic, size)
        for record in records:
            yield decode(EVENTS, record["body"])
        if len(records) < size:
            return
        below, size = records[-1]["id"], min(size * 2, _MAX_PAGE)


def _fold(base: Sandbox | None, events: list[DecidedEvent], first: int) -> list[Sandbox]:
    """The versions ``events`` (oldest first) make of ``base``; VersionsLost unless they are
    exactly the versions ``first``, ``first + 1``, ..."""
    if [e.version for e in events] != list(range(first, first + len(events))):
        raise VersionsLost(f"the outbox no longer holds every event from version {first} on")
    versions, row = [], base
    for event in events:
        row = evolve(row, event)
        versions.append(row)
    return versions


async def versions_after(pool: Pool, topic: str, base: Sandbox, upto: int) -> list[Sandbox]:
    """The versions of ``base``'s row after it, up to ``upto``, oldest first."""
    if upto <= base.version:
        return []
    wanted: list[DecidedEvent] = []
    async for event in _newest_first(pool, topic, base.key, upto - base.version + 1):
        if event.version <= base.version:
            break
        if event.version <= upto:
            wanted.append(event)
    wanted.reverse()
    found = _fold(base, wanted, base.version + 1)
    if len(found) != upto - base.version:
        raise VersionsLost(f"the outbox no longer holds every event up to version {upto}")
    return found


async def incarnation_versions(
    pool: Pool, topic: str, key: str, sandbox_id: UUID, upto: int, limit: int = REPLAY_EVENTS
) -> list[Sandbox]:
    """Every version of the incarnation ``sandbox_id`` of ``key`` up to ``upto``, oldest first,
    folded from its creation."""
    wanted: list[DecidedEvent] = []
    async for event in _newest_first(pool, topic, key):
        if event.version > upto:
            continue
        if event.sandbox_id != sandbox_id:
            break  # an earlier incarnation's: this one's creation is not kept
        if len(wanted) == limit:
            raise VersionsLost(f"the incarnation has more than {limit} changes to replay")
        wanted.append(event)
        if isinstance(event, SandboxCreated):
            wanted.reverse()
            found = _fold(None, wanted, event.version)
            if found[-1].version != upto:
                raise VersionsLost(f"the outbox no longer holds the event of version {upto}")
            return found
    raise VersionsLost("the outbox no longer holds the incarnation's creation")
