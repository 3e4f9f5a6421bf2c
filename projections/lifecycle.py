"""The lifecycle rules of a sandbox: one pure function ``decide(state, message, cause)``.

No I/O, no clock, no randomness: identities and timestamps come from the message and its log
coordinates, so replaying the same inputs in the same order yields the same events. ``evolve``
applies a decided event to a row; ``decide`` uses it, and so does the rebuild from the log.

The tables below are the whole state machine (docs/state-machine.md shows the same):
``COMMAND_TABLE`` says which commands each phase admits, ``OBSERVATION_TABLE`` what each kind of
observation of the *current* generation does in each phase, ``PHASE_DEADLINES`` and
``DEADLINE_TABLE`` which phases carry a deadline and what its falling due does. Anything not in
the tables changes nothing and is recorded as ignored.

Time enters only through the log: a deadline is recorded in the row (computed from the
message's ``occurred_at`` and the ``Limits`` the processor is configured with), and only a
``DeadlineDue`` message naming exactly that deadline acts on it.
"""

# The one-letter names A/I/R keep the transition table readable at a glance.
# ruff: noqa: E741

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, Final, Literal, TypeVar, assert_never
from uuid import UUID

from pydantic import BaseModel

from events.commands import (
    AttachProvider,
    Command,
    CreateSandbox,
    DeleteSandbox,
    DetachProvider,
    ExtendSandbox,
    HoldSandbox,
    ReleaseSandbox,
    RestartSandbox,
    RotateCredentials,
    SetRestartPolicy,
    StartSandbox,
    StopSandbox,
)
from events.common import (
    INT32_MAX,
    Cause,
    Deadline,
    DeadlineKind,
    ExitPolicy,
    ExpiryPolicy,
    Hold,
    LastExit,
    Phase,
    RestartBackoff,
    RestartPolicy,
    Restarts,
    SandboxSpec,
)
from events.decided import (
    AgentRestarted,
    AgentRestartFailed,
    AgentRestartSkipped,
    DecidedEvent,
    ProviderAttached,
    ProviderDetached,
    RestartPolicyChanged,
    SandboxCompleted,
    SandboxCreated,
    SandboxDeleted,
    SandboxDeleteRetried,
    SandboxDeleting,
    SandboxExpired,
    SandboxExtended,
    SandboxFailed,
    SandboxHeld,
    SandboxOperationFailed,
    SandboxReady,
    SandboxReleased,
    SandboxRestartScheduled,
    SandboxRestartsExhausted,
    SandboxStarting,
    SandboxStopEscalated,
    SandboxStopped,
    SandboxStopping,
    SandboxTimedOut,
)
from events.observations import (
    DeadlineDue,
    DriverOperationResult,
    Observation,
    ObservedState,
    RuntimeRemoved,
    RuntimeSnapshot,
)
from events.outcomes import Code, CommandOutcome
from events.trusted import builder, built
from projections.records import maker, replaced
from projections.uuids import uuid5

Message = Command | Observation
Disposition = Literal["applied", "idempotent", "rejected", "ignored", "duplicate"]

_SANDBOX_NS: Final = UUID("6f1c9a52-4d3b-4a8e-9a57-0d5b1e0c7a11")
_IDENTITY_NS: Final = UUID("0b7d3e8c-2f41-4c55-8f0e-6a2d9c4b1e22")
_EVENT_NS: Final = UUID("9e4a1f6d-7c28-4b93-a1d5-3f8e2b6c0d33")

# Phase is a StrEnum: a member formats as its value (f"{phase}" writes what phase.value is,
# without the enum property's Python call on every reason).
P = Phase


@dataclass(frozen=True, slots=True)
class Sandbox:
    """One row of the read model: a live sandbox, or the tombstone of a deleted one."""

    key: str
    sandbox_id: UUID
    phase: Phase
    generation: int
    version: int
    spec: SandboxSpec
    providers: tuple[str, ...]
    identity: str
    exit_code: int | None
    reason: str | None
    created_at: datetime
    updated_at: datetime
    # Operator lifecycle (deadlines, time to live, completion policy, hold).
    deadline: Deadline | None = field(default=None, kw_only=True)
    expires_at: datetime | None = field(default=None, kw_only=True)
    on_expiry: ExpiryPolicy = field(default="stop", kw_only=True)
    on_exit: ExitPolicy = field(default="keep", kw_only=True)
    hold: Hold | None = field(default=None, kw_only=True)
    # Rotations decided while this generation's launch was pending (provider -> revision): the
    # launch must report having read at least these, or the agent restarts once more.
    awaited: dict[str, int] = field(default_factory=dict, kw_only=True)
    # The restart policy's record (None: nothing to record yet, e.g. under Never).
    restarts: Restarts | None = field(default=None, kw_only=True)

    @property
    def tombstoned(self) -> bool:
        return self.phase is P.DELETED


def is_held(sandbox: Sandbox | None) -> bool:
    """Whether an operator holds the sandbox: start, restart, expiry, the completion policy and
    credential rotation all leave a held sandbox alone."""
    return sandbox is not None and sandbox.hold is not None


@dataclass(frozen=True, slots=True)
class Limits:
    """How long each guarded phase may last (seconds; None: no deadline). The processor's
    configuration: the deadlines it computes travel in the decided events, so the rebuild from
    the log reproduces them whatever the configuration is then."""

    launch_seconds: float | None = 300.0
    # How long the executor retries a transient launch failure before it reports it (its
    # executor_retry_seconds): the launch deadline lies beyond it, so that report is decided.
    launch_retry_seconds: float = 600.0
    stop_grace_seconds: float = 10.0  # the driver's grace when the spec sets none
    stop_margin_seconds: float | None = 30.0
    delete_seconds: float | None = 120.0  # the first retry; each further one waits twice as long
    delete_backoff_max_seconds: float = 1800.0
    # A generation Ready at least this long before it ends resets the restart back-off.
    restart_reset_seconds: float = 600.0


DEFAULT_LIMITS: Final = Limits()


@dataclass(frozen=True, slots=True)
class Decision:
    state: Sandbox | None
    events: tuple[DecidedEvent, ...]
    disposition: Disposition
    reason: str
    outcome: CommandOutcome | None = None


# ---------------------------------------------------------------------------------------------
# Commands: which phase admits what.
#   ADMIT       the command is accepted and changes the row (one event, version + 1)
#   IDEMPOTENT  accepted, the row already is what the command asks for: no event, no new version
#   REJECT      FAILED_PRECONDITION, with a message naming the current phase


class Admission(Enum):
    ADMIT = "admit"
    IDEMPOTENT = "idempotent"
    REJECT = "reject"


A, I, R = Admission.ADMIT, Admission.IDEMPOTENT, Admission.REJECT
PHASE_COLUMNS: Final = (
    P.PROVISIONING, P.STARTING, P.READY, P.STOPPING, P.STOPPED, P.COMPLETED, P.ERROR, P.DELETING,
)  # fmt: skip
COMMAND_TABLE: Final[dict[str, tuple[Admission, ...]]] = {
    #                 Provisioning Starting Ready Stopping Stopped Completed Error Deleting
    "StartSandbox":   (I,          I,       I,    R,       A,      A,        A,    R),
    "StopSandbox":    (A,          A,       A,    I,       I,      A,        A,    R),
    "RestartSandbox": (A,          A,       A,    A,       A,      A,        A,    R),
    "DeleteSandbox":  (A,          A,       A,    A,       A,      A,        A,    I),
    "AttachProvider": (A,          A,       A,    A,       A,      A,        A,    R),
    "DetachProvider": (A,          A,       A,    A,       A,      A,        A,    R),
    "HoldSandbox":    (A,          A,       A,    A,       A,      A,        A,    R),
    "ReleaseSandbox": (A,          A,       A,    A,       A,      A,        A,    R),
    "ExtendSandbox":  (A,          A,       A,    A,       A,      A,        A,    R),
    "SetRestartPolicy": (A,        A,       A,    A,       A,      A,        A,    R),
}  # fmt: skip
# A held sandbox refuses these (FAILED_PRECONDITION naming who holds it and why) in every
# phase; stop and delete stay admitted. Hold on a held and release on an unheld sandbox are
# idempotent.
REFUSED_WHILE_HELD: Final = ("StartSandbox", "RestartSandbox")
# CreateSandbox: admitted when the name is free or tombstoned (a new incarnation at a higher
# generation), ALREADY_EXISTS otherwise. Every other command on a free or tombstoned name:
# NOT_FOUND.

_VERB = {
    "StartSandbox": "start",
    "StopSandbox": "stop",
    "RestartSandbox": "restart",
    "DeleteSandbox": "delete",
    "AttachProvider": "attach a provider",
    "DetachProvider": "detach a provider",
    "HoldSandbox": "hold",
    "ReleaseSandbox": "release",
    "ExtendSandbox": "extend",
    "SetRestartPolicy": "set the restart policy",
}


def admission(command_type: str, phase: Phase) -> Admission:
    return COMMAND_TABLE[command_type][PHASE_COLUMNS.index(phase)]


def admitting_phases(command_type: str) -> list[Phase]:
    row = COMMAND_TABLE[command_type]
    return [p for p, a in zip(PHASE_COLUMNS, row, strict=True) if a is A]


# ---------------------------------------------------------------------------------------------
# Observations of the current generation: what they do in each phase.
# Older generations are stale, newer than issued are unknown: both ignored before this table.

ObservationKind = Literal[
    "created", "running", "stopping", "exited_ok", "exited_error", "removed",
    "launch_succeeded", "launch_failed",
    "stop_succeeded", "stop_absent", "stop_failed",
    "delete_succeeded", "delete_absent", "delete_failed",
]  # fmt: skip
FOLLOW_OBSERVED: Final = "follow observed"  # the phase the backend was seen in after a failure
Target = Phase | Literal["follow observed"]

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
        "stop_failed": FOLLOW_OBSERVED,
    },
    # Stopped: snapshots that describe the stop itself only confirm it. Only an accepted
    # start, restart or delete leaves Stopped.
    P.STOPPED: {},
    P.COMPLETED: {},
    # Only "running" lifts Error: a stopping runtime (its removal under way, e.g. the cleanup
    # stop of a timed-out launch) is no sign of life. "stopping" changes nothing anywhere: the
    # exit or the removal that follows decides.
    P.ERROR: {"running": P.READY},
    # Deleting is monotonic: ordinary snapshots change nothing, removal tombstones.
    P.DELETING: {
        "removed": P.DELETED,
        "delete_succeeded": P.DELETED,
        "delete_absent": P.DELETED,
        "delete_failed": FOLLOW_OBSERVED,
    },
}

_OBSERVED_PHASE: dict[ObservedState, Phase] = {
    "running": P.READY,
    "created": P.STOPPED,  # exists, not running: a start recovers it
    "exited": P.STOPPED,
    "absent": P.DELETED,
}


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


# ---------------------------------------------------------------------------------------------
# Credential rotation (RotateCredentials): what a rotation of attached providers does to a
# sandbox in each phase. RESTART starts a new generation once for all the providers the command
# names (AgentRestarted, a launch intent that reads the current values); any other entry is the
# reason recorded with AgentRestartSkipped (the new values apply at the next start). A command
# naming only providers the sandbox has not attached changes nothing (idempotent).
#
# RESTART_PENDING (Provisioning, Starting): a launch of the current generation is pending and
# reads the values when it runs, which may be before or after this rotation was stored. The
# rotation is recorded in the row (``awaited``); the launch's report names the revisions it read
# (DriverOperationResult.credentials), and only if one is older than awaited (or unknown) does
# the sandbox restart again, at once (SandboxReady + AgentRestarted on that report). A running
# snapshot does not make it Ready meanwhile: Ready means running the newest values.

RESTART: Final = "restart"
RESTART_PENDING: Final = "restart already pending: the pending launch reads the newest values"
ROTATION_TABLE: Final[dict[Phase, str]] = {
    P.PROVISIONING: RESTART_PENDING,
    P.STARTING: RESTART_PENDING,
    P.READY: RESTART,
    P.STOPPING: "stopping: the new values apply at its next start",
    P.STOPPED: "stopped: the new values apply at its next start",
    P.COMPLETED: "completed: the new values apply at its next start",
    P.ERROR: "in error: the new values apply at its next start",
    P.DELETING: "being deleted",
}
NO_RESTART: Final = "restart not requested (no-restart): the new values apply at the next start"
HELD: Final = "held: the new values apply at its next start"
# The row's reason while a rotation restart is in flight; a failed launch then is an
# AgentRestartFailed rather than a plain SandboxFailed.
ROTATION_RESTART: Final = "restarting for rotated credentials: "


def held(state: Sandbox) -> bool:
    """Whether a hold keeps ``state`` from being restarted by a rotation (an operator's hold:
    the new values wait for the release and the next start)."""
    return is_held(state)


def rotation_action(state: Sandbox, restart: bool) -> str:
    """RESTART, or why not: the one rule for the processor and for an update's receipt."""
    return _restart_rule(state, restart, ROTATION_TABLE, NO_RESTART, HELD)


def _restart_rule(
    state: Sandbox, restart: bool, table: dict[Phase, str], not_asked: str, on_hold: str
) -> str:
    """RESTART or why not, by ``table`` unless no restart was asked for or a hold keeps it."""
    if not restart:
        return not_asked
    if held(state):
        return on_hold
    return table[state.phase]


def stale_rotations(state: Sandbox, read: dict[str, int] | None) -> dict[str, int]:
    """The awaited rotations of still attached providers that a launch which read ``read``
    (provider -> revision; None: unknown) did not see: the agent must restart for these."""
    return {
        p: r
        for p, r in state.awaited.items()
        if p in state.providers and (read is None or read.get(p, 0) < r)
    }


# ---------------------------------------------------------------------------------------------
# Detaching a provider (DetachProvider): what losing a provider does to a sandbox in each phase
# that admits the command (COMMAND_TABLE). The agent must stop seeing the provider's values,
# as after a rotation: RESTART records ProviderDetached and AgentRestarted (``detached``) in
# one decision, a new generation whose launch reads only the providers still attached; any
# other entry is why it does not restart (the outcome's message), the values leaving at its
# next start.
#
# DETACH_PENDING (Provisioning, Starting): the pending launch reads the attached providers when
# it runs, which may be before or after the detach. The detached provider is recorded in the
# row (``awaited``, revision 0: "must not have been read"); if the launch's report names it
# (or is unknown), the sandbox restarts once more, at once, without it.

DETACH_PENDING: Final = "launch pending: it restarts once more if that launch read the provider"
DETACH_TABLE: Final[dict[Phase, str]] = {
    P.PROVISIONING: DETACH_PENDING,
    P.STARTING: DETACH_PENDING,
    P.READY: RESTART,
    P.STOPPING: "stopping: its next start runs without the provider's values",
    P.STOPPED: "stopped: its next start runs without the provider's values",
    P.COMPLETED: "completed: its next start runs without the provider's values",
    P.ERROR: "in error: its next start runs without the provider's values",
}
DETACH_NO_RESTART: Final = (
    "restart not requested (no-restart): the provider's values leave at the next start"
)
DETACH_HELD: Final = "held: the provider's values leave at its next start"
# The row's reason while a restart that drops detached providers is in flight.
DETACH_RESTART: Final = "restarting without detached providers: "


def detach_action(state: Sandbox, restart: bool) -> str:
    """RESTART, or why not: what detaching a provider does to ``state``."""
    return _restart_rule(state, restart, DETACH_TABLE, DETACH_NO_RESTART, DETACH_HELD)


def stale_detaches(state: Sandbox, read: dict[str, int] | None) -> list[str]:
    """The providers detached while a launch was pending that the launch which read ``read``
    did read (or may have: None, unknown): the agent must restart without these."""
    return sorted(
        p
        for p in state.awaited
        if p not in state.providers and (read is None or read.get(p, 0) > 0)
    )


def restart_reason(rotated: list[str], detached: list[str]) -> str:
    """The row's reason while a restart for rotated or detached providers is in flight."""
    parts = []
    if rotated:
        parts.append(ROTATION_RESTART + ", ".join(rotated))
    if detached:
        parts.append(DETACH_RESTART + ", ".join(detached))
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Deterministic identities


def next_generation(state: Sandbox) -> int:
    """The generation after the row's. The events are built without validation
    (``events.trusted``), so the column's bound that validation enforced is checked here."""
    if state.generation >= INT32_MAX:
        raise ValueError(f"sandbox {state.key!r}: generation {state.generation} is the last")
    return state.generation + 1


def sandbox_id_for(key: str, generation: int, command_id: str) -> UUID:
    """A new incarnation's id: distinct from every earlier incarnation's by its generation."""
    return uuid5(_SANDBOX_NS, f"{key}/{generation}/{command_id}")


def identity_for(sandbox_id: UUID, generation: int, command_id: str) -> str:
    """The runtime identity of a generation; drivers bind credentials to exactly this value."""
    return "rid-" + uuid5(_IDENTITY_NS, f"{sandbox_id}/{generation}/{command_id}").hex


def event_id_for(cause: Cause, index: int = 0) -> UUID:
    """The id of the ``index``-th event decided on the input at ``cause``."""
    suffix = f"/{index}" if index else ""
    return uuid5(_EVENT_NS, f"{cause.topic}/{cause.partition}/{cause.offset}{suffix}")


# ---------------------------------------------------------------------------------------------
# Restart policy (spec.restart_policy): what an exit of the current generation does.
# An exit of one of these kinds, under a policy marked Y for it, schedules a restart: the row
# keeps its phase (Error or Completed) and holds a deadline of kind ``restart`` whose due time is
# the exit's occurred_at plus the back-off (SandboxRestartScheduled); the scheduler's DeadlineDue
# naming it starts the next generation (SandboxStarting with the policy). With ``max_restarts``
# restarts in a row made already, the exit ends in Error instead (SandboxRestartsExhausted). A
# held sandbox is not restarted (its completion policy waits as well).

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
    "HoldSandbox": "cancelled (the reason says so); a release does not schedule it again",
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


def _restarts(state: Sandbox) -> Restarts:
    return state.restarts if state.restarts is not None else _NO_RESTARTS


_NO_RESTARTS: Final = Restarts()


def _started_reason(event: SandboxStarting) -> str | None:
    if event.policy is None:
        return None
    return f"restarted by restart_policy {event.policy} (restart {event.attempt} in a row)"


def _restarts_on_start(state: Sandbox, event: SandboxStarting) -> dict[str, Any]:
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


def _restarts_on_ready(state: Sandbox, event: SandboxReady) -> dict[str, Any]:
    """Under a policy, remember since when the sandbox runs Ready (for the back-off reset); a
    run that a rotation restart went through goes on."""
    if (state.spec.restart_policy or "Never") == "Never" and state.restarts is None:
        return {}
    record = _restarts(state)
    if record.ready_since is not None:
        return {}
    return {"restarts": record.model_copy(update={"ready_since": event.occurred_at})}


def _cancel_restart(state: Sandbox, why: str) -> dict[str, Any]:
    """Clear a scheduled restart, and the row's reason that announced it: the exit's reason
    and why the restart will not happen."""
    if state.deadline is None or state.deadline.kind != "restart":
        return {}
    last = _restarts(state).last_exit
    exit_reason = last.reason if last is not None else state.reason
    return {"deadline": None, "reason": f"{exit_reason}; scheduled restart cancelled: {why}"}


def _held_cancels(state: Sandbox, e: SandboxHeld) -> dict[str, Any]:
    return _cancel_restart(state, f"held by {e.hold.by}")


def _exited(state: Sandbox, e: SandboxRestartScheduled | SandboxRestartsExhausted) -> Restarts:
    last = built(
        LastExit,
        generation=e.generation,
        exit_code=e.exit_code,
        reason=e.exit_reason if isinstance(e, SandboxRestartsExhausted) else e.reason,
        at=e.occurred_at,
    )
    attempt = e.deadline.attempt - 1 if isinstance(e, SandboxRestartScheduled) else e.restarts
    return _restarts(state).model_copy(
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


def _scheduled_reason(e: SandboxRestartScheduled) -> str:
    return (
        f"{e.reason}; restart_policy {e.policy} restarts it at {e.deadline.due_at.isoformat()} "
        f"(restart {e.deadline.attempt} in a row)"
    )


RESTART_CHANGES: Final[dict[type[Any], Callable[[Sandbox, Any], dict[str, Any]]]] = {
    SandboxRestartScheduled: lambda s, e: {"deadline": e.deadline, "reason": _scheduled_reason(e),
                                           "restarts": _exited(s, e)},
    SandboxRestartsExhausted: lambda s, e: {"phase": P.ERROR, "exit_code": e.exit_code,
                                            "reason": e.reason, "deadline": None,
                                            "restarts": _exited(s, e)},
    RestartPolicyChanged: _policy_changes,
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# evolve: apply one decided event to a row (used live and by the rebuild from the log)


_LAUNCH_PENDING: Final = (P.PROVISIONING, P.STARTING)
_new_row = maker(Sandbox)  # every field, in order: Sandbox(...) through its slots


def evolve(state: Sandbox | None, event: DecidedEvent) -> Sandbox:
    if type(event) is SandboxCreated:  # the decided events are final classes
        return _new_row(
            event.key, event.sandbox_id, P.PROVISIONING, event.generation, event.version,
            event.spec, tuple(sorted(set(event.providers))), event.identity,
            None,  # exit_code
            None,  # reason
            event.occurred_at,  # created_at
            event.occurred_at,  # updated_at
            event.deadline, event.expires_at, event.on_expiry, event.on_exit,
            None,  # hold
            {},  # awaited
            None,  # restarts
        )  # fmt: skip
    if state is None:
        raise ValueError(f"{event.type} for {event.key!r} before SandboxCreated")
    new = replaced(
        state,
        version=event.version,
        generation=event.generation,
        updated_at=event.occurred_at,
        **_changes(state, event),
    )
    # Awaited rotations belong to one pending launch: a new generation or a phase past the
    # launch (its report decided, or it failed: the next start reads the newest) clears them.
    if new.awaited and (new.generation != state.generation or new.phase not in _LAUNCH_PENDING):
        new = replace(new, awaited={})
    return new


# The fields each event sets besides version, generation and updated_at, by the event's type
# (one dict lookup: a match over the classes runs an isinstance check per case). A phase change
# sets the new phase's deadline (None for phases without one).
_Changes = Callable[[Sandbox, Any], dict[str, Any]]
_CHANGES: Final[dict[type[DecidedEvent], _Changes]] = {
    SandboxStarting: lambda s, e: {"phase": P.STARTING, "spec": e.spec, "identity": e.identity,
                                   "exit_code": None, "reason": _started_reason(e),
                                   "deadline": e.deadline, **_restarts_on_start(s, e)},
    SandboxReady: lambda s, e: {"phase": P.READY, "exit_code": None, "reason": None,
                                "deadline": None, **_restarts_on_ready(s, e)},
    SandboxStopping: lambda s, e: {"phase": P.STOPPING, "deadline": e.deadline},
    SandboxStopped: lambda s, e: {"phase": P.STOPPED, "reason": None, "deadline": None},
    SandboxCompleted: lambda s, e: {"phase": P.COMPLETED, "exit_code": e.exit_code,
                                    "reason": None, "deadline": None},
    SandboxFailed: lambda s, e: {"phase": P.ERROR, "exit_code": e.exit_code, "reason": e.reason,
                                 "deadline": None},
    SandboxOperationFailed: lambda s, e: {"phase": e.phase, "exit_code": e.exit_code,
                                          "reason": e.reason, "deadline": None},
    SandboxDeleting: lambda s, e: {"phase": P.DELETING, "deadline": e.deadline},
    SandboxDeleted: lambda s, e: {"phase": P.DELETED, "deadline": None},
    ProviderAttached: lambda s, e: {"providers": tuple(sorted({*s.providers, e.provider}))},
    ProviderDetached: lambda s, e: _detached(s, e),
    AgentRestarted: lambda s, e: {"phase": P.STARTING, "spec": e.spec, "identity": e.identity,
                                  "exit_code": None, "deadline": e.deadline,
                                  "reason": restart_reason(e.providers, e.detached)},
    AgentRestartSkipped: lambda s, e: _merge_awaited(s, e),
    AgentRestartFailed: lambda s, e: {"phase": P.ERROR, "exit_code": e.exit_code,
                                      "reason": e.reason, "deadline": None},
    SandboxTimedOut: lambda s, e: {"phase": P.ERROR, "exit_code": None, "reason": e.reason,
                                   "deadline": None},
    SandboxStopEscalated: lambda s, e: {
        "reason": "StopTimeout: the stop outlived its grace period; killing", "deadline": None
    },
    SandboxDeleteRetried: lambda s, e: {
        "reason": f"DeleteTimeout: not deleted yet; retry {e.deadline.attempt}",
        "deadline": e.deadline,
    },
    SandboxExpired: lambda s, e: {"expires_at": None,
                                  "reason": f"Expired: time to live ended ({e.policy})"},
    SandboxExtended: lambda s, e: {"expires_at": e.expires_at},
    SandboxHeld: lambda s, e: {"hold": e.hold, **_held_cancels(s, e)},
    SandboxReleased: lambda s, e: {"hold": None},
    **RESTART_CHANGES,
}  # fmt: skip


def _detached(state: Sandbox, event: ProviderDetached) -> dict[str, Any]:
    """The provider leaves the row; while a launch is pending, it is awaited (revision 0:
    that launch must not have read it, DETACH_PENDING)."""
    changes: dict[str, Any] = {
        "providers": tuple(p for p in state.providers if p != event.provider)
    }
    if state.phase in _LAUNCH_PENDING:
        changes["awaited"] = {event.provider: 0, **state.awaited}
    return changes


def _merge_awaited(state: Sandbox, event: AgentRestartSkipped) -> dict[str, Any]:
    if not event.awaits:
        return {}
    merged = dict(state.awaited)
    for provider, revision in event.awaits.items():
        merged[provider] = max(revision, merged.get(provider, 0))
    return {"awaited": merged}


def _changes(state: Sandbox, event: DecidedEvent) -> dict[str, Any]:
    """The fields an event sets besides version, generation and updated_at."""
    changes = _CHANGES.get(type(event))
    if changes is None:
        raise ValueError(f"unexpected event {event.type}")
    return changes(state, event)


# ---------------------------------------------------------------------------------------------
# decide


def decide(
    state: Sandbox | None, message: Message, cause: Cause, limits: Limits = DEFAULT_LIMITS
) -> Decision:
    """The new row, the decided events and the outcome of one input message."""
    if isinstance(message, DeadlineDue):
        return _decide_deadline(state, message, cause, limits)
    if isinstance(message, RuntimeSnapshot | RuntimeRemoved | DriverOperationResult):
        return _decide_observation(state, message, cause, limits)
    return _decide_command(state, message, cause, limits)


def _emit(state: Sandbox | None, event: DecidedEvent) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    return evolve(state, event), (event,)


# The fields every decided event has, in the order ``_common`` gives them.
COMMON_FIELDS: Final = (
    "event_id", "key", "sandbox_id", "version", "generation", "occurred_at", "actor", "cause",
)  # fmt: skip


def _common(
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
        (SandboxDeleting, ("deadline",)),
    )
}  # fmt: skip


def _event(cls: type[E], common: dict[str, Any], *extra: Any) -> E:
    """``built(cls, type=<its name>, **common, <the extra fields>=extra)`` for ``_EVENTS``."""
    return _EVENTS[cls](cls.__name__, *common.values(), *extra)  # type: ignore[no-any-return]


def _outcome(command: Command, code: Code, message: str, state: Sandbox | None) -> CommandOutcome:
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


def _reject(state: Sandbox | None, command: Command, code: Code, why: str) -> Decision:
    return Decision(state, (), "rejected", why, _outcome(command, code, why, state))


def _decide_command(
    state: Sandbox | None, command: Command, cause: Cause, limits: Limits
) -> Decision:
    if isinstance(command, CreateSandbox):
        return _create(state, command, cause, limits)
    if state is None or state.tombstoned:
        return _reject(state, command, Code.NOT_FOUND, f"sandbox {command.key!r} not found")
    if isinstance(command, RotateCredentials):
        return _rotate(state, command, cause, limits)
    expected = command.expected_version
    if expected is not None and expected != state.version:
        why = (
            f"expected version {expected} but sandbox {command.key!r} is at version {state.version}"
        )
        return _reject(state, command, Code.ABORTED, why)

    verb = _VERB[command.type]
    rule = admission(command.type, state.phase)
    if rule is R:
        allowed = ", ".join(p.value for p in admitting_phases(command.type))
        why = f"sandbox must be {allowed} to {verb} (current phase: {state.phase})"
        return _reject(state, command, Code.FAILED_PRECONDITION, why)
    if command.type in REFUSED_WHILE_HELD and state.hold is not None:
        hold = state.hold
        why = (
            f"sandbox {command.key!r} is held by {hold.by} since {hold.since.isoformat()}: "
            f"{hold.reason} (release it to {verb})"
        )
        return _reject(state, command, Code.FAILED_PRECONDITION, why)
    held = state.hold is not None
    if isinstance(command, HoldSandbox | ReleaseSandbox) and held == isinstance(
        command, HoldSandbox
    ):
        rule = I
    if isinstance(command, AttachProvider | DetachProvider):
        attached = command.provider in state.providers
        if attached == isinstance(command, AttachProvider):
            rule = I
    if isinstance(command, SetRestartPolicy) and policy_unchanged(state.spec, command):
        rule = I
    if rule is I:
        why = f"nothing to do: sandbox {command.key!r} is {state.phase}"
        if isinstance(command, AttachProvider | DetachProvider):
            why = f"nothing to do: provider {command.provider!r} is already " + (
                "attached" if isinstance(command, AttachProvider) else "detached"
            )
        if isinstance(command, HoldSandbox | ReleaseSandbox):
            why = f"nothing to do: sandbox {command.key!r} is " + (
                f"already held by {state.hold.by}: {state.hold.reason}"
                if state.hold is not None
                else "not held"
            )
        return Decision(state, (), "idempotent", why, _outcome(command, Code.OK, why, state))

    if isinstance(command, DetachProvider):
        return _detach(state, command, cause, limits)
    common = _common(state, command, cause)
    at = command.occurred_at
    event: DecidedEvent
    match command:
        case StartSandbox() | RestartSandbox():
            generation = next_generation(state)
            event = built(
                SandboxStarting,
                type="SandboxStarting",
                **(common | {"generation": generation}),
                reason="start" if isinstance(command, StartSandbox) else "restart",
                previous_generation=state.generation,
                spec=state.spec,
                identity=identity_for(state.sandbox_id, generation, command.command_id),
                deadline=launch_deadline(at, limits, replacing=state.spec),
            )
        case StopSandbox():
            deadline = stop_deadline(state.spec, at, limits)
            event = _event(SandboxStopping, common, deadline)
        case DeleteSandbox():
            deadline = delete_deadline(state.spec, at, limits)
            event = _event(SandboxDeleting, common, deadline)
        case SetRestartPolicy():
            event = built(
                RestartPolicyChanged,
                type="RestartPolicyChanged",
                **common,
                restart_policy=command.restart_policy,
                restart_backoff=command.restart_backoff,
                max_restarts=command.max_restarts,
            )
        case HoldSandbox():
            hold = built(Hold, by=command.actor, reason=command.reason, since=at)
            event = built(SandboxHeld, type="SandboxHeld", **common, hold=hold)
        case ReleaseSandbox():
            event = _event(SandboxReleased, common)
        case ExtendSandbox():
            expires_at = at + timedelta(seconds=command.ttl_seconds)
            event = built(SandboxExtended, type="SandboxExtended", **common, expires_at=expires_at)
        case AttachProvider():
            event = built(
                ProviderAttached, type="ProviderAttached", **common, provider=command.provider
            )
        case _:
            raise AssertionError(command)
    new_state, events = _emit(state, event)
    why = f"{command.type} accepted: sandbox {command.key!r} is {new_state.phase}"
    return Decision(new_state, events, "applied", why, _outcome(command, Code.OK, why, new_state))


def _create(
    state: Sandbox | None, command: CreateSandbox, cause: Cause, limits: Limits
) -> Decision:
    if state is not None and not state.tombstoned:
        why = f"sandbox {command.key!r} already exists (phase: {state.phase})"
        return _reject(state, command, Code.ALREADY_EXISTS, why)
    # A re-create after delete starts above the tombstone's generation, so nothing of the old
    # incarnation can ever match the new one.
    generation = next_generation(state) if state is not None else 1
    version = state.version + 1 if state is not None else 1
    sandbox_id = sandbox_id_for(command.key, generation, command.command_id)
    event = built(
        SandboxCreated,
        type="SandboxCreated",
        event_id=event_id_for(cause),
        key=command.key,
        sandbox_id=sandbox_id,
        version=version,
        generation=generation,
        occurred_at=command.occurred_at,
        actor=command.actor,
        cause=cause,
        spec=command.spec,
        providers=sorted(set(command.providers)),
        identity=identity_for(sandbox_id, generation, command.command_id),
        deadline=launch_deadline(command.occurred_at, limits),
        expires_at=(
            command.occurred_at + timedelta(seconds=command.ttl_seconds)
            if command.ttl_seconds is not None
            else None
        ),
        on_expiry=command.on_expiry,
        on_exit=command.on_exit,
    )
    new_state, events = _emit(state, event)
    why = f"sandbox {command.key!r} created at generation {generation}"
    return Decision(new_state, events, "applied", why, _outcome(command, Code.OK, why, new_state))


def _rotate(state: Sandbox, command: RotateCredentials, cause: Cause, limits: Limits) -> Decision:
    named = sorted({r.provider for r in command.rotations})
    attached = [p for p in named if p in state.providers]
    if not attached:
        why = f"nothing to do: {', '.join(named)} not attached to sandbox {command.key!r}"
        return Decision(state, (), "idempotent", why, _outcome(command, Code.OK, why, state))
    action = rotation_action(state, command.restart)
    common = _common(state, command, cause)
    event: DecidedEvent
    if action == RESTART:
        event = _agent_restarted(state, common, attached, command.command_id, limits)
        why = f"restart for rotated {', '.join(attached)}: generation {event.generation}"
    else:
        awaits: dict[str, int] = {}
        if action == RESTART_PENDING:
            for r in command.rotations:
                if r.provider in attached:
                    awaits[r.provider] = max(r.revision, awaits.get(r.provider, 0))
        event = built(
            AgentRestartSkipped,
            type="AgentRestartSkipped",
            **common,
            providers=attached,
            reason=action,
            awaits=awaits,
        )
        why = f"restart skipped for rotated {', '.join(attached)}: {action}"
    new_state, events = _emit(state, event)
    return Decision(new_state, events, "applied", why, _outcome(command, Code.OK, why, new_state))


def _detach(state: Sandbox, command: DetachProvider, cause: Cause, limits: Limits) -> Decision:
    """ProviderDetached, and in Ready a restart without the provider (DETACH_TABLE)."""
    action = detach_action(state, command.restart)
    provider = command.provider
    new_state, events = _emit(
        state,
        built(
            ProviderDetached,
            type="ProviderDetached",
            **_common(state, command, cause),
            provider=provider,
        ),
    )
    if action == RESTART:
        new_state, events = _then(
            new_state,
            events,
            command,
            cause,
            lambda c: _agent_restarted(
                new_state, c, [], command.command_id, limits, detached=[provider]
            ),
        )
        why = (
            f"provider {provider!r} detached: restart without it: generation {new_state.generation}"
        )
    else:
        why = f"provider {provider!r} detached: {action}"
    return Decision(new_state, events, "applied", why, _outcome(command, Code.OK, why, new_state))


def _ignore(state: Sandbox | None, why: str) -> Decision:
    return Decision(state, (), "ignored", why)


def _not_current(state: Sandbox | None, generation: int, what: str) -> Decision | None:
    """An input about a runtime generation is news only for the live row at that generation:
    the ignore decision for an unknown or tombstoned sandbox, or another generation."""
    if state is None:
        return _ignore(state, f"unknown sandbox: {what}")
    if state.tombstoned:
        return _ignore(state, f"tombstoned at generation {state.generation}: {what}")
    if generation < state.generation:
        return _ignore(state, f"stale: {what}, current generation is {state.generation}")
    if generation > state.generation:
        return _ignore(state, f"unknown generation: {what}, newest issued is {state.generation}")
    return None


def _decide_observation(
    state: Sandbox | None, obs: Observation, cause: Cause, limits: Limits
) -> Decision:
    kind = observation_kind(obs)
    what = f"{obs.type}({kind}) of generation {obs.generation}"
    if (not_current := _not_current(state, obs.generation, what)) is not None:
        return not_current
    assert state is not None  # _not_current answered for a missing row

    target = OBSERVATION_TABLE[state.phase].get(kind)
    if target is None:
        return _ignore(state, f"no effect in phase {state.phase}: {what}")
    if state.awaited and kind == "running":
        return _ignore(state, f"{what}: awaiting the launch's report of the values it read")
    event = _observation_event(state, obs, kind, target, _common(state, obs, cause))
    new_state, events = _emit(state, event)
    if state.awaited and kind == "launch_succeeded":
        assert isinstance(obs, DriverOperationResult)
        new_state, events = _restart_if_stale(state, new_state, events, obs, cause, limits)
    new_state, events = _restart_policy(
        new_state, events, obs, _OBSERVED_EXIT.get(kind), cause, limits
    )
    new_state, events = _on_exit(new_state, events, obs, cause, limits)
    why = f"{what}: {state.phase} -> {new_state.phase}" + _policy_note(events)
    return Decision(new_state, events, "applied", why)


def _restart_if_stale(
    pending: Sandbox,
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    obs: DriverOperationResult,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    """The launch that ``pending`` awaited reported what it read: restart once more if it
    missed a rotation decided while it was pending, or read a provider detached meanwhile (the
    agent must run the newest values, and none of a detached provider)."""
    stale = sorted(stale_rotations(pending, obs.credentials))
    gone = stale_detaches(pending, obs.credentials)
    if not stale and not gone:
        return state, events
    if held(state):  # a hold made meanwhile: the newest values wait for the next start
        return _then(
            state,
            events,
            obs,
            cause,
            lambda c: built(
                AgentRestartSkipped,
                type="AgentRestartSkipped",
                **c,
                providers=stale + gone,
                reason=HELD if stale else DETACH_HELD,
            ),
        )
    return _then(
        state,
        events,
        obs,
        cause,
        lambda c: _agent_restarted(state, c, stale, obs.observation_id, limits, detached=gone),
    )


def _agent_restarted(
    state: Sandbox,
    common: dict,  # type: ignore[type-arg]
    providers: list[str],
    id_source: str,
    limits: Limits,
    detached: list[str] | None = None,
) -> AgentRestarted:
    """A restart of ``state`` at the next generation, for rotated ``providers`` and detached
    ones."""
    generation = next_generation(state)
    return built(
        AgentRestarted,
        type="AgentRestarted",
        **(common | {"generation": generation}),
        providers=providers,
        detached=detached or [],
        previous_generation=state.generation,
        spec=state.spec,
        identity=identity_for(state.sandbox_id, generation, id_source),
        deadline=launch_deadline(common["occurred_at"], limits, replacing=state.spec),
    )


def _observation_event(
    state: Sandbox,
    obs: Observation,
    kind: ObservationKind,
    target: Target,
    common: dict,  # type: ignore[type-arg]
) -> DecidedEvent:
    exit_code = getattr(obs, "exit_code", None)
    if target == FOLLOW_OBSERVED:
        # A failed stop or delete: the row follows what the backend looks like now.
        assert isinstance(obs, DriverOperationResult)
        phase = _OBSERVED_PHASE[obs.observed] if obs.observed else P.ERROR
        if phase is P.DELETED and obs.operation != "delete":
            phase = P.STOPPED  # a stop that finds nothing left has stopped it
        if phase is P.DELETED:
            return _event(SandboxDeleted, common)
        return built(
            SandboxOperationFailed,
            type="SandboxOperationFailed",
            **common,
            operation=obs.operation,
            phase=phase,
            reason=obs.reason or f"{obs.operation} failed",
            exit_code=exit_code,
        )
    match target:
        case P.READY:
            return _event(SandboxReady, common)
        case P.STOPPED:
            return _event(SandboxStopped, common)
        case P.COMPLETED:
            return built(
                SandboxCompleted, type="SandboxCompleted", **common, exit_code=exit_code or 0
            )
        case P.DELETED:
            return _event(SandboxDeleted, common)
        case P.ERROR if (
            kind == "launch_failed"
            and state.phase is P.STARTING
            and (state.reason or "").startswith((ROTATION_RESTART, DETACH_RESTART))
        ):
            reason = getattr(obs, "reason", None) or "launch failed"
            return built(
                AgentRestartFailed,
                type="AgentRestartFailed",
                **common,
                reason=reason,
                exit_code=exit_code,
            )
        case P.ERROR:
            reasons = {
                "exited_error": f"runtime exited with code {exit_code}"
                if exit_code is not None
                else "runtime exited with an unknown code",
                "removed": "runtime removed outside sandstream",
            }
            reason = getattr(obs, "reason", None) or reasons.get(kind, f"{kind.replace('_', ' ')}")
            return built(
                SandboxFailed, type="SandboxFailed", **common, reason=reason, exit_code=exit_code
            )
    raise AssertionError(f"no event leads to {target}")


# ---------------------------------------------------------------------------------------------
# Deadlines, time to live, completion policy (operator lifecycle)

# Which phases carry a deadline, of which kind. Entering one records it in the row (computed
# from the entering message's occurred_at and the Limits); leaving it clears it.
PHASE_DEADLINES: Final[dict[Phase, Literal["launch", "stop", "delete"]]] = {
    P.PROVISIONING: "launch",
    P.STARTING: "launch",
    P.STOPPING: "stop",
    P.DELETING: "delete",
}
# What a DeadlineDue naming exactly the row's deadline does (anything else is ignored: stale
# generation, a deadline the row no longer holds, a repeat). The ttl deadline is the row's
# expires_at, in any live phase.
DEADLINE_TABLE: Final[dict[DeadlineKind, str]] = {
    "launch": "→ Error, reason ProvisioningTimeout; intent: stop the runtime if it came up "
    "(then the completion policy applies)",
    "stop": "stays Stopping, deadline cleared; intent: kill the runtime now (forced)",
    "delete": "stays Deleting, the delete is asked for again; the next deadline is twice as "
    "far out (up to a ceiling), and `reason` counts the retries",
    "restart": "(Error or Completed: a restart the restart policy scheduled) SandboxStarting "
    "naming the policy and the attempt: a new generation and identity, as any restart",
    "ttl": "SandboxExpired, then the policy: stop (when the phase admits a stop) or delete "
    "(when it admits a delete); deferred while held",
}
# The completion policy on_exit=delete: a sandbox whose main process ended (SandboxCompleted,
# SandboxFailed, SandboxTimedOut) is deleted in the same decision, unless it is held.
EXIT_EVENTS: Final = (SandboxCompleted, SandboxFailed, SandboxTimedOut, SandboxRestartsExhausted)
PROVISIONING_TIMEOUT: Final = "ProvisioningTimeout"


def _after(at: datetime, seconds: float) -> datetime:
    return at + timedelta(seconds=seconds)


# The deadlines are built without validation: an aware time (the message's, plus seconds), a
# kind of the literal and a count from zero are what validation would accept unchanged.
_deadline = builder(Deadline, "kind", "due_at")
_counted_deadline = builder(Deadline, "kind", "due_at", "attempt")


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
        "launch", _after(at, begins + limits.launch_retry_seconds + limits.launch_seconds)
    )


def stop_deadline(spec: SandboxSpec, at: datetime, limits: Limits) -> Deadline | None:
    """The grace period (the sandbox's, else the driver's) plus the margin."""
    if limits.stop_margin_seconds is None:
        return None
    return _deadline("stop", _after(at, grace_of(spec, limits) + limits.stop_margin_seconds))


def delete_deadline(
    spec: SandboxSpec, at: datetime, limits: Limits, attempt: int = 0
) -> Deadline | None:
    """A delete stops running runtimes first (grace period), then waits with back-off."""
    if limits.delete_seconds is None:
        return None
    wait = min(limits.delete_seconds * 2**attempt, limits.delete_backoff_max_seconds)
    return _counted_deadline("delete", _after(at, grace_of(spec, limits) + wait), attempt)


def _then(
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    cause: Cause,
    make: Any,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    """Decide one more event on the same input: ``make(common)`` builds it."""
    event = make(_common(state, message, cause, index=len(events)))
    return evolve(state, event), (*events, event)


def _delete_now(
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    message: Message,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    deadline = delete_deadline(state.spec, message.occurred_at, limits)
    return _then(
        state,
        events,
        message,
        cause,
        lambda c: _event(SandboxDeleting, c, deadline),
    )


def _on_exit(
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


def _decide_deadline(
    state: Sandbox | None, due: DeadlineDue, cause: Cause, limits: Limits
) -> Decision:
    what = f"DeadlineDue({due.deadline} at {due.due_at.isoformat()}) of generation {due.generation}"
    if (not_current := _not_current(state, due.generation, what)) is not None:
        return not_current
    assert state is not None  # _not_current answered for a missing row
    at = due.occurred_at
    events: tuple[DecidedEvent, ...]
    if due.deadline == "ttl":
        if state.expires_at != due.due_at:
            return _ignore(state, f"not pending: {what}, the row expires at {state.expires_at}")
        if state.hold is not None:
            return _ignore(state, f"held by {state.hold.by}: {what} deferred until released")
        policy = state.on_expiry
        new_state, events = _emit(
            state,
            built(
                SandboxExpired, type="SandboxExpired", **_common(state, due, cause), policy=policy
            ),
        )
        if policy == "delete" and admission("DeleteSandbox", new_state.phase) is A:
            new_state, events = _delete_now(new_state, events, due, cause, limits)
        elif policy == "stop" and admission("StopSandbox", new_state.phase) is A:
            deadline = stop_deadline(new_state.spec, at, limits)
            new_state, events = _then(
                new_state,
                events,
                due,
                cause,
                lambda c: _event(SandboxStopping, c, deadline),
            )
    else:
        pending = state.deadline
        if pending is None or (pending.kind, pending.due_at) != (due.deadline, due.due_at):
            return _ignore(state, f"not pending: {what}, the row's deadline is {pending}")
        common = _common(state, due, cause)
        event: DecidedEvent
        match pending.kind:
            case "launch":
                event = built(
                    SandboxTimedOut, type="SandboxTimedOut", **common, reason=PROVISIONING_TIMEOUT
                )
            case "stop":
                event = _event(SandboxStopEscalated, common)
            case "delete":
                again = delete_deadline(state.spec, at, limits, pending.attempt + 1)
                assert again is not None  # pending exists, so delete deadlines are on
                event = built(
                    SandboxDeleteRetried, type="SandboxDeleteRetried", **common, deadline=again
                )
            case "restart":
                return _scheduled_restart_due(state, due, cause, limits, what)
        new_state, events = _emit(state, event)
        new_state, events = _restart_policy(
            new_state, events, due, "launch timed out", cause, limits
        )
        new_state, events = _on_exit(new_state, events, due, cause, limits)
    why = f"{what}: {state.phase} -> {new_state.phase} ({events[0].type})" + _policy_note(events)
    return Decision(new_state, events, "applied", why)


# ---------------------------------------------------------------------------------------------
# Restart policy: the decisions (the table and the row changes are above, before evolve)

# The exits an observation of the current generation can be, when it ends the generation.
_OBSERVED_EXIT: Final[dict[ObservationKind, ExitKind]] = {
    "exited_ok": "exited 0",
    "exited_error": "exited non-zero",
    "removed": "vanished",
    "launch_failed": "launch failed",
}
_ENDS_GENERATION: Final = (SandboxCompleted, SandboxFailed, AgentRestartFailed, SandboxTimedOut)


def policy_unchanged(spec: SandboxSpec, command: SetRestartPolicy) -> bool:
    return (spec.restart_policy or "Never", spec.restart_backoff, spec.max_restarts) == (
        command.restart_policy,
        command.restart_backoff,
        command.max_restarts,
    )


def _restart_policy(
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
        or is_held(state)
    ):
        return state, events
    exit_code = getattr(ended, "exit_code", None)
    reason = getattr(ended, "reason", None) or f"runtime exited with code {exit_code}"
    record, at = _restarts(state), message.occurred_at
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
        return _then(
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
    due = _counted_deadline("restart", _after(at, restart_delay(state.spec, made + 1)), made + 1)
    return _then(
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


def _policy_note(events: tuple[DecidedEvent, ...]) -> str:
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


def _scheduled_restart_due(
    state: Sandbox, due: DeadlineDue, cause: Cause, limits: Limits, what: str
) -> Decision:
    """The restart the policy scheduled falls due: the next generation, like any restart."""
    pending = state.deadline
    assert pending is not None and pending.kind == "restart"
    policy = state.spec.restart_policy
    if policy is None or is_held(state):  # both cancel it at once: defensive
        return _ignore(state, f"not pending: {what}, restart_policy {policy}, hold {state.hold}")
    generation = next_generation(state)
    event = built(
        SandboxStarting,
        type="SandboxStarting",
        **(_common(state, due, cause) | {"generation": generation}),
        reason="restart",
        previous_generation=state.generation,
        spec=state.spec,
        identity=identity_for(state.sandbox_id, generation, due.observation_id),
        deadline=launch_deadline(due.occurred_at, limits, replacing=state.spec),
        policy=policy,
        attempt=pending.attempt,
    )
    new_state, events = _emit(state, event)
    why = (
        f"{what}: restart under restart_policy {policy} (restart {pending.attempt} in a row): "
        f"{state.phase} -> {new_state.phase}, generation {generation}"
    )
    return Decision(new_state, events, "applied", why)
