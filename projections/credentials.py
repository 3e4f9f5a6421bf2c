"""Credential updates, by fingerprint: which are baselines and which are rotations, and what a
rotation will do to each attached sandbox (the receipt). Pure: no values, no I/O, no clock.

- The first value of a key is a **baseline**: it restarts nothing.
- A value that replaces an applied one is a **rotation**, and so is removing an applied key
  (the agent must stop seeing it). Setting the same value again changes nothing.
- A rotation restarts each attached sandbox once for all the providers it rotates with, by the
  rule of ``projections.lifecycle.rotation_action``; the restart's command id is derived from
  (sandbox, rotated providers, their incarnations and revisions), so a redelivery never
  restarts twice, and a provider deleted and created again (revisions from 1 again) never
  repeats an id of the one before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal
from uuid import UUID, uuid5

from projections.lifecycle import RESTART, Sandbox, rotation_action

_ROTATION_NS: Final = UUID("3d6f0a1e-8b47-4f2a-9c15-7e2b4d8a6c44")

KeyChangeKind = Literal["baseline", "rotated", "removed", "unchanged"]


@dataclass(frozen=True, slots=True)
class ProviderChange:
    """What one update does to one provider's keys (by fingerprint)."""

    provider: str
    keys: dict[str, KeyChangeKind]

    def of(self, kind: KeyChangeKind) -> list[str]:
        return sorted(k for k, v in self.keys.items() if v == kind)

    @property
    def changed(self) -> bool:
        return any(v != "unchanged" for v in self.keys.values())

    @property
    def rotated(self) -> bool:
        """A value already applied was replaced or removed: attached agents must restart."""
        return any(v in ("rotated", "removed") for v in self.keys.values())


def classify(
    provider: str, applied: Mapping[str, str], desired: Mapping[str, str]
) -> ProviderChange:
    """Compare the applied fingerprints with the desired ones, key by key."""
    keys: dict[str, KeyChangeKind] = {}
    for key in sorted({*applied, *desired}):
        if key not in applied:
            keys[key] = "baseline"
        elif key not in desired:
            keys[key] = "removed"
        else:
            keys[key] = "unchanged" if applied[key] == desired[key] else "rotated"
    return ProviderChange(provider, keys)


def rotation_command_id(
    sandbox: str, rotations: Mapping[str, int], incarnations: Mapping[str, UUID]
) -> str:
    """The restart command's id: the same (sandbox, providers, incarnations, revisions) give
    the same id; another incarnation of a provider (deleted, then created again) another."""
    parts = ",".join(f"{p}/{incarnations[p]}@{rotations[p]}" for p in sorted(rotations))
    return "rotate-" + uuid5(_ROTATION_NS, f"{sandbox}/{parts}").hex


@dataclass(frozen=True, slots=True)
class ReceiptLine:
    """What an update will do to one attached sandbox."""

    sandbox: str
    providers: tuple[str, ...]  # the rotated providers it has attached
    action: Literal["restart", "skip"]
    reason: str  # why it restarts or why not
    command_id: str


def plan(
    rotations: Mapping[str, int],
    sandboxes: Iterable[Sandbox],
    restart: bool,
    incarnations: Mapping[str, UUID],
) -> list[ReceiptLine]:
    """One line per live sandbox attached to a rotated provider (``rotations``: provider ->
    revision; ``incarnations``: provider -> its incarnation), in name order. A sandbox attached
    to several rotated providers gets one line and one command naming all of them."""
    lines = []
    for sandbox in sorted(sandboxes, key=lambda s: s.key):
        if sandbox.tombstoned:
            continue
        mine = {p: r for p, r in rotations.items() if p in sandbox.providers}
        if not mine:
            continue
        action = rotation_action(sandbox, restart, mine)
        restarts = action == RESTART
        lines.append(
            ReceiptLine(
                sandbox=sandbox.key,
                providers=tuple(sorted(mine)),
                action="restart" if restarts else "skip",
                reason=f"{sandbox.phase.value}: restarts once" if restarts else action,
                command_id=rotation_command_id(sandbox.key, mine, incarnations),
            )
        )
    return lines
