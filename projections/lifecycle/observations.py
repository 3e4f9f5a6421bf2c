"""What an observation of the current generation does in each phase: ``OBSERVATION_TABLE``,
and ``observation_kind``, which names the kind of a driver's observation.
"""

from __future__ import annotations

from typing import Final, Literal, assert_never

from events.common import Phase
from events.observations import (
    DeadlineDue,
    DriverOperationResult,
    Observation,
    ObservedState,
    RuntimeRemoved,
    RuntimeSnapshot,
)

from .model import P, Sandbox, expired, idle_suspended

# Observations of the current generation: what they do in each phase.
# Older generations are stale, newer than issued are unknown: both ignored before this table.


ObservationKind = Literal[
    "created", "running", "stopping", "exited_ok", "exited_error", "removed",
    "launch_succeeded", "launch_failed",
    "stop_succeeded", "stop_absent", "stop_failed",
    "suspend_succeeded", "suspend_absent", "suspend_failed",
    "delete_succeeded", "delete_absent", "delete_failed",
]  # fmt: skip


# A failed delete: the row stays Deleting and records the failure (its reason and attempt);
# the delete deadline's retries, or the reconcile loop's pick-up, ask for the delete again.
KEEP_DELETING: Final = "keep deleting"
# A failed stop: Stopped when the backend was seen with the runtime not running (exited,
# created, absent: the stop's aim is met); otherwise the row stays Stopping and records the
# failure, and the retry deadline (the delete's back-off) or the pick-up asks again.
KEEP_STOPPING: Final = "keep stopping"


# A failed suspend: the row takes the phase the backend was seen in (a runtime still running
# is Ready again and usable; none running is Suspended). Unlike a stop or a delete, a suspend is
# not retried: it frees compute and loses nothing when it fails, so asking again is the caller's.
FOLLOW_OBSERVED: Final = "follow observed"


Target = Phase | Literal["keep deleting", "keep stopping", "follow observed"]

# The phase a failed suspend leaves, by what the backend was seen as (FOLLOW_OBSERVED). A
# runtime left that does not run (created, or exited: the suspend's stop, or an exit during
# Suspending, which is no exit of the agent either way) is Suspended, as after a removal: its
# compute is free and its workspace kept; the reconcile loop removes a runtime left under a
# Suspended row, and a resume (a wake) starts the next generation. (Stopped, before: no wake
# resumed it and no restart policy restarted it.)
OBSERVED_PHASE: Final[dict[ObservedState, Phase]] = {
    "running": P.READY,
    "created": P.SUSPENDED,
    "exited": P.SUSPENDED,
    "absent": P.SUSPENDED,
}


def failed_suspend(state: Sandbox, obs: DriverOperationResult) -> tuple[Phase, str, int | None]:
    """The phase, reason and exit code a failed suspend of ``state`` leaves (not seen: Error).
    Suspended keeps the exit code the row had, as a suspend that succeeded does, and the
    reason that says why it is suspended or that its time to live ended (a wake must not
    resume that one), the failure after it. A time to live that ended is kept in Ready and
    Error too: the stop it owes follows (deadline_due.owed_stop)."""
    reason = obs.reason or f"{obs.operation} failed"
    phase = OBSERVED_PHASE[obs.observed] if obs.observed else P.ERROR
    if expired(state.reason, state.expires_at) or (phase is P.SUSPENDED and idle_suspended(state)):
        reason = f"{state.reason}; the suspend failed: {reason}"
    return phase, reason, state.exit_code if phase is P.SUSPENDED else obs.exit_code


_LAUNCHING: dict[ObservationKind, Target] = {
    "running": P.READY,
    "launch_succeeded": P.READY,
    "exited_ok": P.COMPLETED,
    "exited_error": P.ERROR,
    "removed": P.ERROR,
    "launch_failed": P.ERROR,
}


OBSERVATION_TABLE: Final[dict[Phase, dict[ObservationKind, Target]]] = {
    P.PROVISIONING: _LAUNCHING,
    P.STARTING: _LAUNCHING,
    P.READY: {"exited_ok": P.COMPLETED, "exited_error": P.ERROR, "removed": P.ERROR},
    P.STOPPING: {
        "exited_ok": P.STOPPED,
        "exited_error": P.STOPPED,
        "removed": P.STOPPED,
        "stop_succeeded": P.STOPPED,
        "stop_absent": P.STOPPED,
        "stop_failed": KEEP_STOPPING,
    },
    # Stopped: snapshots that describe the stop itself only confirm it. Only an accepted
    # start, restart or delete leaves Stopped.
    P.STOPPED: {},
    # Suspending: only the runtime's removal (seen, or the suspend's own result) suspends. Its
    # exit is the suspend's stop, no exit of the agent: the restart and completion policies
    # never see it. A failed suspend follows what the backend was seen in: running is Ready,
    # anything else seen (exited, created, absent) Suspended.
    P.SUSPENDING: {
        "removed": P.SUSPENDED,
        "suspend_succeeded": P.SUSPENDED,
        "suspend_absent": P.SUSPENDED,
        "suspend_failed": FOLLOW_OBSERVED,
    },
    # Suspended: nothing of its generation runs or comes back; late snapshots and removals of
    # it change nothing. Only an accepted resume, start, restart or delete leaves Suspended.
    P.SUSPENDED: {},
    P.COMPLETED: {},
    # Only "running" lifts Error: a stopping runtime (its removal under way, e.g. the cleanup
    # stop of a timed-out launch) is no sign of life. "stopping" changes nothing anywhere: the
    # exit or the removal that follows decides.
    P.ERROR: {"running": P.READY},
    # Deleting is monotonic: a decided delete is never undone. Only the delete's own report
    # that everything of the incarnation is gone (runtimes, workspace, secrets) tombstones:
    # a runtime's removal is not that (its workspace may still be held by another container),
    # and a failed delete stays Deleting, to be retried.
    P.DELETING: {
        "delete_succeeded": P.DELETED,
        "delete_absent": P.DELETED,
        "delete_failed": KEEP_DELETING,
    },
}


def ran_before_its_exit(state: Sandbox, kind: ObservationKind, obs: Observation) -> bool:
    """A "running" of an Error row's generation dated no later than that generation's exit
    (``exited_at``): the runtime ran before the exit, not after it. Such a snapshot comes late,
    not again: e.g. a start Podman 4.3's event stream sends again when it rotates its log, to a
    watch that cannot recognise it (one begun after it, or reopened). Lifting Error on it would
    show a dead runtime Ready and drop or repeat the restart policy's decision (the likely
    cause of two suite runs' failures: four restarts for three, three exits decided for two).
    """
    return (
        kind == "running"
        and state.phase is P.ERROR
        and state.exited_at is not None
        and obs.occurred_at <= state.exited_at
    )


# What the backend showed after a failed stop that ends the stop: the runtime is not running
# (exists without running: a start recovers it; absent: gone already). Running, or unknown
# (None), keeps the row Stopping.
STOPPED_STATES: Final[frozenset[ObservedState]] = frozenset({"created", "exited", "absent"})


def observation_kind(obs: Observation) -> ObservationKind:
    match obs:
        case RuntimeSnapshot(state="exited"):
            return "exited_ok" if obs.exit_code == 0 else "exited_error"
        case RuntimeSnapshot(state="running"):
            return "running"
        case RuntimeSnapshot(state="stopping"):
            return "stopping"
        case RuntimeSnapshot():
            return "created"
        case RuntimeRemoved():
            return "removed"
        case DriverOperationResult(operation=op, outcome=outcome):
            suffix = {"succeeded": "succeeded", "failed": "failed", "already_absent": "absent"}
            kind = f"{op}_{suffix[outcome]}"
            return "launch_failed" if kind == "launch_absent" else kind  # type: ignore[return-value]
        case DeadlineDue():
            raise ValueError("a deadline is decided by DEADLINE_TABLE, not OBSERVATION_TABLE")
    assert_never(obs)
