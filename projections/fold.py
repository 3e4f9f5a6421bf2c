"""Fold a batch of input records through ``decide``: pure, so the processor and tests share it.

Command ids are idempotency keys, per sandbox: a command whose (key, command id) already has an
outcome is not decided again; it is recorded as a duplicate and its first outcome stands.
(Scoping them by key keeps the decision inside the key's partition, so it is deterministic.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from events.commands import CommandBase
from events.common import Cause
from events.outcomes import CommandOutcome
from projections.lifecycle import DEFAULT_LIMITS, Decision, Limits, Message, Sandbox, decide
from projections.records import maker

OutcomeKey = tuple[str, str]  # (sandbox key, command id)
# The rules: today's ``decide``, or another release's for "would these rules rewrite history?"
Rules = Callable[[Sandbox | None, Message, Cause, Limits], Decision]


@dataclass(frozen=True, slots=True)
class Step:
    cause: Cause
    message: Message
    decision: Decision


_new_step = maker(Step)  # one per input: Step(...) through its slots


@dataclass(slots=True)
class BatchResult:
    states: dict[str, Sandbox | None] = field(default_factory=dict)
    outcomes: dict[OutcomeKey, CommandOutcome] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)

    @property
    def changed_keys(self) -> set[str]:
        return {s.message.key for s in self.steps if s.decision.events}


def fold(
    states: Mapping[str, Sandbox | None],
    outcomes: Mapping[OutcomeKey, CommandOutcome],
    inputs: Iterable[tuple[Cause, Message]],
    rules: Rules = decide,
    limits: Limits = DEFAULT_LIMITS,
) -> BatchResult:
    """Decide every input in order, starting from the given rows and known outcomes."""
    result = BatchResult(states=dict(states))
    for cause, message in inputs:
        state = result.states.get(message.key)
        command_id = message.command_id if isinstance(message, CommandBase) else None
        first = None
        if command_id is not None:
            ident = (message.key, command_id)
            first = result.outcomes.get(ident) or outcomes.get(ident)
        if first is not None:
            # Code is a StrEnum: it formats as its value.
            why = f"duplicate command id {command_id!r}: first outcome {first.code} stands"
            decision = Decision(state, (), "duplicate", why, first)
        else:
            decision = rules(state, message, cause, limits)
            if decision.outcome is not None:
                outcome = decision.outcome
                result.outcomes[(outcome.key, outcome.command_id)] = outcome
        result.states[message.key] = decision.state
        result.steps.append(_new_step(cause, message, decision))
    return result
