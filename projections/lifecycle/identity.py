"""Deterministic identities: a sandbox's id, a generation's runtime identity and every decided
event's id come from the message's log coordinates (uuid5), never from randomness.
"""

from __future__ import annotations

from uuid import UUID

from events.common import (
    INT32_MAX,
    Cause,
)
from projections.uuids import uuid5

from .model import EVENT_NS, IDENTITY_NS, SANDBOX_NS, Sandbox

# Deterministic identities


def next_generation(state: Sandbox) -> int:
    """The generation after the row's. The events are built without validation
    (``events.trusted``), so the column's bound that validation enforced is checked here."""
    if state.generation >= INT32_MAX:
        raise ValueError(f"sandbox {state.key!r}: generation {state.generation} is the last")
    return state.generation + 1


def sandbox_id_for(key: str, generation: int, command_id: str) -> UUID:
    """A new incarnation's id: distinct from every earlier incarnation's by its generation."""
    return uuid5(SANDBOX_NS, f"{key}/{generation}/{command_id}")


def identity_for(sandbox_id: UUID, generation: int, command_id: str) -> str:
    """The runtime identity of a generation; drivers bind credentials to exactly this value."""
    return "rid-" + uuid5(IDENTITY_NS, f"{sandbox_id}/{generation}/{command_id}").hex


def event_id_for(cause: Cause, index: int = 0) -> UUID:
    """The id of the ``index``-th event decided on the input at ``cause``."""
    suffix = f"/{index}" if index else ""
    return uuid5(EVENT_NS, f"{cause.topic}/{cause.partition}/{cause.offset}{suffix}")
