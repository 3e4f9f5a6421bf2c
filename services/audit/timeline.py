"""A sandbox's life re-decided from its recorded inputs: its state as of a moment (``at``)
and the causal chain of its current incarnation (``explain``).

The inputs are the history's verbatim copies of the log records (hash-chained, and proven
equal to the log by ``audit verify``), so both answers hold even where retention has deleted
the oldest log records. Each input is decided again with today's rules; where that does not
give what was recorded, the step says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from events.codec import COMMANDS, OBSERVATIONS, decode
from events.commands import CommandBase
from events.common import Cause
from events.decided import DecidedEvent
from projections.fold import Rules, fold
from projections.lifecycle import DEFAULT_LIMITS, Limits, Sandbox, decide
from services.audit.entries import Entry
from services.processor.intake import as_of

# The decided events that carry an intent, and the driver operation the executor runs for it.
INTENTS = {
    "SandboxCreated": "launch",
    "SandboxStarting": "launch",
    "SandboxStopping": "stop",
    "SandboxDeleting": "delete",
}


@dataclass(frozen=True, slots=True)
class Step:
    entry: Entry
    state: Sandbox | None  # the row after this input, decided again
    events: tuple[DecidedEvent, ...]
    disposition: str
    reason: str

    @property
    def agrees(self) -> bool:
        """Whether deciding it again gives what was recorded."""
        e, s = self.entry, self.state
        if e.message is None:  # dead-lettered: nothing was decided
            return True
        return (
            e.disposition == self.disposition
            and e.reason == self.reason
            and e.event_types == [ev.type for ev in self.events]
            and (e.phase, e.generation, e.version)
            == ((s.phase.value, s.generation, s.version) if s else (None, None, None))
        )


def replay(
    entries: Sequence[Entry],
    commands_topic: str,
    rules: Rules = decide,
    limits: Limits = DEFAULT_LIMITS,
) -> list[Step]:
    """Decide one sandbox's recorded inputs again, in their recorded order, from nothing."""
    states: dict[str, Sandbox | None] = {}
    outcomes: dict[Any, Any] = {}
    steps = []
    for entry in entries:
        state = states.get(entry.key) if entry.key is not None else None
        if entry.message is None or entry.key is None:  # dead-lettered: decided nothing
            steps.append(Step(entry, state, (), entry.disposition, entry.reason))
            continue
        adapter: Any = COMMANDS if entry.topic == commands_topic else OBSERVATIONS
        # The history keeps the body verbatim and the time it was decided as of.
        message = as_of(decode(adapter, entry.message.encode()), entry.occurred_at)
        cause = Cause(
            topic=entry.topic,
            partition=entry.partition,
            offset=entry.offset,
            message_type=message.type,
            command_id=message.command_id if isinstance(message, CommandBase) else None,
        )
        result = fold(states, outcomes, [(cause, message)], rules, limits)
        states, outcomes = result.states, {**outcomes, **result.outcomes}
        d = result.steps[0].decision
        steps.append(Step(entry, d.state, d.events, d.disposition, d.reason))
    return steps


class NotRecorded(LookupError):
    """The moment asked for is before the sandbox's first input, or no such input exists."""


def at(
    steps: Sequence[Step], *, time: datetime | None = None, position: tuple[str, int] | None = None
) -> list[Step]:
    """The inputs that produced the state as of ``time`` (the last input that occurred at or
    before it, in decision order) or as of the input at ``position`` (topic, offset)."""
    if position is not None:
        for i, step in enumerate(steps):
            if (step.entry.topic, step.entry.offset) == position:
                return list(steps[: i + 1])
        raise NotRecorded(f"no input of this sandbox at {position[0]}@{position[1]}")
    assert time is not None
    last = max(
        (i for i, s in enumerate(steps) if s.entry.occurred_at and s.entry.occurred_at <= time),
        default=None,
    )
    if last is None:
        raise NotRecorded(f"no input of this sandbox occurred at or before {time.isoformat()}")
    return list(steps[: last + 1])


@dataclass(slots=True)
class DriverCall:
    """An intent the executor acted on, and the results it reported back (as observations)."""

    operation: str
    generation: int
    intent: Step
    results: list[Step] = field(default_factory=list)


@dataclass(slots=True)
class Explanation:
    key: str
    steps: list[Step]  # the current incarnation's inputs, from its creation on
    calls: dict[int, list[DriverCall]]  # by the index in ``steps`` of the input that decided it

    @property
    def state(self) -> Sandbox | None:
        return self.steps[-1].state if self.steps else None


def explain(key: str, steps: Sequence[Step]) -> Explanation:
    """The current incarnation's causal chain: inputs, decisions and the driver calls made."""
    starts = [i for i, s in enumerate(steps) if any(e.type == "SandboxCreated" for e in s.events)]
    mine = list(steps[starts[-1] :] if starts else steps)
    calls: dict[int, list[DriverCall]] = {}
    open_calls: list[DriverCall] = []
    for i, step in enumerate(mine):
        for event in step.events:
            if event.type in INTENTS:
                call = DriverCall(INTENTS[event.type], event.generation, step)
                calls.setdefault(i, []).append(call)
                open_calls.append(call)
        if step.entry.message_type == "DriverOperationResult":
            body = step.entry.body
            for call in reversed(open_calls):
                if (call.operation, call.generation) == (
                    body.get("operation"),
                    body.get("generation"),
                ):
                    call.results.append(step)
                    break
    return Explanation(key, mine, calls)


def describe_input(entry: Entry) -> str:
    """One line: what the input was and who sent it."""
    body = entry.body
    if entry.message is None:
        return f"dead letter ({entry.reason})"
    kind = "command" if "command_id" in body else "observation"
    what = entry.message_type or "?"
    details = []
    if kind == "command":
        details.append(f"by {body.get('actor')}, command id {body.get('command_id')}")
        if body.get("expected_version") is not None:
            details.append(f"expected version {body['expected_version']}")
    else:
        if what == "DriverOperationResult":
            what = f"{what}({body.get('operation')} {body.get('outcome')})"
        elif what == "RuntimeSnapshot":
            state = body.get("state")
            code = body.get("exit_code")
            what = f"{what}({state}{'' if code is None else f' {code}'})"
        source = body.get("source")
        details.append(
            f"from {body.get('actor')}"
            + (f" ({source})" if source else "")
            + f", generation {body.get('generation')}"
        )
    return f"{kind} {what} " + "; ".join(details)


def describe_decision(step: Step) -> str:
    s = step.state
    row = f"{s.phase.value} g{s.generation} v{s.version}" if s else "no row"
    events = ", ".join(e.type for e in step.events) or "no events"
    mark = "" if step.agrees else "  [re-decided differently from the record]"
    return f"{step.disposition}: {row} [{events}] - {step.reason}{mark}"
