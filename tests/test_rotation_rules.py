"""The rotation rules of the pure core: ``projections.credentials`` (baseline or rotation, the
receipt, command ids) and the RotateCredentials row of ``projections.lifecycle``.

Property tests: for any applied and desired fingerprints the classification is exact; a
rotation restarts exactly the attached sandboxes the table calls running, once each, however
many of their providers rotate together; a redelivered command (same id) restarts nothing more;
the receipt predicts exactly what the fold decides.
"""

from __future__ import annotations

from datetime import UTC, datetime

import factories as f
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.codec import COMMANDS, decode, encode
from events.commands import ProviderRotation, RotateCredentials
from events.common import Phase
from events.decided import AgentRestarted, AgentRestartFailed, AgentRestartSkipped
from projections.credentials import classify, plan, rotation_command_id
from projections.lifecycle import HELD, NO_RESTART, RESTART, ROTATION_TABLE, rotation_action

P = Phase
RUNNING = {P.PROVISIONING, P.STARTING, P.READY}
LIVE = [p for p in Phase if p is not P.DELETED]


def rotate(key: str, rotations: dict[str, int], restart: bool = True) -> RotateCredentials:
    return RotateCredentials(
        type="RotateCredentials",
        command_id=rotation_command_id(key, rotations),
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


def test_the_rotation_table_restarts_only_running_phases() -> None:
    assert {p for p, action in ROTATION_TABLE.items() if action == RESTART} == RUNNING
    assert set(ROTATION_TABLE) == set(LIVE)


@pytest.mark.parametrize("phase", LIVE, ids=lambda p: p.value)
def test_a_rotation_in_each_phase(phase: Phase) -> None:
    h = f.harness_in(phase, providers=["p"])
    before = h.row()
    decision = h.send(rotate(f.KEY, {"p": 2}))
    assert decision.disposition == "applied" and decision.outcome is not None
    (event,) = decision.events
    if phase in RUNNING:
        assert isinstance(event, AgentRestarted)
        assert h.row().generation == before.generation + 1 and h.row().phase is P.STARTING
        assert event.providers == ["p"]
    else:
        assert isinstance(event, AgentRestartSkipped)
        assert event.reason == ROTATION_TABLE[phase]
        assert (h.row().phase, h.row().generation) == (phase, before.generation)
        assert h.row().version == before.version + 1


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


def test_command_ids_are_deterministic_and_distinct_per_revision() -> None:
    assert rotation_command_id("a", {"p": 1, "q": 2}) == rotation_command_id("a", {"q": 2, "p": 1})
    assert rotation_command_id("a", {"p": 1}) != rotation_command_id("a", {"p": 2})
    assert rotation_command_id("a", {"p": 1}) != rotation_command_id("b", {"p": 1})


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
    receipt = plan(rotated, rows, restart)
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
        should = restart and row.phase in RUNNING
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
    assert plan({"p": 2}, [h.row()], True)[0].reason == HELD
    assert h.row().generation == 1
    h.send(f.release(key=f.KEY))
    (event,) = h.send(rotate(f.KEY, {"p": 3})).events
    assert isinstance(event, AgentRestarted) and h.row().generation == 2
