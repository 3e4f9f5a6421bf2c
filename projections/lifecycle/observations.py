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

from .model import P

# Observations of the current generation: what they do in each phase.
# Older generations are stale, newer than issued are unknown: both ignored before this table.


ObservationKind = Literal[
    "created", "running", "stopping", "exited_ok", "exited_error", "removed",
    "launch_succeeded", "launch_failed",
    "stop_succeeded", "stop_absent", "stop_failed",
    "delete_succeeded", "delete_absent", "delete_failed",
]  # fmt: skip


# A failed delete: the row stays Deleting and records the failure (its reason and attempt);
# the delete deadline's retries, or the reconcile loop's pick-up, ask for the delete again.
KEEP_DELETING: Final = "keep deleting"
# A failed stop: Stopped when the backend was seen with the runtime not running (exited,
# created, absent: the stop's aim is met); otherwise the row stays Stopping and records the
# failure, and the retry deadline (the delete's back-off) or the pick-up asks again.
KEEP_STOPPING: Final = "keep stopping"


Target = Phase | Literal["keep deleting", "keep stopping"]


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
