"""Idle suspend: what a ``DeadlineDue(idle)`` does (``IDLE_TABLE``). The doors record use
outside the log (coarsely, in PostgreSQL); the scheduler puts the last use it read on the log in
the DeadlineDue, and this rule decides on that and on the row alone, so the decision replays and
its history entry names the evidence.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from events.common import Cause
from events.decided import SandboxSuspending
from events.observations import DeadlineDue
from events.trusted import built

from .deadlines import stop_deadline
from .emit import common_fields, emit_event, ignored
from .model import IDLE_SUSPEND, Decision, Limits, P, Sandbox, is_held

# When a DeadlineDue(idle) suspends, in the order the rule checks (any "no" ignores it).
IDLE_TABLE: Final[dict[str, str]] = {
    "the spec has an idle timeout (`idle_suspend_seconds`)": "else ignored: never idle-suspended",
    "the sandbox is Ready": "else ignored: only a running sandbox is idle",
    "it is not held": "else ignored: a held sandbox is never idle-suspended",
    "it is not a warm pool's unclaimed member": "else ignored: a pool keeps its members Ready",
    "neither its row (any decided change: Ready, an attach, a hold's release, a new timeout) "
    "nor its recorded use (`last_used_at`) is younger than the timeout at the message's time": (
        "else ignored: used since"
    ),
    "all of these": "SandboxSuspending, `reason` IdleSuspend (kept in Suspended until a resume); "
    "the suspend's stop deadline as for SuspendSandbox",
}


def decide_idle(
    state: Sandbox, due: DeadlineDue, cause: Cause, limits: Limits, what: str
) -> Decision:
    """Suspend ``state`` if it has been idle for its whole timeout at ``due.occurred_at``."""
    seconds = state.spec.idle_suspend_seconds
    if seconds is None:
        return ignored(state, f"{what}: the sandbox has no idle timeout")
    if state.phase is not P.READY:
        return ignored(state, f"{what}: the sandbox is {state.phase}, not Ready")
    if is_held(state):
        assert state.hold is not None
        return ignored(state, f"{what}: held by {state.hold.by}: never idle-suspended")
    if state.pool is not None and state.claim_id is None:
        return ignored(state, f"{what}: a member of pool {state.pool!r}, not claimed yet")
    used = due.last_used_at
    since = state.updated_at if used is None else max(state.updated_at, used)
    idle_until = since + timedelta(seconds=seconds)
    if due.occurred_at < idle_until:
        return ignored(
            state, f"{what}: used at {since.isoformat()}, idle only from {idle_until.isoformat()}"
        )
    reason = f"{IDLE_SUSPEND}: no use since {since.isoformat()} (idle timeout {seconds}s)"
    event = built(
        SandboxSuspending,
        type="SandboxSuspending",
        **common_fields(state, due, cause),
        deadline=stop_deadline(state.spec, due.occurred_at, limits),
        reason=reason,
    )
    new_state, events = emit_event(state, event)
    return Decision(new_state, events, "applied", f"{what}: Ready -> Suspending ({reason})")
