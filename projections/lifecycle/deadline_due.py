"""What a ``DeadlineDue`` naming exactly the row's deadline does (``DEADLINE_TABLE``): a
launch timed out, a stop escalated, a delete retried, an expiry, a scheduled restart; and the
completion policy once the main process's end is recorded.
"""

from __future__ import annotations

from typing import Final

from events.common import (
    Cause,
    DeadlineKind,
)
from events.decided import (
    DecidedEvent,
    SandboxDeleteRetried,
    SandboxDeleting,
    SandboxExpired,
    SandboxOperationFailed,
    SandboxStopEscalated,
    SandboxStopping,
    SandboxStopRetried,
    SandboxTimedOut,
)
from events.observations import DeadlineDue
from events.trusted import built

from .commands import Admission, admission
from .deadlines import (
    EXIT_EVENTS,
    PROVISIONING_TIMEOUT,
    delete_deadline,
    retry_deadline,
    stop_deadline,
)
from .emit import (
    common_fields,
    emit_event,
    ignored,
    new_event,
    not_current_generation,
    then_decide,
)
from .idle import decide_idle
from .model import (
    Decision,
    Limits,
    Message,
    P,
    Sandbox,
    awaits_stop_retry,
    expired,
    is_held,
    suspended_reason,
)
from .restart_policy import (
    apply_restart_policy,
    policy_note,
    scheduled_restart_due,
)

# Deadlines, time to live, completion policy (operator lifecycle)


# What a DeadlineDue naming exactly the row's deadline does (anything else is ignored: stale
# generation, a deadline the row no longer holds, a repeat). The ttl deadline is the row's
# expires_at, in any live phase.
DEADLINE_TABLE: Final[dict[DeadlineKind, str]] = {
    "launch": "→ Error, reason ProvisioningTimeout; intent: stop the runtime if it came up "
    "(then the completion policy applies)",
    "stop": "stays Stopping (or Suspending). Before the stop failed: deadline cleared; "
    "intent: kill the runtime now (forced); `reason` StopTimeout, but Suspending keeps an "
    "IdleSuspend or Expired reason (Suspended keeps it). After it failed (Stopping, `reason` "
    "StopFailed): the stop is asked for again, the next deadline twice as far out (the "
    "delete's back-off), and `reason` counts the retries",
    "delete": "stays Deleting, the delete is asked for again; the next deadline is twice as "
    "far out (up to a ceiling), and `reason` counts the retries",
    "restart": "(Error or Completed: a restart the restart policy scheduled) SandboxStarting "
    "naming the policy and the attempt: a new generation and identity, as any restart; "
    "deferred while held",
    "ttl": "SandboxExpired, then the policy: stop (when the phase admits a stop) or delete "
    "(when it admits a delete); deferred while held. It keeps counting while Suspended (the "
    "sandbox exists): stop then leaves it Suspended, delete deletes it with its workspace. "
    "During Suspending, stop waits for the suspend (`reason` Expired): a suspend that then "
    "fails leaving it Ready or Error goes on to Stopping (unless held)",
    "idle": "(Ready, with an idle timeout, not held) SandboxSuspending, `reason` IdleSuspend, "
    "when neither the row nor the recorded use it carries (`last_used_at`) changed within the "
    "timeout before the message; the row holds no idle deadline (the idle rules below)",
}


def _delete_now(
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    deadline = delete_deadline(state.spec, message.occurred_at, limits)
    return then_decide(
        state,
        events,
        message,
        cause,
        lambda c: new_event(SandboxDeleting, c, deadline),
    )


def completion_policy(
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    """The completion policy, once the main process's end is recorded."""
    if state.on_exit != "delete" or is_held(state) or not isinstance(events[-1], EXIT_EVENTS):
        return state, events
    return _delete_now(state, events, message, cause, limits)


def _stop_now(
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    deadline = stop_deadline(state.spec, message.occurred_at, limits)
    return then_decide(
        state, events, message, cause, lambda c: new_event(SandboxStopping, c, deadline)
    )


def _owes_stop(state: Sandbox) -> bool:
    """Ready or Error, unheld, and its reason still says its time to live ended (stop): the
    expiry fell during a suspend that then failed (its ``expires_at`` cleared)."""
    return (
        state.phase in (P.READY, P.ERROR)
        and expired(state.reason, state.expires_at)
        and not is_held(state)
    )


def owed_stop(
    state: Sandbox,
    new_state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    """The stop a time to live that ended during Suspending (``on_expiry`` stop: the row's
    reason says Expired, and a failed suspend keeps it) still owes the sandbox. A failed
    suspend that leaves it Ready (the runtime running) or Error (not seen) goes on to Stopping,
    as the expiry does in Ready; held, it stays (a hold keeps the policies off, as it defers an
    expiry) until the release (``owed_at_release``)."""
    if (
        state.phase is not P.SUSPENDING
        or not isinstance(events[-1], SandboxOperationFailed)
        or not _owes_stop(new_state)
    ):
        return new_state, events
    return _stop_now(new_state, events, message, cause, limits)


def owed_at_release(
    new_state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    """The stop ``owed_stop`` left to a hold, made at its release (as a deferred expiry is).
    Nothing else would: its ``expires_at`` was cleared by the expiry."""
    if not _owes_stop(new_state):
        return new_state, events
    return _stop_now(new_state, events, message, cause, limits)


def decide_deadline(
    state: Sandbox | None, due: DeadlineDue, cause: Cause, limits: Limits
) -> Decision:
    what = f"DeadlineDue({due.deadline} at {due.due_at.isoformat()}) of generation {due.generation}"
    if (not_current := not_current_generation(state, due.generation, what)) is not None:
        return not_current
    assert state is not None  # not_current_generation answered for a missing row
    at = due.occurred_at
    events: tuple[DecidedEvent, ...]
    if due.deadline == "idle":
        return decide_idle(state, due, cause, limits, what)
    if due.deadline == "ttl":
        if state.expires_at != due.due_at:
            return ignored(state, f"not pending: {what}, the row expires at {state.expires_at}")
        if state.hold is not None:
            return ignored(state, f"held by {state.hold.by}: {what} deferred until released")
        policy = state.on_expiry
        new_state, events = emit_event(
            state,
            built(
                SandboxExpired,
                type="SandboxExpired",
                **common_fields(state, due, cause),
                policy=policy,
            ),
        )
        if policy == "delete" and admission("DeleteSandbox", new_state.phase) is Admission.ADMIT:
            new_state, events = _delete_now(new_state, events, due, cause, limits)
        elif policy == "stop" and admission("StopSandbox", new_state.phase) is Admission.ADMIT:
            new_state, events = _stop_now(new_state, events, due, cause, limits)
    else:
        pending = state.deadline
        if pending is None or (pending.kind, pending.due_at) != (due.deadline, due.due_at):
            return ignored(state, f"not pending: {what}, the row's deadline is {pending}")
        common = common_fields(state, due, cause)
        event: DecidedEvent
        match pending.kind:
            case "launch":
                event = built(
                    SandboxTimedOut, type="SandboxTimedOut", **common, reason=PROVISIONING_TIMEOUT
                )
            case "stop" if awaits_stop_retry(state):
                again = retry_deadline("stop", state.spec, at, limits, pending.attempt + 1)
                assert again is not None  # pending exists, so retry deadlines are on
                event = built(
                    SandboxStopRetried, type="SandboxStopRetried", **common, deadline=again
                )
            case "stop":
                # Set only when true: left out, the field is unset, as validation builds it.
                keeps = state.phase is P.SUSPENDING and suspended_reason(state) is not None
                kept = {"keeps_reason": True} if keeps else {}
                event = built(SandboxStopEscalated, type="SandboxStopEscalated", **common, **kept)
            case "delete":
                again = delete_deadline(state.spec, at, limits, pending.attempt + 1)
                assert again is not None  # pending exists, so delete deadlines are on
                event = built(
                    SandboxDeleteRetried, type="SandboxDeleteRetried", **common, deadline=again
                )
            case "restart":
                return scheduled_restart_due(state, due, cause, limits, what)
        new_state, events = emit_event(state, event)
        new_state, events = apply_restart_policy(
            new_state, events, due, "launch timed out", cause, limits
        )
        new_state, events = completion_policy(new_state, events, due, cause, limits)
    why = f"{what}: {state.phase} -> {new_state.phase} ({events[0].type})" + policy_note(events)
    return Decision(new_state, events, "applied", why)
