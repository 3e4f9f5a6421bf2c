"""Table-driven unit tests of ``projections.lifecycle.decide``: every cell of both tables."""

from __future__ import annotations

from typing import get_args

import factories as f
import pytest

from events.commands import Command
from events.common import Phase
from events.decided import (
    IdleSuspendChanged,
    ProviderAttached,
    ProviderDetached,
    RestartPolicyChanged,
    SandboxCompleted,
    SandboxCreated,
    SandboxDeleted,
    SandboxDeleting,
    SandboxExtended,
    SandboxFailed,
    SandboxHeld,
    SandboxOperationFailed,
    SandboxReady,
    SandboxReleased,
    SandboxStarting,
    SandboxStopped,
    SandboxStopping,
    SandboxSuspended,
    SandboxSuspending,
)
from events.observations import ObservedState
from events.outcomes import Code
from projections.lifecycle import (
    COMMAND_TABLE,
    FOLLOW_OBSERVED,
    KEEP_DELETING,
    KEEP_STOPPING,
    OBSERVATION_TABLE,
    PHASE_COLUMNS,
    Admission,
    Decision,
    Message,
    ObservationKind,
    Sandbox,
    admitting_phases,
    decide,
    event_id_for,
    identity_for,
    observation_kind,
    sandbox_id_for,
)

P = Phase
KINDS: tuple[ObservationKind, ...] = get_args(ObservationKind)
OBSERVED: tuple[ObservedState | None, ...] = (None, *get_args(ObservedState))
VERBS = {
    "StartSandbox": "start",
    "StopSandbox": "stop",
    "RestartSandbox": "restart",
    "SuspendSandbox": "suspend",
    "ResumeSandbox": "resume",
    "DeleteSandbox": "delete",
    "AttachProvider": "attach a provider",
    "DetachProvider": "detach a provider",
    "HoldSandbox": "hold",
    "ReleaseSandbox": "release",
    "ExtendSandbox": "extend",
    "SetRestartPolicy": "set the restart policy",
    "SetIdleSuspend": "set the idle timeout",
}
ADMITTED_EVENT = {
    "StartSandbox": (SandboxStarting, P.STARTING),
    "RestartSandbox": (SandboxStarting, P.STARTING),
    "StopSandbox": (SandboxStopping, P.STOPPING),
    "SuspendSandbox": (SandboxSuspending, P.SUSPENDING),
    "ResumeSandbox": (SandboxStarting, P.STARTING),
    "DeleteSandbox": (SandboxDeleting, P.DELETING),
    "AttachProvider": (ProviderAttached, None),  # None: the phase does not change
    "DetachProvider": (ProviderDetached, None),
    "HoldSandbox": (SandboxHeld, None),
    "ReleaseSandbox": (SandboxReleased, None),
    "ExtendSandbox": (SandboxExtended, None),
    "SetRestartPolicy": (RestartPolicyChanged, None),
    "SetIdleSuspend": (IdleSuspendChanged, None),
}
TARGET_EVENT = {
    P.READY: SandboxReady,
    P.STOPPED: SandboxStopped,
    P.SUSPENDED: SandboxSuspended,
    P.COMPLETED: SandboxCompleted,
    P.ERROR: SandboxFailed,
    P.DELETED: SandboxDeleted,
}


def row_in(phase: Phase, key: str = f.KEY, *, held: bool = False) -> Sandbox:
    """A row in ``phase`` reached through real messages; its one provider is ``github``."""
    h = f.harness_in(phase, key)
    if held and phase is not P.DELETING and phase is not P.DELETED:
        h.send(f.hold(key))
    return h.row(key)


def command_for(command_type: str, key: str = f.KEY, **kw: object) -> Command:
    """A versioned command that, when admitted, changes the row (attach a new provider,
    detach the attached one)."""
    if command_type == "AttachProvider":
        kw.setdefault("provider", "gitlab")
    if command_type == "DetachProvider":
        kw.setdefault("provider", "github")
        kw.setdefault("restart", False)  # the restart it may add: DETACH_TABLE, test_detach_rules
    return f.VERSIONED_COMMANDS[command_type](key, **kw)


def run(state: Sandbox | None, message: Message) -> Decision:
    return decide(state, message, f.Causes(start=100)(message))


def assert_unchanged(state: Sandbox | None, decision: Decision) -> None:
    assert decision.events == ()
    assert decision.state is state


CELLS = [
    pytest.param(ctype, phase, COMMAND_TABLE[ctype][i], id=f"{ctype}-{phase.value}")
    for ctype in COMMAND_TABLE
    for i, phase in enumerate(PHASE_COLUMNS)
]


# ---------------------------------------------------------------------------------------------
# The command table, cell by cell


def test_command_table_covers_every_live_phase() -> None:
    assert set(PHASE_COLUMNS) == set(P) - {P.DELETED}
    assert set(COMMAND_TABLE) == set(VERBS)
    assert all(len(row) == len(PHASE_COLUMNS) for row in COMMAND_TABLE.values())


@pytest.mark.parametrize(("command_type", "phase", "rule"), CELLS)
def test_command_cell(command_type: str, phase: Phase, rule: Admission) -> None:
    state = row_in(phase, held=command_type == "ReleaseSandbox")
    command = command_for(command_type)
    decision = run(state, command)
    outcome = decision.outcome
    assert outcome is not None
    assert (outcome.command_id, outcome.key, outcome.command_type) == (
        command.command_id,
        command.key,
        command_type,
    )

    if rule is Admission.ADMIT:
        assert decision.disposition == "applied"
        assert outcome.status == "accepted" and outcome.code is Code.OK
        (event,) = decision.events
        event_type, target = ADMITTED_EVENT[command_type]
        assert isinstance(event, event_type)
        new = decision.state
        assert new is not None
        assert new.version == event.version == state.version + 1
        assert new.phase is (target or phase)
        assert new.sandbox_id == state.sandbox_id == event.sandbox_id
        assert (outcome.version, outcome.phase, outcome.generation) == (
            new.version,
            new.phase,
            new.generation,
        )
        if isinstance(event, SandboxStarting):
            assert new.generation == event.generation == state.generation + 1
            assert event.previous_generation == state.generation
            reasons = {"StartSandbox": "start", "ResumeSandbox": "resume"}
            assert event.reason == reasons.get(command_type, "restart")
            expected = identity_for(state.sandbox_id, new.generation, command.command_id)
            assert event.identity == new.identity == outcome.identity == expected
            assert new.identity != state.identity
            assert event.spec == state.spec
        else:
            assert new.generation == event.generation == state.generation
            assert new.identity == state.identity
        if isinstance(event, ProviderAttached):
            assert new.providers == ("github", "gitlab")
        if isinstance(event, ProviderDetached):
            assert new.providers == ()
    elif rule is Admission.IDEMPOTENT:
        assert decision.disposition == "idempotent"
        assert_unchanged(state, decision)
        assert outcome.status == "accepted" and outcome.code is Code.OK
        assert outcome.version == state.version and outcome.identity == state.identity
        assert outcome.message.startswith("nothing to do")
    else:
        assert decision.disposition == "rejected"
        assert_unchanged(state, decision)
        assert outcome.status == "rejected" and outcome.code is Code.FAILED_PRECONDITION
        allowed = ", ".join(p.value for p in admitting_phases(command_type))
        assert outcome.message == (
            f"sandbox must be {allowed} to {VERBS[command_type]} (current phase: {phase.value})"
        )
        assert outcome.version == state.version and outcome.phase is phase


@pytest.mark.parametrize(
    ("command_type", "phase", "rule"),
    [
        ("StopSandbox", P.DELETING, Admission.REJECT),
        ("StartSandbox", P.DELETING, Admission.REJECT),
        ("RestartSandbox", P.DELETING, Admission.REJECT),
        ("DeleteSandbox", P.DELETING, Admission.IDEMPOTENT),
        ("StopSandbox", P.STOPPED, Admission.IDEMPOTENT),
        ("StopSandbox", P.STOPPING, Admission.IDEMPOTENT),
        ("StartSandbox", P.STOPPED, Admission.ADMIT),
        ("StartSandbox", P.STARTING, Admission.IDEMPOTENT),
        ("StartSandbox", P.STOPPING, Admission.REJECT),
    ],
)
def test_cells_the_scenarios_rely_on(command_type: str, phase: Phase, rule: Admission) -> None:
    assert COMMAND_TABLE[command_type][PHASE_COLUMNS.index(phase)] is rule


def test_reject_message_names_the_phase() -> None:
    decision = run(row_in(P.DELETING), f.stop())
    assert decision.outcome is not None
    assert decision.outcome.message == (
        "sandbox must be Provisioning, Starting, Ready, Completed, Error to stop "
        "(current phase: Deleting)"
    )


# ---------------------------------------------------------------------------------------------
# Names: unknown, tombstoned, live; create and re-create


@pytest.mark.parametrize("command_type", list(COMMAND_TABLE))
@pytest.mark.parametrize("tombstoned", [False, True], ids=["unknown", "tombstoned"])
def test_not_found(command_type: str, tombstoned: bool) -> None:
    state = row_in(P.DELETED) if tombstoned else None
    decision = run(state, command_for(command_type, expected_version=7))
    assert_unchanged(state, decision)
    assert decision.disposition == "rejected"
    assert decision.outcome is not None
    assert decision.outcome.code is Code.NOT_FOUND
    assert decision.outcome.message == f"sandbox {f.KEY!r} not found"


@pytest.mark.parametrize("phase", PHASE_COLUMNS)
def test_create_of_a_live_name_already_exists(phase: Phase) -> None:
    state = row_in(phase)
    decision = run(state, f.create())
    assert_unchanged(state, decision)
    assert decision.outcome is not None
    assert decision.outcome.code is Code.ALREADY_EXISTS
    assert decision.outcome.message == f"sandbox {f.KEY!r} already exists (phase: {phase.value})"
    assert decision.outcome.sandbox_id == state.sandbox_id


def test_create_of_a_new_name() -> None:
    command = f.create(providers=["zeta", "alpha", "zeta"])
    decision = run(None, command)
    (event,) = decision.events
    assert isinstance(event, SandboxCreated)
    new = decision.state
    assert new is not None
    assert (new.phase, new.generation, new.version) == (P.PROVISIONING, 1, 1)
    assert (
        new.sandbox_id
        == event.sandbox_id
        == sandbox_id_for(f.KEY, new.generation, command.command_id)
    )
    assert new.identity == event.identity == identity_for(new.sandbox_id, 1, command.command_id)
    assert new.providers == ("alpha", "zeta") and event.providers == ["alpha", "zeta"]
    assert new.spec == command.spec
    assert new.created_at == new.updated_at == command.occurred_at
    assert decision.outcome is not None and decision.outcome.accepted
    assert decision.outcome.sandbox_id == new.sandbox_id
    assert decision.outcome.identity == new.identity


def test_create_after_delete_is_a_new_incarnation_at_a_higher_generation() -> None:
    h = f.harness_in(P.STARTING)  # generation 2
    h.send(f.delete(), f.deleted(generation=2))
    tomb = h.row()
    assert tomb.tombstoned and tomb.generation == 2
    command = f.create(image="other:2", providers=["aws"])
    decision = run(tomb, command)
    new = decision.state
    assert new is not None
    (event,) = decision.events
    assert isinstance(event, SandboxCreated)
    assert new.phase is P.PROVISIONING
    assert new.generation == event.generation == tomb.generation + 1
    assert new.version == event.version == tomb.version + 1
    assert new.sandbox_id != tomb.sandbox_id
    assert new.identity != tomb.identity
    assert new.spec.image == "other:2" and new.providers == ("aws",)
    assert new.exit_code is None and new.reason is None
    assert decision.outcome is not None and decision.outcome.accepted


# ---------------------------------------------------------------------------------------------
# expected_version


@pytest.mark.parametrize("command_type", list(COMMAND_TABLE))
def test_expected_version_mismatch_is_aborted(command_type: str) -> None:
    state = row_in(P.READY)  # a phase that rejects no command
    for wrong in (0, state.version - 1, state.version + 1):
        decision = run(state, command_for(command_type, expected_version=wrong))
        assert_unchanged(state, decision)
        assert decision.outcome is not None
        assert decision.outcome.code is Code.ABORTED
        assert decision.outcome.message == (
            f"expected version {wrong} but sandbox {f.KEY!r} is at version {state.version}"
        )
        assert decision.outcome.version == state.version


@pytest.mark.parametrize("command_type", list(COMMAND_TABLE))
def test_expected_version_match_is_accepted(command_type: str) -> None:
    state = row_in(P.READY, held=command_type == "ReleaseSandbox")
    decision = run(state, command_for(command_type, expected_version=state.version))
    assert decision.outcome is not None and decision.outcome.accepted
    admitted = COMMAND_TABLE[command_type][PHASE_COLUMNS.index(P.READY)] is Admission.ADMIT
    assert len(decision.events) == (1 if admitted else 0)


def test_expected_version_is_checked_before_idempotence_and_precondition() -> None:
    stopped = row_in(P.STOPPED)
    decision = run(stopped, f.stop(expected_version=stopped.version + 1))
    assert decision.outcome is not None and decision.outcome.code is Code.ABORTED
    deleting = row_in(P.DELETING)
    decision = run(deleting, f.start(expected_version=0))
    assert decision.outcome is not None and decision.outcome.code is Code.ABORTED
    decision = run(stopped, f.stop(expected_version=stopped.version))
    assert decision.outcome is not None and decision.outcome.accepted
    assert decision.disposition == "idempotent"


# ---------------------------------------------------------------------------------------------
# Providers


def test_providers_stay_sorted_and_unique() -> None:
    h = f.harness_in(P.READY, providers=())
    for provider in ("zeta", "alpha", "mid"):
        h.send(f.attach(provider=provider))
    assert h.row().providers == ("alpha", "mid", "zeta")
    version = h.row().version

    again = h.send(f.attach(provider="mid"))
    assert again.disposition == "idempotent" and again.events == ()
    assert again.outcome is not None and again.outcome.accepted
    assert again.outcome.message == "nothing to do: provider 'mid' is already attached"
    assert h.row().version == version

    gone = h.send(f.detach(provider="alpha", restart=False))
    assert isinstance(gone.events[0], ProviderDetached)
    assert h.row().providers == ("mid", "zeta")
    again = h.send(f.detach(provider="alpha"))
    assert again.disposition == "idempotent" and again.events == ()
    assert again.outcome is not None
    assert again.outcome.message == "nothing to do: provider 'alpha' is already detached"
    assert h.row().version == version + 1


def test_providers_survive_restart_and_stop() -> None:
    h = f.harness_in(P.READY, providers=("b", "a"))
    h.send(f.restart(), f.running(generation=2), f.stop(), f.stopped(generation=2))
    assert h.row().providers == ("a", "b")


# ---------------------------------------------------------------------------------------------
# The observation table, cell by cell (observations of the current generation)

OBS_CELLS = [
    pytest.param(phase, kind, id=f"{phase.value}-{kind}")
    for phase in PHASE_COLUMNS
    for kind in KINDS
]


def test_observation_table_covers_every_live_phase() -> None:
    assert set(OBSERVATION_TABLE) == set(PHASE_COLUMNS)
    for transitions in OBSERVATION_TABLE.values():
        assert set(transitions) <= set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_observation_kind_round_trips_through_the_factory(kind: ObservationKind) -> None:
    assert observation_kind(f.observation_of_kind(kind)) == kind


@pytest.mark.parametrize(("phase", "kind"), OBS_CELLS)
def test_observation_cell(phase: Phase, kind: ObservationKind) -> None:
    target = OBSERVATION_TABLE[phase].get(kind)
    observed_values: tuple[ObservedState | None, ...] = (
        OBSERVED if target in (KEEP_STOPPING, KEEP_DELETING, FOLLOW_OBSERVED) else (None,)
    )
    for observed in observed_values:
        state = row_in(phase)
        obs = f.observation_of_kind(  # newer than the row (an older "running" comes late)
            kind, generation=state.generation, observed=observed, occurred_at=f.at(60)
        )
        decision = run(state, obs)
        assert decision.outcome is None
        if target is None:
            assert decision.disposition == "ignored"
            assert_unchanged(state, decision)
            assert decision.reason.startswith(f"no effect in phase {phase.value}: ")
            continue
        assert decision.disposition == "applied"
        (event,) = decision.events
        new = decision.state
        assert new is not None
        assert new.version == event.version == state.version + 1
        assert new.generation == event.generation == state.generation
        assert new.sandbox_id == state.sandbox_id and new.identity == state.identity
        if target == KEEP_DELETING:
            # Whatever the backend looked like: the delete stays decided, its deadline kept.
            assert isinstance(event, SandboxOperationFailed)
            assert (new.phase, event.phase, event.operation) == (P.DELETING,) * 2 + ("delete",)
            assert new.deadline == state.deadline is not None
            assert new.reason == event.reason
            assert event.reason.startswith("DeleteFailed: still Deleting (retries so far: 0; ")
            assert event.reason.endswith(": boom")
        elif target == KEEP_STOPPING:
            # A decided stop is never undone: only a runtime seen not running ends it.
            assert isinstance(event, SandboxOperationFailed)
            assert (event.operation, new.phase) == ("stop", event.phase)
            if observed in ("created", "exited", "absent"):
                assert new.phase is P.STOPPED and event.reason == "boom"
                assert new.deadline is None
            else:  # running, or not seen
                assert new.phase is P.STOPPING
                assert new.deadline is not None and new.deadline.kind == "stop"
                assert new.deadline.attempt == 0
                assert new.deadline == event.deadline != state.deadline
                assert new.reason == event.reason
                assert event.reason.startswith("StopFailed: still Stopping (retries so far: 0; ")
                assert event.reason.endswith(": boom")
        elif target == FOLLOW_OBSERVED:
            expected_phase = _follow(observed)
            assert isinstance(event, SandboxOperationFailed)
            assert event.operation == "suspend" and event.reason == "boom"
            assert new.phase is event.phase is expected_phase
        else:
            assert new.phase is target
            assert isinstance(event, TARGET_EVENT[target])


def _follow(observed: ObservedState | None) -> Phase:
    """Where a failed suspend leaves the row, given what the backend looked like (the
    runtime not running: suspended, the workspace kept)."""
    return {
        None: P.ERROR,
        "running": P.READY,
        "created": P.SUSPENDED,
        "exited": P.SUSPENDED,
        "absent": P.SUSPENDED,
    }[observed]


@pytest.mark.parametrize(
    ("phase", "kind", "expected"),
    [
        (P.STOPPED, "running", None),
        (P.STOPPED, "exited_ok", None),
        (P.STOPPED, "exited_error", None),
        (P.STOPPED, "removed", None),
        (P.STOPPED, "created", None),
        (P.DELETING, "running", None),
        (P.DELETING, "exited_ok", None),
        (P.DELETING, "stop_succeeded", None),
        (P.DELETING, "removed", None),
        (P.DELETING, "delete_succeeded", P.DELETED),
        (P.DELETING, "delete_absent", P.DELETED),
        (P.STOPPING, "running", None),
        (P.STOPPING, "stop_absent", P.STOPPED),
        (P.PROVISIONING, "running", P.READY),
        (P.ERROR, "running", P.READY),
    ],
)
def test_observation_cells_the_scenarios_rely_on(
    phase: Phase, kind: ObservationKind, expected: Phase | None
) -> None:
    assert OBSERVATION_TABLE[phase].get(kind) is expected


def test_failure_reasons_and_exit_codes() -> None:
    decision = run(row_in(P.READY), f.exited(exit_code=137))
    assert isinstance(decision.events[0], SandboxFailed)
    assert decision.state is not None
    assert (decision.state.reason, decision.state.exit_code) == (
        "runtime exited with code 137",
        137,
    )

    decision = run(row_in(P.READY), f.removed())
    assert (
        decision.state is not None and decision.state.reason == "runtime removed outside sandstream"
    )

    decision = run(row_in(P.PROVISIONING), f.failed(reason="image pull failed"))
    assert decision.state is not None and decision.state.reason == "image pull failed"

    decision = run(row_in(P.PROVISIONING), f.exited(exit_code=0))
    assert isinstance(decision.events[0], SandboxCompleted)
    assert decision.state is not None and decision.state.exit_code == 0

    # Back to Ready clears the failure.
    error = row_in(P.ERROR)
    decision = run(error, f.running(generation=error.generation, occurred_at=f.at(60)))
    assert decision.state is not None
    assert (decision.state.exit_code, decision.state.reason) == (None, None)


# ---------------------------------------------------------------------------------------------
# Observations that are ignored before the table


@pytest.mark.parametrize("kind", KINDS)
def test_stale_generation_is_ignored(kind: ObservationKind) -> None:
    state = row_in(P.STARTING)  # generation 2
    decision = run(state, f.observation_of_kind(kind, generation=1, observed="absent"))
    assert_unchanged(state, decision)
    assert decision.disposition == "ignored"
    assert decision.reason.startswith("stale: ")
    assert decision.reason.endswith("of generation 1, current generation is 2")


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_generation_is_ignored(kind: ObservationKind) -> None:
    state = row_in(P.READY)
    decision = run(state, f.observation_of_kind(kind, generation=2, observed="absent"))
    assert_unchanged(state, decision)
    assert decision.disposition == "ignored"
    assert decision.reason.startswith("unknown generation: ")
    assert decision.reason.endswith("newest issued is 1")


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_key_is_ignored(kind: ObservationKind) -> None:
    decision = run(None, f.observation_of_kind(kind, key="nobody"))
    assert decision.state is None and decision.events == ()
    assert decision.disposition == "ignored"
    assert decision.reason.startswith("unknown sandbox: ")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("generation", [1, 2])
def test_tombstoned_key_is_ignored(kind: ObservationKind, generation: int) -> None:
    state = row_in(P.DELETED)
    decision = run(state, f.observation_of_kind(kind, generation=generation, observed="running"))
    assert_unchanged(state, decision)
    assert decision.disposition == "ignored"
    assert decision.reason.startswith("tombstoned at generation 1: ")


# ---------------------------------------------------------------------------------------------
# Determinism and event metadata


def test_decide_is_deterministic_and_events_carry_their_cause() -> None:
    state = row_in(P.STOPPED)
    command = f.start(actor="bob", occurred_at=f.at(42))
    cause = f.Causes(partition=3, start=9)(command)
    first = decide(state, command, cause)
    second = decide(state, command, cause)
    assert first == second
    assert [e.model_dump() for e in first.events] == [e.model_dump() for e in second.events]
    (event,) = first.events
    assert event.event_id == event_id_for(cause)
    assert event.cause == cause
    assert (event.actor, event.occurred_at, event.key) == ("bob", f.at(42), f.KEY)
    assert first.state is not None and first.state.updated_at == f.at(42)
