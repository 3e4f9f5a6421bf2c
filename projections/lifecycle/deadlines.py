"""Deadlines as values: which phases carry one (``PHASE_DEADLINES``) and when it falls due
(launch, stop with its grace and margin, delete with its back-off), computed from a message's
``occurred_at`` and the ``Limits``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Final, Literal

from events.common import (
    Deadline,
    Phase,
    SandboxSpec,
)
from events.decided import (
    SandboxCompleted,
    SandboxFailed,
    SandboxRestartsExhausted,
    SandboxTimedOut,
)
from events.trusted import builder

from .model import DELETE_FAILED, Limits, P, Sandbox

# Which phases carry a deadline, of which kind. Entering one records it in the row (computed
# from the entering message's occurred_at and the Limits); leaving it clears it.
PHASE_DEADLINES: Final[dict[Phase, Literal["launch", "stop", "delete"]]] = {
    P.PROVISIONING: "launch",
    P.STARTING: "launch",
    P.STOPPING: "stop",
    P.SUSPENDING: "stop",  # the suspend's stop: its grace period plus the margin, then a kill
    P.DELETING: "delete",
}


# The completion policy on_exit=delete: a sandbox whose main process ended (SandboxCompleted,
# SandboxFailed, SandboxTimedOut) is deleted in the same decision, unless it is held.
EXIT_EVENTS: Final = (SandboxCompleted, SandboxFailed, SandboxTimedOut, SandboxRestartsExhausted)


PROVISIONING_TIMEOUT: Final = "ProvisioningTimeout"


def moment_after(at: datetime, seconds: float) -> datetime:
    return at + timedelta(seconds=seconds)


# The deadlines are built without validation: an aware time (the message's, plus seconds), a
# kind of the literal and a count from zero are what validation would accept unchanged.
_deadline = builder(Deadline, "kind", "due_at")


counted_deadline = builder(Deadline, "kind", "due_at", "attempt")


def grace_of(spec: SandboxSpec, limits: Limits) -> float:
    """The grace period of stopping a runtime of ``spec``: the sandbox's, else the driver's."""
    if spec.stop_timeout_seconds is not None:
        return spec.stop_timeout_seconds
    return limits.stop_grace_seconds


def launch_deadline(
    at: datetime, limits: Limits, *, replacing: SandboxSpec | None = None
) -> Deadline | None:
    """When a launch decided at ``at`` is given up (ProvisioningTimeout): the launch timeout
    counted from when the executor stops retrying it, which is its retry window after the
    launch can begin, i.e. after the generation it replaces (``replacing``: a start, restart
    or rotation restart) has been stopped with its grace period. So the executor's own report
    (Ready, or the failure after its retries: AgentRestartFailed for a rotation) is decided
    first, and a slow-stopping agent is not timed out by its own stop."""
    if limits.launch_seconds is None:
        return None
    begins = grace_of(replacing, limits) if replacing is not None else 0.0
    return _deadline(
        "launch", moment_after(at, begins + limits.launch_retry_seconds + limits.launch_seconds)
    )


def stop_deadline(spec: SandboxSpec, at: datetime, limits: Limits) -> Deadline | None:
    """The grace period (the sandbox's, else the driver's) plus the margin."""
    if limits.stop_margin_seconds is None:
        return None
    return _deadline("stop", moment_after(at, grace_of(spec, limits) + limits.stop_margin_seconds))


def retry_deadline(
    kind: Literal["stop", "delete"], spec: SandboxSpec, at: datetime, limits: Limits, attempt: int
) -> Deadline | None:
    """The back-off of a delete's retries, and of a failed stop's: a stop or delete waits out
    the grace period first, then ``delete_seconds`` doubling per retry up to the ceiling."""
    if limits.delete_seconds is None:
        return None
    wait = min(limits.delete_seconds * 2**attempt, limits.delete_backoff_max_seconds)
    return counted_deadline(kind, moment_after(at, grace_of(spec, limits) + wait), attempt)


def delete_deadline(
    spec: SandboxSpec, at: datetime, limits: Limits, attempt: int = 0
) -> Deadline | None:
    """A delete stops running runtimes first (grace period), then waits with back-off."""
    return retry_deadline("delete", spec, at, limits, attempt)


def failure_reason(
    prefix: str, phase: P, deadline: Deadline | None, operation: str, reason: str | None
) -> str:
    """The row's reason after a failed delete or stop: that it is still Deleting or Stopping,
    how many retries its deadline made so far, when the next one is due, and the driver's
    reason (the history keeps one per failure)."""
    then = (
        f"retries so far: {deadline.attempt}; next retry at {deadline.due_at.isoformat()}"
        if deadline is not None
        else f"{operation} retries off; the reconcile loop asks again"
    )
    return f"{prefix}: still {phase} ({then}): {reason or f'{operation} failed'}"


def delete_failure_reason(state: Sandbox, reason: str | None) -> str:
    return failure_reason(DELETE_FAILED, P.DELETING, state.deadline, "delete", reason)
