"""The restart policy's tables (``RESTART_POLICY_TABLE``, ``PENDING_RESTART_TABLE``), its
back-off, and what the restart-related events change in a row (``RESTART_CHANGES``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final, Literal

from events.common import (
    Deadline,
    LastExit,
    RestartBackoff,
    RestartPolicy,
    Restarts,
    SandboxSpec,
)
from events.decided import (
    RestartPolicyChanged,
    SandboxHeld,
    SandboxReady,
    SandboxReleased,
    SandboxRestartScheduled,
    SandboxRestartsExhausted,
    SandboxStarting,
)
from events.trusted import built

from .model import P, Sandbox

# Restart policy (spec.restart_policy): what an exit of the current generation does.
# An exit of one of these kinds, under a policy marked Y for it, schedules a restart: the row
# keeps its phase (Error or Completed) and holds a deadline of kind ``restart`` whose due time is
# the exit's occurred_at plus the back-off (SandboxRestartScheduled); the scheduler's DeadlineDue
# naming it starts the next generation (SandboxStarting with the policy). With ``max_restarts``
# restarts in a row made already, the exit ends in Error instead (SandboxRestartsExhausted). A
# hold defers a scheduled restart, never cancels it: an exit while held schedules it as ever,
# a DeadlineDue while held changes nothing, and after the release the scheduler's next
# DeadlineDue restarts it (at once if it fell due meanwhile). (The completion policy of an exit
# while held still waits.)


ExitKind = Literal["exited 0", "exited non-zero", "vanished", "launch failed", "launch timed out"]


EXIT_KINDS: Final[tuple[ExitKind, ...]] = (
    "exited 0", "exited non-zero", "vanished", "launch failed", "launch timed out",
)  # fmt: skip


Y, N = True, False


RESTART_POLICY_TABLE: Final[dict[RestartPolicy, tuple[bool, ...]]] = {
    #            exited 0  exited non-zero  vanished  launch failed  launch timed out
    "Never":     (N,       N,               N,        N,             N),
    "OnFailure": (N,       Y,               Y,        Y,             Y),
    "Always":    (Y,       Y,               Y,        Y,             Y),
}  # fmt: skip


# What an input does to a scheduled restart (the row's deadline of kind restart) while it waits.
# "kept" or "cancelled" first: tests/test_restart_policy.py drives every entry.
PENDING_RESTART_TABLE: Final[dict[str, str]] = {
    "DeadlineDue(restart)": "kept until then: the restart, a new generation naming the policy",
    "StopSandbox": "cancelled: Stopping replaces the deadline",
    "DeleteSandbox": "cancelled: Deleting replaces the deadline",
    "StartSandbox, RestartSandbox": "cancelled: the operator's new generation starts at once, "
    "and the count of restarts in a row starts again",
    "HoldSandbox": "kept, deferred: a DeadlineDue while held changes nothing (the reason says "
    "so); after ReleaseSandbox the next one restarts it, at once if it fell due meanwhile",
    "SetRestartPolicy": "kept if the new policy would have scheduled it (it restarts after that "
    "exit, and the attempt is within max_restarts), else cancelled (the reason says why)",
    "RotateCredentials": "kept: the restart reads the newest values",
    "DeadlineDue(ttl)": "cancelled when the expiry stops or deletes the sandbox (on_expiry)",
    "the generation seen running": "cancelled: Ready",
}


DEFAULT_BACKOFF: Final = RestartBackoff()


RESTART_LIMIT: Final = "RestartLimit"


def restarts_on(policy: RestartPolicy | None, exit_kind: ExitKind) -> bool:
    return RESTART_POLICY_TABLE[policy or "Never"][EXIT_KINDS.index(exit_kind)]


def restart_delay(spec: SandboxSpec, attempt: int) -> float:
    """Seconds before the ``attempt``-th restart in a row (from 1): doubling, capped."""
    backoff = spec.restart_backoff or DEFAULT_BACKOFF
    if attempt > 64:  # far past any cap: 2**attempt would only grow the float
        return backoff.max_seconds
    return float(min(backoff.initial_seconds * 2 ** (attempt - 1), backoff.max_seconds))


def restarts_of(state: Sandbox) -> Restarts:
    return state.restarts if state.restarts is not None else _NO_RESTARTS


_NO_RESTARTS: Final = Restarts()


def started_reason(event: SandboxStarting) -> str | None:
    if event.policy is None:
        return None
    return f"restarted by restart_policy {event.policy} (restart {event.attempt} in a row)"


def restarts_on_start(state: Sandbox, event: SandboxStarting) -> dict[str, Any]:
    """A new generation is not Ready yet; a policy restart counts, an operator's start or
    restart begins a new run of attempts. (A rotation or detach restart, AgentRestarted,
    changes none of this: sandstream's own restart does not end the run that resets the
    back-off.)"""
    if state.restarts is None:
        return {}
    r = state.restarts
    if event.attempt is not None:
        r = r.model_copy(update={"count": r.count + 1, "attempt": event.attempt})
    else:
        r = r.model_copy(update={"attempt": 0})
    return {"restarts": r.model_copy(update={"ready_since": None})}


def restarts_on_ready(state: Sandbox, event: SandboxReady) -> dict[str, Any]:
    """Under a policy, remember since when the sandbox runs Ready (for the back-off reset); a
    run that a rotation restart went through goes on."""
    if (state.spec.restart_policy or "Never") == "Never" and state.restarts is None:
        return {}
    record = restarts_of(state)
    if record.ready_since is not None:
        return {}
    return {"restarts": record.model_copy(update={"ready_since": event.occurred_at})}


def _cancel_restart(state: Sandbox, why: str) -> dict[str, Any]:
    """Clear a scheduled restart, and the row's reason that announced it: the exit's reason
    and why the restart will not happen."""
    if state.deadline is None or state.deadline.kind != "restart":
        return {}
    last = restarts_of(state).last_exit
    exit_reason = last.reason if last is not None else state.reason
    return {"deadline": None, "reason": f"{exit_reason}; scheduled restart cancelled: {why}"}


def _restart_reason(state: Sandbox, deadline: Deadline, policy: str | None) -> str:
    """The row's reason while a restart waits: the exit's reason and when it restarts."""
    last = restarts_of(state).last_exit
    exit_reason = last.reason if last is not None else state.reason
    when = f"restarts it at {deadline.due_at.isoformat()} (restart {deadline.attempt} in a row)"
    if state.hold is not None:
        when += f", once released (held by {state.hold.by})"
    return f"{exit_reason}; restart_policy {policy} {when}"


def held_defers(state: Sandbox, e: SandboxHeld) -> dict[str, Any]:
    """A scheduled restart stays, deferred until the release; the reason says so."""
    held = replace(state, hold=e.hold)
    pending = state.deadline
    if pending is None or pending.kind != "restart":
        return {"hold": e.hold}
    return {"hold": e.hold, "reason": _restart_reason(held, pending, state.spec.restart_policy)}


def released(state: Sandbox, e: SandboxReleased) -> dict[str, Any]:
    """The release: a deferred restart is due again (the reason no longer says held)."""
    free = replace(state, hold=None)
    pending = state.deadline
    if pending is None or pending.kind != "restart":
        return {"hold": None}
    return {"hold": None, "reason": _restart_reason(free, pending, state.spec.restart_policy)}


def _exited(state: Sandbox, e: SandboxRestartScheduled | SandboxRestartsExhausted) -> Restarts:
    last = built(
        LastExit,
        generation=e.generation,
        exit_code=e.exit_code,
        reason=e.exit_reason if isinstance(e, SandboxRestartsExhausted) else e.reason,
        at=e.occurred_at,
    )
    attempt = e.deadline.attempt - 1 if isinstance(e, SandboxRestartScheduled) else e.restarts
    return restarts_of(state).model_copy(
        update={"last_exit": last, "attempt": attempt, "ready_since": None}
    )


def _policy_changes(state: Sandbox, e: RestartPolicyChanged) -> dict[str, Any]:
    """The spec's restart fields become the event's. A restart scheduled under the old ones
    stays only if the new ones would have scheduled it: the policy restarts the exit it waits
    after (Completed: exit 0; Error: a failure, which every policy treats alike) and its
    attempt is within ``max_restarts``."""
    spec = state.spec.model_copy(
        update={
            "restart_policy": None if e.restart_policy == "Never" else e.restart_policy,
            "restart_backoff": e.restart_backoff,
            "max_restarts": e.max_restarts,
        }
    )
    pending = state.deadline
    if pending is None or pending.kind != "restart":
        return {"spec": spec}
    exit_kind: ExitKind = "exited 0" if state.phase is P.COMPLETED else "exited non-zero"
    if not restarts_on(e.restart_policy, exit_kind):
        why = f"restart_policy {e.restart_policy} does not restart after {exit_kind}"
        return {"spec": spec, **_cancel_restart(state, why)}
    if e.max_restarts is not None and pending.attempt > e.max_restarts:
        why = f"restart {pending.attempt} in a row is past max_restarts {e.max_restarts}"
        return {"spec": spec, **_cancel_restart(state, why)}
    return {"spec": spec}


def _scheduled(state: Sandbox, e: SandboxRestartScheduled) -> dict[str, Any]:
    restarts = _exited(state, e)
    exited = replace(state, restarts=restarts)
    reason = _restart_reason(exited, e.deadline, e.policy)
    return {"deadline": e.deadline, "reason": reason, "restarts": restarts}


RESTART_CHANGES: Final[dict[type[Any], Callable[[Sandbox, Any], dict[str, Any]]]] = {
    SandboxRestartScheduled: _scheduled,
    SandboxRestartsExhausted: lambda s, e: {"phase": P.ERROR, "exit_code": e.exit_code,
                                            "reason": e.reason, "deadline": None,
                                            "restarts": _exited(s, e)},
    RestartPolicyChanged: _policy_changes,
}  # fmt: skip
