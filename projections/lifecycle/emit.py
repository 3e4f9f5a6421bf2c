"""Building a decision's parts: a decided event with the fields every event shares (from the
row, the message and its log coordinates), a command's outcome, a rejection, an ignored input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

from pydantic import BaseModel

from events.commands import Command
from events.common import Cause
from events.decided import (
    DecidedEvent,
    SandboxDeleted,
    SandboxDeleting,
    SandboxReady,
    SandboxReleased,
    SandboxStopEscalated,
    SandboxStopped,
    SandboxStopping,
    SandboxSuspended,
    SandboxSuspending,
)
from events.outcomes import Code, CommandOutcome
from events.trusted import builder

from .identity import event_id_for
from .model import Decision, Message, Sandbox
from .rows import evolve


def emit_event(
    state: Sandbox | None, event: DecidedEvent
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    return evolve(state, event), (event,)


# The fields every decided event has, in the order ``common_fields`` gives them.
COMMON_FIELDS: Final = (
    "event_id", "key", "sandbox_id", "version", "generation", "occurred_at", "actor", "cause",
)  # fmt: skip


def common_fields(
    state: Sandbox, message: Message, cause: Cause, generation: int | None = None, index: int = 0
) -> dict:  # type: ignore[type-arg]
    """The values of COMMON_FIELDS, in that order, for an event decided on ``message``."""
    return {
        "event_id": event_id_for(cause, index),
        "key": state.key,
        "sandbox_id": state.sandbox_id,
        "version": state.version + 1,
        "generation": state.generation if generation is None else generation,
        "occurred_at": message.occurred_at,
        "actor": message.actor,
        "cause": cause,
    }


E = TypeVar("E", bound=BaseModel)


# The events decided most often, built positionally (``events.trusted.builder``): their type,
# COMMON_FIELDS, then the fields after the colon.
_EVENTS: Final[dict[type[BaseModel], Callable[..., Any]]] = {
    cls: builder(cls, "type", *COMMON_FIELDS, *extra)
    for cls, extra in (
        (SandboxReady, ()), (SandboxStopped, ()), (SandboxDeleted, ()), (SandboxReleased, ()),
        (SandboxStopEscalated, ()), (SandboxStopping, ("deadline",)),
        (SandboxDeleting, ("deadline",)), (SandboxSuspended, ()),
        (SandboxSuspending, ("deadline",)),
    )
}  # fmt: skip


def new_event(cls: type[E], common: dict[str, Any], *extra: Any) -> E:
    """``built(cls, type=<its name>, **common, <the extra fields>=extra)`` for ``_EVENTS``."""
    return _EVENTS[cls](cls.__name__, *common.values(), *extra)  # type: ignore[no-any-return]


def outcome_of(command: Command, code: Code, message: str, state: Sandbox | None) -> CommandOutcome:
    status = "accepted" if code is Code.OK else "rejected"
    if state is None:
        return _new_outcome(command.command_id, command.key, command.type, status, code, message,
                            None, None, None, None, None)  # fmt: skip
    return _new_outcome(
        command.command_id, command.key, command.type, status, code, message, state.sandbox_id,
        state.phase, state.generation, state.version, state.identity,
    )  # fmt: skip


# Every command's outcome, from its validated command and the row: ``built`` positionally.
_new_outcome = builder(
    CommandOutcome, "command_id", "key", "command_type", "status", "code", "message",
    "sandbox_id", "phase", "generation", "version", "identity",
)  # fmt: skip


def rejected(state: Sandbox | None, command: Command, code: Code, why: str) -> Decision:
    return Decision(state, (), "rejected", why, outcome_of(command, code, why, state))


def ignored(state: Sandbox | None, why: str) -> Decision:
    return Decision(state, (), "ignored", why)


def not_current_generation(state: Sandbox | None, generation: int, what: str) -> Decision | None:
    """An input about a runtime generation is news only for the live row at that generation:
    the ignore decision for an unknown or tombstoned sandbox, or another generation."""
    if state is None:
        return ignored(state, f"unknown sandbox: {what}")
    if state.tombstoned:
        return ignored(state, f"tombstoned at generation {state.generation}: {what}")
    if generation < state.generation:
        return ignored(state, f"stale: {what}, current generation is {state.generation}")
    if generation > state.generation:
        return ignored(state, f"unknown generation: {what}, newest issued is {state.generation}")
    return None


def then_decide(
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    cause: Cause,
    make: Any,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    """Decide one more event on the same input: ``make(common)`` builds it."""
    event = make(common_fields(state, message, cause, index=len(events)))
    return evolve(state, event), (*events, event)
