"""What one pool needs now (pure): how many members to create and which to delete, from its
size, update strategy, the template's current revision, its unclaimed members and the creates
asked for but not folded yet.

The rules (docs/pools.md, "Warm pools"):

- A member is *live* while Provisioning, Starting or Ready; Deleting ones are on their way out
  and count for nothing; any other phase (Error, Stopping, Stopped, Completed, Suspending,
  Suspended) is a member out of service: deleted, and replaced like a missing one. Only an
  exit (Error, Completed) is a *failure*, which pauses the pool's creates (the controller);
  a stop or suspend is someone's decision.
- A *held* member (an operator's hold) is set aside: no claim takes it, so it serves nothing
  and is replaced, and nothing deletes it while held; once released it counts again (as an
  extra, if the pool is full by then).
- A member is *current* when it came from the template's current revision, else *old*.
- ``Recreate``: create until ``size`` current members are live or asked for; delete an old
  member that is not Ready at once, and an old Ready one only while the Ready members left
  are at least ``size`` (the replacement is Ready before the old member goes: never below what
  the pool serves).
- ``OnReplenish``: old members stay until claimed; creates (always current) only fill the
  pool up to ``size``.
- Too many (a pool scaled down, or deleted: size 0): delete extras, those not Ready first,
  old before current, Ready ones last.
- Claimed members are never seen here: they have left the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from services.common.pools import Member, Strategy

LIVE: Final = frozenset({"Provisioning", "Starting", "Ready"})
LEAVING: Final = frozenset({"Deleting"})
# The phases of a member whose runtime exited: what the failure pause counts.
FAILED: Final = frozenset({"Error", "Completed"})


@dataclass(frozen=True, slots=True)
class Plan:
    creates: int
    deletes: tuple[Member, ...]  # each deleted at the version it was read at


def plan(
    size: int,
    strategy: Strategy,
    template: str,
    revision: int | None,
    members: Sequence[Member],
    pending: int,
) -> Plan:
    """``template``, ``revision``: the template the pool names and its current revision
    (None: the template is gone, create nothing); ``pending``: creates asked for and not folded
    yet (they count as members on their way)."""
    members = [m for m in members if not m.held]
    failed = [m for m in members if m.phase not in LIVE | LEAVING]
    live = [m for m in members if m.phase in LIVE]
    current = [m for m in live if revision is not None and _of(m, template, revision)]
    old = [m for m in live if m not in current]
    deletes: list[Member] = list(failed)
    if strategy == "Recreate" and revision is not None:
        old_waiting = [m for m in old if m.phase != "Ready"]
        old_ready = [m for m in old if m.phase == "Ready"]
        deletes += old_waiting
        ready = sum(m.phase == "Ready" for m in live)
        rolled = old_ready[: max(0, ready - size)]
        deletes += rolled
        creates = max(0, size - len(current) - pending)
        deletes += _extras(current, len(current) + pending - size, ready - len(rolled) - size)
    else:
        total = len(live) + pending
        creates = max(0, size - total) if revision is not None else 0
        ready = sum(m.phase == "Ready" for m in live)
        deletes += _extras(old + current, total - size, ready - size)
    return Plan(creates, tuple(_unique(deletes)))


def _of(member: Member, template: str, revision: int) -> bool:
    return member.template == template and member.template_revision == revision


def _extras(candidates: Sequence[Member], excess: int, spare_ready: int) -> list[Member]:
    """``excess`` of ``candidates`` to delete: those not Ready first, then in the given order,
    and no more Ready ones than ``spare_ready`` (the rest wait for a pending create to fold:
    the next round deletes that one, not Ready yet, instead)."""
    waiting = [m for m in candidates if m.phase != "Ready"]
    ready = [m for m in candidates if m.phase == "Ready"]
    return (waiting + ready[: max(0, spare_ready)])[: max(0, excess)]


def _unique(members: Iterable[Member]) -> list[Member]:
    return list({m.key: m for m in members}.values())
