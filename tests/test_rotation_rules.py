"""The rotation rules of the pure core: ``projections.credentials`` (baseline or rotation, the
receipt, command ids) and the RotateCredentials row of ``projections.lifecycle``.

Property tests: for any applied and desired fingerprints the classification is exact; a
rotation restarts exactly the attached sandboxes the table calls running, once each, however
many of their providers rotate together; a redelivered command (same id) restarts nothing more;
the receipt predicts exactly what the fold decides.
"""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import NAMESPACE_URL, UUID, uuid4, uuid5

import factories as f
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.codec import COMMANDS, decode, encode
from events.commands import ProviderRotation, RotateCredentials
from events.common import Phase
from events.decided import AgentRestarted, AgentRestartFailed, AgentRestartSkipped
from projections.credentials import classify, plan, rotation_command_id
from projections.lifecycle import (
    HELD,
    NO_RESTART,
    OWED_PHASES,
    RESTART,
    RESTART_PENDING,
    ROTATION_TABLE,
    Decision,
    rotation_action,
)

P = Phase
RUNNING = {P.PROVISIONING, P.STARTING, P.READY}
PENDING = {P.PROVISIONING, P.STARTING}  # a launch of the current generation is pending
LIVE = [p for p in Phase if p is not P.DELETED]


# Each provider's incarnation (one per name here: nothing is deleted and created again).
INCARNATIONS = {p: uuid5(NAMESPACE_URL, p) for p in ("p", "q", "r")}


def rotate(key: str, rotations: dict[str, int], restart: bool = True) -> RotateCredentials:
    return RotateCredentials(
        type="RotateCredentials",
        command_id=rotation_command_id(key, rotations, INCARNATIONS),
        key=key,
        occurred_at=datetime(2026, 1, 1, tzinfo=UTC),
        actor="test",
        rotations=[ProviderRotation(provider=p, revision=r) for p, r in sorted(rotations.items())],
        restart=restart,
    )


fingerprints = st.dictionaries(
    st.sampled_from(["A", "B", "C", "D"]), st.sampled_from(["f1", "f2", "f3"]), max_size=4
)


@given(applied=fingerprints, desired=fingerprints)
def test_classify_is_exact_per_key(applied: dict[str, str], desired: dict[str, str]) -> None:
    change = classify("p", applied, desired)
    assert set(change.of("baseline")) == set(desired) - set(applied)
    assert set(change.of("removed")) == set(applied) - set(desired)
    assert set(change.of("rotated")) == {
        k for k in applied if k in desired and applied[k] != desired[k]
    }
    assert set(change.of("unchanged")) == {k for k in applied if desired.get(k) == applied[k]}
    assert change.rotated == bool(change.of("rotated") or change.of("removed"))


def test_first_values_are_a_baseline_and_the_same_values_change_nothing() -> None:
    first = classify("p", {}, {"KEY": "f1"})
    assert first.of("baseline") == ["KEY"] and first.changed and not first.rotated
    same = classify("p", {"KEY": "f1"}, {"KEY": "f1"})
    assert not same.changed and not same.rotated


def test_the_rotation_table_restarts_ready_and_defers_to_a_pending_launch() -> None:
    assert {p for p, action in ROTATION_TABLE.items() if action == RESTART} == {P.READY}
    assert {p for p, action in ROTATION_TABLE.items() if action == RESTART_PENDING} == PENDING
    assert set(ROTATION_TABLE) == set(LIVE)


@pytest.mark.parametrize("phase", LIVE, ids=lambda p: p.value)
def test_a_rotation_in_each_phase(phase: Phase) -> None:
    h = f.harness_in(phase, providers=["p"])
    before = h.row()
    decision = h.send(rotate(f.KEY, {"p": 2}))
    assert decision.disposition == "applied" and decision.outcome is not None
    (event,) = decision.events
    if phase is P.READY:
        assert isinstance(event, AgentRestarted)
        assert h.row().generation == before.generation + 1 and h.row().phase is P.STARTING
        assert event.providers == ["p"]
    else:
        assert isinstance(event, AgentRestartSkipped)
        assert event.reason == ROTATION_TABLE[phase]
        assert (h.row().phase, h.row().generation) == (phase, before.generation)
        assert h.row().version == before.version + 1
        assert event.awaits == ({"p": 2} if phase in OWED_PHASES else {})
        assert h.row().awaited == event.awaits


@pytest.mark.parametrize("phase", LIVE, ids=lambda p: p.value)
def test_no_restart_restarts_nothing_in_any_phase(phase: Phase) -> None:
    h = f.harness_in(phase, providers=["p"])
    generation = h.row().generation
    (event,) = h.send(rotate(f.KEY, {"p": 2}, restart=False)).events
    assert isinstance(event, AgentRestartSkipped) and event.reason == NO_RESTART
    assert h.row().generation == generation


def test_a_rotation_of_providers_not_attached_changes_nothing() -> None:
    h = f.harness_in(P.READY, providers=["p"])
    version = h.row().version
    decision = h.send(rotate(f.KEY, {"q": 5}))
    assert decision.disposition == "idempotent" and decision.events == ()
    assert h.row().version == version


def test_a_failed_launch_of_a_rotation_restart_is_agent_restart_failed() -> None:
    h = f.harness_in(P.READY, providers=["p"])
    h.send(rotate(f.KEY, {"p": 2}))
    (event,) = h.send(f.failed(f.KEY, 2, "launch")).events
    assert isinstance(event, AgentRestartFailed)
    assert h.row().phase is P.ERROR and h.row().reason == event.reason


def test_a_restart_that_becomes_ready_clears_the_rotation_reason() -> None:
    h = f.harness_in(P.READY, providers=["p"])
    h.send(rotate(f.KEY, {"p": 2}))
    assert h.row().reason and "p" in h.row().reason
    h.send(f.launched(f.KEY, 2))
    assert (h.row().phase, h.row().reason) == (P.READY, None)


def test_the_rotate_command_round_trips_through_the_codec() -> None:
    command = rotate(f.KEY, {"p": 2, "q": 7})
    assert decode(COMMANDS, encode(command)) == command


def test_command_ids_are_deterministic_and_distinct_per_revision_and_incarnation() -> None:
    def rid(sandbox: str, rotations: dict[str, int], inc: dict[str, UUID] = INCARNATIONS) -> str:
        return rotation_command_id(sandbox, rotations, inc)

    assert rid("a", {"p": 1, "q": 2}) == rid("a", {"q": 2, "p": 1})
    assert rid("a", {"p": 1}) != rid("a", {"p": 2})
    assert rid("a", {"p": 1}) != rid("b", {"p": 1})
    # A provider deleted and created again starts at revision 1 again: its ids are new.
    assert rid("a", {"p": 2}) != rid("a", {"p": 2}, {"p": uuid4()})


sandboxes = st.lists(
    st.tuples(
        st.sampled_from(LIVE),
        st.sets(st.sampled_from(["p", "q", "r"]), max_size=3),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(
    boxes=sandboxes,
    rotated=st.dictionaries(st.sampled_from(["p", "q", "r"]), st.integers(1, 9), min_size=1),
    restart=st.booleans(),
    redeliver=st.booleans(),
)
def test_a_rotation_restarts_each_running_attached_sandbox_exactly_once(
    boxes: list[tuple[Phase, set[str]]], rotated: dict[str, int], restart: bool, redeliver: bool
) -> None:
    h = f.Harness()
    for i, (phase, attached) in enumerate(boxes):
        for message in f.path_to(phase, f"sb-{i}", providers=sorted(attached)):
            h.send(message)
    rows = [h.row(f"sb-{i}") for i in range(len(boxes))]
    receipt = plan(rotated, rows, restart, INCARNATIONS)
    before = {r.key: r for r in rows}
    commands = [rotate(line.sandbox, {p: rotated[p] for p in line.providers}, restart)
                for line in receipt]  # fmt: skip
    for command in commands + (commands if redeliver else []):
        h.send(command)

    expected_lines = {r.key for r in rows if set(r.providers) & set(rotated)}
    assert {line.sandbox for line in receipt} == expected_lines
    for line in receipt:
        row = before[line.sandbox]
        restarted = [e for e in h.events(line.sandbox) if isinstance(e, AgentRestarted)]
        skipped = [e for e in h.events(line.sandbox) if isinstance(e, AgentRestartSkipped)]
        should = restart and row.phase is P.READY
        assert (line.action == "restart") == should
        assert len(restarted) == (1 if should else 0)
        assert len(skipped) == (0 if should else 1)
        assert line.command_id == commands[receipt.index(line)].command_id
        assert set(line.providers) == set(row.providers) & set(rotated)
        if not should:
            assert skipped[0].reason == rotation_action(row, restart)
            assert h.row(line.sandbox).generation == row.generation
    for key in before.keys() - expected_lines:
        assert h.row(key) == before[key]
    # The rows rebuilt from the events alone agree with the folded ones.
    assert h.rebuilt() == {k: v for k, v in h.states.items() if v is not None}


def test_a_held_sandbox_is_skipped_and_restarts_again_once_released() -> None:
    h = f.harness_in(P.READY, providers=["p"])
    h.send(f.hold(key=f.KEY))
    (event,) = h.send(rotate(f.KEY, {"p": 2})).events
    assert isinstance(event, AgentRestartSkipped) and event.reason == HELD
    assert plan({"p": 2}, [h.row()], True, INCARNATIONS)[0].reason == HELD
    assert h.row().generation == 1
    h.send(f.release(key=f.KEY))
    (event,) = h.send(rotate(f.KEY, {"p": 3})).events
    assert isinstance(event, AgentRestarted) and h.row().generation == 2


# ---------------------------------------------------------------------------------------------
# Restart once, also across separate updates: a rotation decided while a launch is pending is
# awaited; the launch's report of the revisions it read decides whether the agent restarts
# once more (it read an older value) or not (it read the newest).


def test_a_second_rotation_while_the_restart_is_pending_restarts_nothing_more() -> None:
    h = f.harness_in(P.READY, providers=["p", "q"])
    (restarted,) = h.send(rotate(f.KEY, {"p": 2})).events
    assert isinstance(restarted, AgentRestarted) and h.row().generation == 2
    (skipped,) = h.send(rotate(f.KEY, {"q": 2})).events
    assert isinstance(skipped, AgentRestartSkipped) and skipped.reason == RESTART_PENDING
    assert h.row().awaited == {"q": 2}
    # The pending launch read both new values: Ready, and no second restart.
    decision = h.send(f.launched(f.KEY, 2, credentials={"p": 2, "q": 2}))
    assert [e.type for e in decision.events] == ["SandboxReady"]
    assert (h.row().phase, h.row().generation, h.row().awaited) == (P.READY, 2, {})


def test_a_pending_launch_that_read_the_older_value_restarts_once_more() -> None:
    h = f.harness_in(P.READY, providers=["p", "q"])
    h.send(rotate(f.KEY, {"p": 2}), rotate(f.KEY, {"q": 3}))
    decision = h.send(f.launched(f.KEY, 2, credentials={"p": 2, "q": 2}))
    ready, again = decision.events
    assert (ready.type, again.type) == ("SandboxReady", "AgentRestarted")
    assert isinstance(again, AgentRestarted) and again.providers == ["q"]
    assert (h.row().phase, h.row().generation, h.row().awaited) == (P.STARTING, 3, {})
    # Its launch reads after every rotation was stored: nothing awaited, Ready.
    assert [e.type for e in h.send(f.launched(f.KEY, 3)).events] == ["SandboxReady"]


def test_an_unknown_read_restarts_and_a_running_snapshot_waits_for_the_report() -> None:
    h = f.harness_in(P.READY, providers=["p"])
    h.send(rotate(f.KEY, {"p": 2}), rotate(f.KEY, {"p": 3}))
    assert h.send(f.running(f.KEY, 2)).disposition == "ignored"
    assert h.row().phase is P.STARTING
    # A launch whose values are unknown (an adopted runtime) may have read anything.
    decision = h.send(f.launched(f.KEY, 2, credentials=None))
    assert [e.type for e in decision.events] == ["SandboxReady", "AgentRestarted"]


def test_a_detached_provider_is_no_longer_awaited() -> None:
    h = f.harness_in(P.READY, providers=["p", "q"])
    h.send(rotate(f.KEY, {"p": 2}), rotate(f.KEY, {"q": 2}), f.detach(f.KEY, provider="q"))
    decision = h.send(f.launched(f.KEY, 2, credentials={"p": 2}))
    assert [e.type for e in decision.events] == ["SandboxReady"]


def test_a_failed_pending_launch_keeps_what_it_awaited_until_the_next_start() -> None:
    h = f.harness_in(P.READY, providers=["p"])
    h.send(rotate(f.KEY, {"p": 2}), rotate(f.KEY, {"p": 3}))
    h.send(f.failed(f.KEY, 2, "launch"))
    assert (h.row().phase, h.row().awaited) == (P.ERROR, {"p": 3})
    h.send(f.start(f.KEY))  # a new generation's launch reads the newest values
    assert (h.row().phase, h.row().generation, h.row().awaited) == (P.STARTING, 3, {})


def lift_to_ready(h: f.Harness, phase: Phase) -> Decision:
    """What makes a generation in ``phase`` (Error) Ready again without a launch report: a
    running snapshot dated after the exit that made it Error (one no newer comes late and
    lifts nothing). (A failed stop that finds the runtime running stays Stopping.)"""
    assert phase is P.ERROR
    return h.send(f.running(f.KEY, h.row().generation, occurred_at=f.at(60)))


@pytest.mark.parametrize("phase", [P.ERROR], ids=lambda p: p.value)
@pytest.mark.parametrize("held", [False, True], ids=["free", "held"])
def test_a_rotation_deferred_in_error_restarts_a_generation_seen_running_again(
    phase: Phase, held: bool
) -> None:
    """Regression (found by the property test once it sent rotations): a rotation skipped in
    Error or Stopping ("the new values apply at its next start") was forgotten, and the same
    generation lifted to Ready (a running snapshot in Error, a failed stop finding it running)
    ran on the rotated value. Now the rotation is awaited in those phases too, and that Ready
    restarts at once onto the newest values (skipped, saying so, while held)."""
    h = f.harness_in(phase, providers=["p"])
    before = h.row()
    (skipped,) = h.send(rotate(f.KEY, {"p": 2})).events
    assert isinstance(skipped, AgentRestartSkipped) and skipped.reason == ROTATION_TABLE[phase]
    assert h.row().awaited == {"p": 2}
    if held:
        h.send(f.hold(f.KEY))
    d = lift_to_ready(h, phase)
    if held:
        assert isinstance(d.events[-1], AgentRestartSkipped) and d.events[-1].reason == HELD
        assert (h.row().phase, h.row().generation) == (P.READY, before.generation)
    else:
        assert isinstance(d.events[-1], AgentRestarted) and d.events[-1].providers == ["p"]
        assert (h.row().phase, h.row().generation) == (P.STARTING, before.generation + 1)
    assert h.row().awaited == {}
    assert h.rebuilt() == {f.KEY: h.row()}


@pytest.mark.parametrize("phase", [P.ERROR], ids=lambda p: p.value)
def test_a_detach_in_error_restarts_a_generation_seen_running_again(
    phase: Phase,
) -> None:
    """The same for a detached provider: the generation seen running again may hold its values
    (what it read is unknown), so it restarts at once without it."""
    h = f.harness_in(phase, providers=["p", "q"])
    (detached,) = h.send(f.detach(f.KEY, provider="q")).events
    assert detached.type == "ProviderDetached" and h.row().awaited == {"q": 0}
    d = lift_to_ready(h, phase)
    restarted = d.events[-1]
    assert isinstance(restarted, AgentRestarted) and restarted.detached == ["q"]
    assert h.row().providers == ("p",) and h.row().phase is P.STARTING


# One sandbox attached to p, q, r, Ready at first. Updates rotate some providers (each bumps
# their stored revision, then the command is decided); a pending launch reads the stored
# revisions at some point after its restart was decided and reports them later.
Step = tuple[str, frozenset[str]]  # ("rotate", providers) | ("read", ∅) | ("report", ∅)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("rotate"), st.frozensets(st.sampled_from(["p", "q", "r"]), min_size=1)),
        st.tuples(st.sampled_from(["read", "report"]), st.just(frozenset[str]())),
    ),
    max_size=14,
)


@settings(max_examples=300, deadline=None)
@given(script=steps, attached=st.sets(st.sampled_from(["p", "q", "r"]), min_size=1))
def test_the_agent_ends_on_the_newest_values_and_restarts_only_when_it_must(
    script: list[Step], attached: set[str]
) -> None:
    h = f.harness_in(P.READY, providers=sorted(attached))
    stored = {p: 1 for p in "pqr"}  # the revision in PostgreSQL
    launch: dict[str, int] | None = None  # what the pending launch read (None: not yet)
    pending = False
    missed = False  # a rotation of an attached provider was stored after the read
    expected = 0  # restarts the model requires

    def decided(events: tuple[object, ...]) -> None:
        nonlocal pending, launch, missed
        if any(isinstance(e, AgentRestarted) for e in events):
            pending, launch, missed = True, None, False

    def report() -> None:
        nonlocal pending, expected
        assert launch is not None
        if missed:
            expected += 1  # it read an older value of a rotation decided while pending
        pending = False
        decided(h.send(f.launched(f.KEY, h.row().generation, credentials=launch)).events)

    for kind, providers in script + [("read", frozenset()), ("report", frozenset())] * 3:
        if kind == "rotate":
            for p in providers:
                stored[p] += 1
            mine = providers & attached
            if mine and pending and launch is not None:
                missed = True
            if mine and not pending:
                expected += 1  # Ready: a rotation of what it runs restarts it
            decided(h.send(rotate(f.KEY, {p: stored[p] for p in providers})).events)
        elif kind == "read" and pending and launch is None:
            launch = {p: stored[p] for p in attached}
        elif kind == "report" and pending and launch is not None:
            report()

    restarts = [e for e in h.events(f.KEY) if isinstance(e, AgentRestarted)]
    assert len(restarts) == expected
    assert h.row().phase is P.READY and not pending and h.row().awaited == {}
    # The agent runs the newest value of every attached provider.
    final = launch if launch is not None else {p: 1 for p in attached}
    assert all(final[p] == stored[p] for p in attached), (final, stored)
    assert h.rebuilt() == {k: v for k, v in h.states.items() if v is not None}


def test_a_hold_made_while_the_launch_was_pending_keeps_the_stale_report_from_restarting() -> None:
    h = f.harness_in(P.READY, providers=["p"])
    h.send(rotate(f.KEY, {"p": 2}), rotate(f.KEY, {"p": 3}), f.hold(key=f.KEY))
    decision = h.send(f.launched(f.KEY, 2, credentials={"p": 2}))
    ready, skipped = decision.events
    assert ready.type == "SandboxReady"
    assert isinstance(skipped, AgentRestartSkipped) and skipped.reason == HELD
    assert (h.row().phase, h.row().generation) == (P.READY, 2)
