"""The restart policy's decisions: whether an exit of the current generation schedules a
restart (or exhausts them), and what ``SetRestartPolicy`` changes (the tables are in
``restarts``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from events.commands import SetIdleSuspend, SetRestartPolicy
from events.common import (
    Cause,
    SandboxSpec,
)
from events.decided import (
    AgentRestartFailed,
    DecidedEvent,
    SandboxCompleted,
    SandboxFailed,
    SandboxRestartScheduled,
    SandboxRestartsExhausted,
    SandboxStarting,
    SandboxTimedOut,
)
from events.observations import DeadlineDue
from events.trusted import built

from .deadlines import counted_deadline, launch_deadline, moment_after
from .emit import common_fields, emit_event, ignored, then_decide
from .identity import identity_for, next_generation
from .model import Decision, Limits, Message, Sandbox
from .observations import ObservationKind
from .restarts import (
    RESTART_LIMIT,
    ExitKind,
    restart_delay,
    restarts_of,
    restarts_on,
)

# Restart policy: the decisions (the table and the row changes are above, before evolve)


# The exits an observation of the current generation can be, when it ends the generation.
OBSERVED_EXIT: Final[dict[ObservationKind, ExitKind]] = {
    "exited_ok": "exited 0",
    "exited_error": "exited non-zero",
    "removed": "vanished",
    "launch_failed": "launch failed",
}


_ENDS_GENERATION: Final = (SandboxCompleted, SandboxFailed, AgentRestartFailed, SandboxTimedOut)


def setting_unchanged(spec: SandboxSpec, command: object) -> bool:
    """A SetRestartPolicy or SetIdleSuspend that would change nothing (idempotent)."""
    if isinstance(command, SetIdleSuspend):
        return command.idle_suspend_seconds == spec.idle_suspend_seconds
    if not isinstance(command, SetRestartPolicy):
        return False
    return (spec.restart_policy or "Never", spec.restart_backoff, spec.max_restarts) == (
        command.restart_policy,
        command.restart_backoff,
        command.max_restarts,
    )


def apply_restart_policy(
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    exit_kind: ExitKind | None,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    """After an exit of the current generation: schedule its restart if the policy says so,
    or give up in Error when ``max_restarts`` restarts in a row were made already."""
    ended = events[-1]
    policy = state.spec.restart_policy
    if (
        policy is None
        or exit_kind is None
        or not isinstance(ended, _ENDS_GENERATION)
        or not restarts_on(policy, exit_kind)
    ):  # held too: the restart is scheduled, and deferred until the release
        return state, events
    exit_code = getattr(ended, "exit_code", None)
    reason = getattr(ended, "reason", None) or f"runtime exited with code {exit_code}"
    record, at = restarts_of(state), message.occurred_at
    # The row after the exit event still holds since when its generation was Ready.
    reset = record.ready_since is not None and (at - record.ready_since) >= timedelta(
        seconds=limits.restart_reset_seconds
    )
    made = 0 if reset else record.attempt  # restarts in a row so far
    limit = state.spec.max_restarts
    if limit is not None and made >= limit:
        why = (
            f"{RESTART_LIMIT}: restart_policy {policy} made {made} restarts in a row "
            f"(max_restarts {limit}); last exit: {reason}"
        )
        return then_decide(
            state,
            events,
            message,
            cause,
            lambda c: built(
                SandboxRestartsExhausted,
                type="SandboxRestartsExhausted",
                **c,
                policy=policy,
                restarts=made,
                reason=why,
                exit_reason=reason,
                exit_code=exit_code,
            ),
        )
    due = counted_deadline(
        "restart", moment_after(at, restart_delay(state.spec, made + 1)), made + 1
    )
    return then_decide(
        state,
        events,
        message,
        cause,
        lambda c: built(
            SandboxRestartScheduled,
            type="SandboxRestartScheduled",
            **c,
            policy=policy,
            reason=reason,
            exit_code=exit_code,
            deadline=due,
            backoff_reset=reset and record.attempt > 0,
        ),
    )


def policy_note(events: tuple[DecidedEvent, ...]) -> str:
    """What the restart policy decided, for the history's reason."""
    last = events[-1] if events else None
    if isinstance(last, SandboxRestartScheduled):
        return (
            f"; restart_policy {last.policy} schedules restart {last.deadline.attempt} in a row "
            f"at {last.deadline.due_at.isoformat()}"
        )
    if isinstance(last, SandboxRestartsExhausted):
        return f"; {last.reason}"
    return ""


def scheduled_restart_due(
    state: Sandbox, due: DeadlineDue, cause: Cause, limits: Limits, what: str
) -> Decision:
    """The restart the policy scheduled falls due: the next generation, like any restart."""
    pending = state.deadline
    assert pending is not None and pending.kind == "restart"
    policy = state.spec.restart_policy
    if state.hold is not None:
        return ignored(state, f"held by {state.hold.by}: {what} deferred until released")
    if policy is None:  # SetRestartPolicy Never cancels it at once: defensive
        return ignored(state, f"not pending: {what}, restart_policy {policy}")
    generation = next_generation(state)
    event = built(
        SandboxStarting,
        type="SandboxStarting",
        **(common_fields(state, due, cause) | {"generation": generation}),
        reason="restart",
        previous_generation=state.generation,
        spec=state.spec,
        identity=identity_for(state.sandbox_id, generation, due.observation_id),
        deadline=launch_deadline(due.occurred_at, limits, replacing=state.spec),
        policy=policy,
        attempt=pending.attempt,
    )
    new_state, events = emit_event(state, event)
    why = (
        f"{what}: restart under restart_policy {policy} (restart {pending.attempt} in a row): "
        f"{state.phase} -> {new_state.phase}, generation {generation}"
    )
    return Decision(new_state, events, "applied", why)
