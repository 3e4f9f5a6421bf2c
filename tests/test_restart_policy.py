"""The restart policy in the pure core (spec.restart_policy): scheduled restarts with a back-off,
the limit, the reset after a stable run, what cancels a scheduled restart; and a property test
of random runs against an independent model of the policy. Time comes only from the messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import factories as f
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.common import Phase, RestartBackoff, RestartPolicy, SandboxSpec
from events.decided import (
    SandboxRestartScheduled,
    SandboxRestartsExhausted,
    SandboxStarting,
)
from projections.lifecycle import (
    DEFAULT_LIMITS,
    EXIT_KINDS,
    PENDING_RESTART_TABLE,
    RESTART_POLICY_TABLE,
    Decision,
    restarts_on,
)
from services.scheduler.scheduler import deadline_due

P = Phase
RESET = DEFAULT_LIMITS.restart_reset_seconds


def policy_spec(
    policy: RestartPolicy | None,
    initial: float = 1.0,
    maximum: float = 8.0,
    max_restarts: int | None = None,
) -> SandboxSpec:
    return SandboxSpec(
        image=f.IMAGE,
        restart_policy=policy,
        restart_backoff=RestartBackoff(initial_seconds=initial, max_seconds=maximum),
        max_restarts=max_restarts,
    )


def created(spec: SandboxSpec, t: float = 0) -> f.Harness:
    h = f.Harness()
    h.send(f.create(sandbox_spec=spec, occurred_at=f.at(t)))
    return h


def due_restart(h: f.Harness, occurred_at: datetime | None = None) -> Decision:
    row = h.row()
    assert row.deadline is not None and row.deadline.kind == "restart", row
    return h.send(
        f.due(
            deadline="restart",
            due_at=row.deadline.due_at,
            generation=row.generation,
            occurred_at=occurred_at,
        )
    )


def test_never_is_the_default_and_serializes_as_before() -> None:
    spec = f.spec()
    assert spec.restart_policy is None
    assert "restart" not in spec.model_dump_json()
    h = created(spec)
    h.send(f.running(occurred_at=f.at(1)))
    d = h.send(f.exited(exit_code=1, occurred_at=f.at(2)))
    assert [e.type for e in d.events] == ["SandboxFailed"]
    assert (h.row().phase, h.row().deadline, h.row().restarts) == (P.ERROR, None, None)


def test_on_failure_restarts_with_doubling_delays_up_to_max_restarts() -> None:
    h = created(policy_spec("OnFailure", initial=1, maximum=3, max_restarts=3))
    dues, t = [], 1.0
    for generation in range(1, 5):
        h.send(f.running(generation=generation, occurred_at=f.at(t)))
        d = h.send(f.exited(generation=generation, exit_code=1, occurred_at=f.at(t + 1)))
        if generation == 4:
            assert [e.type for e in d.events] == ["SandboxFailed", "SandboxRestartsExhausted"]
            break
        assert "restart_policy OnFailure" in d.reason
        row = h.row()
        assert row.phase is P.ERROR and row.deadline is not None
        dues.append((row.deadline.due_at - f.at(t + 1)).total_seconds())
        started = due_restart(h)
        (event,) = started.events
        assert isinstance(event, SandboxStarting)
        assert (event.policy, event.attempt, event.generation) == (
            "OnFailure",
            generation,
            generation + 1,
        )
        assert "restart_policy OnFailure" in started.reason
        t = (row.deadline.due_at - f.T0).total_seconds() + 1
    assert dues == [1.0, 2.0, 3.0]  # doubling, capped at the maximum
    row = h.row()
    assert row.phase is P.ERROR and row.deadline is None
    assert row.reason is not None and row.reason.startswith("RestartLimit")
    assert "max_restarts 3" in row.reason and "exited with code 1" in row.reason
    assert row.restarts is not None and row.restarts.count == 3
    assert row.restarts.last_exit is not None and row.restarts.last_exit.exit_code == 1
    assert h.rebuilt() == {f.KEY: row}


@pytest.mark.parametrize(
    ("policy", "exit_code", "restarts"),
    [("OnFailure", 0, False), ("OnFailure", 2, True), ("Always", 0, True), ("Never", 2, False)],
)
def test_which_exits_each_policy_restarts_after(
    policy: RestartPolicy, exit_code: int, restarts: bool
) -> None:
    h = created(policy_spec(policy))
    h.send(f.running(occurred_at=f.at(1)))
    h.send(f.exited(exit_code=exit_code, occurred_at=f.at(2)))
    row = h.row()
    assert (row.deadline is not None) == restarts
    assert row.phase is (P.COMPLETED if exit_code == 0 else P.ERROR)


def test_a_vanished_runtime_a_failed_launch_and_a_launch_timeout_are_failures() -> None:
    h = created(policy_spec("OnFailure"))
    h.send(f.running(occurred_at=f.at(1)))
    h.send(f.removed(occurred_at=f.at(2)))
    assert h.row().deadline is not None and h.row().deadline.kind == "restart"  # type: ignore[union-attr]
    due_restart(h)
    h.send(f.failed(generation=2, reason="image gone", occurred_at=f.at(5)))
    row = h.row()
    assert row.deadline is not None and row.deadline.kind == "restart"
    assert row.restarts is not None and row.restarts.last_exit is not None
    assert row.restarts.last_exit.reason == "image gone"
    due_restart(h)
    launch = h.row().deadline
    assert launch is not None and launch.kind == "launch"
    d = h.send(f.due(deadline="launch", due_at=launch.due_at, generation=3))
    assert [e.type for e in d.events] == ["SandboxTimedOut", "SandboxRestartScheduled"]


# What each entry of PENDING_RESTART_TABLE sends while the restart waits (at 3 s), and the
# outcome it claims: True when the restart is kept.
PENDING_INPUTS: dict[str, list[tuple[Any, bool]]] = {
    "DeadlineDue(restart)": [],  # the restart itself: test_on_failure_restarts_with_...
    "StopSandbox": [(lambda: f.stop(occurred_at=f.at(3)), False)],
    "DeleteSandbox": [(lambda: f.delete(occurred_at=f.at(3)), False)],
    "StartSandbox, RestartSandbox": [
        (lambda: f.start(occurred_at=f.at(3)), False),
        (lambda: f.restart(occurred_at=f.at(3)), False),
    ],
    "HoldSandbox": [  # held, then released: the restart waited, and happens
        (lambda: [f.hold(occurred_at=f.at(3)), f.release(occurred_at=f.at(4))], True)
    ],
    "SetRestartPolicy": [
        (lambda: f.set_restart_policy(restart_policy="Always", occurred_at=f.at(3)), True),
        (lambda: f.set_restart_policy(restart_policy="Never", occurred_at=f.at(3)), False),
    ],
    "RotateCredentials": [(lambda: f.rotate(occurred_at=f.at(3)), True)],
    "DeadlineDue(ttl)": [(lambda: f.due(deadline="ttl", due_at=f.at(3)), False)],
    "the generation seen running": [(lambda: f.running(occurred_at=f.at(3)), False)],
}
PENDING_CASES = [
    pytest.param(what, make, kept, id=f"{what}-{i}-{'kept' if kept else 'cancelled'}")
    for what, inputs in PENDING_INPUTS.items()
    for i, (make, kept) in enumerate(inputs)
]


def test_every_entry_of_the_pending_restart_table_is_driven() -> None:
    assert set(PENDING_INPUTS) == set(PENDING_RESTART_TABLE)
    for what, inputs in PENDING_INPUTS.items():
        claims = {PENDING_RESTART_TABLE[what].startswith(w) for w in ("kept", "cancelled")}
        assert claims == {True, False} or "else cancelled" in PENDING_RESTART_TABLE[what], what
        for _, kept in inputs:
            claim = "kept" if kept else "cancelled"
            assert claim in PENDING_RESTART_TABLE[what], (what, claim)


@pytest.mark.parametrize(("what", "make", "kept"), PENDING_CASES)
def test_what_an_input_does_to_a_scheduled_restart(what: str, make: Any, kept: bool) -> None:
    h = f.Harness()
    spec = policy_spec("Always")
    h.send(f.create(sandbox_spec=spec, providers=["github"], ttl_seconds=3, occurred_at=f.at(0)))
    h.send(f.running(occurred_at=f.at(1)))
    h.send(f.exited(exit_code=1, occurred_at=f.at(2)))
    scheduled = h.row().deadline
    assert scheduled is not None and scheduled.kind == "restart"
    made = make()
    d = h.send(*made) if isinstance(made, list) else h.send(made)
    assert d.disposition == "applied", d.reason
    row = h.row()
    assert (row.deadline == scheduled) == kept, row
    if not kept and row.phase in (P.ERROR, P.COMPLETED):
        assert "restarts it at" not in (row.reason or "")
    late = h.send(f.due(deadline="restart", due_at=scheduled.due_at, generation=1))
    assert (late.disposition == "applied") == kept, late.reason


def test_a_repeated_due_restarts_once() -> None:
    h = created(policy_spec("OnFailure"))
    h.send(f.exited(exit_code=1, occurred_at=f.at(2)))
    first, again = due_restart(h), None
    deadline = h.steps[-2].decision.state.deadline  # type: ignore[union-attr]
    assert deadline is not None
    again = h.send(f.due(deadline="restart", due_at=deadline.due_at, generation=1))
    assert first.disposition == "applied" and again.disposition == "ignored"
    assert h.row().generation == 2


def test_ready_long_enough_resets_the_back_off() -> None:
    h = created(policy_spec("OnFailure", initial=1, maximum=100))
    h.send(f.exited(exit_code=1, occurred_at=f.at(1)))  # restart 1: 1 s
    due_restart(h)
    h.send(f.running(generation=2, occurred_at=f.at(3)))
    h.send(f.exited(generation=2, exit_code=1, occurred_at=f.at(4)))  # restart 2: 2 s
    assert h.row().deadline.due_at == f.at(6)  # type: ignore[union-attr]
    due_restart(h)
    h.send(f.running(generation=3, occurred_at=f.at(7)))
    d = h.send(f.exited(generation=3, exit_code=1, occurred_at=f.at(7 + RESET)))
    scheduled = d.events[-1]
    assert isinstance(scheduled, SandboxRestartScheduled) and scheduled.backoff_reset
    assert (scheduled.deadline.attempt, scheduled.deadline.due_at) == (1, f.at(8 + RESET))


def test_set_restart_policy_is_versioned_and_idempotent() -> None:
    h = created(policy_spec(None))
    d = h.send(f.set_restart_policy(restart_policy="OnFailure", expected_version=7))
    assert d.outcome is not None and d.outcome.code.value == "ABORTED"
    d = h.send(f.set_restart_policy(restart_policy="OnFailure", max_restarts=2, expected_version=1))
    assert d.disposition == "applied" and h.row().spec.max_restarts == 2
    d = h.send(f.set_restart_policy(restart_policy="OnFailure", max_restarts=2))
    assert d.disposition == "idempotent"


@pytest.mark.parametrize("due_while_held", [True, False], ids=["fell-due-held", "due-after"])
@pytest.mark.parametrize("held_before_exit", [False, True], ids=["held-after", "held-before"])
def test_a_hold_defers_a_scheduled_restart_until_the_release(
    held_before_exit: bool, due_while_held: bool
) -> None:
    """Regression: a hold cancelled the restart the policy scheduled (and an exit while held
    scheduled none), and the release scheduled nothing: under Always, a brief hold left the
    agent down for good. Now the restart waits: its DeadlineDue while held changes nothing,
    and after the release the next one (the scheduler sends it again) restarts it."""
    h = created(policy_spec("Always"))
    h.send(f.running(occurred_at=f.at(1)))
    if held_before_exit:
        h.send(f.hold(occurred_at=f.at(2)))
    d = h.send(f.exited(exit_code=1, occurred_at=f.at(2)))
    assert isinstance(d.events[-1], SandboxRestartScheduled)
    if not held_before_exit:
        h.send(f.hold(occurred_at=f.at(2)))
    row = h.row()
    scheduled = row.deadline
    assert scheduled is not None and scheduled.kind == "restart"
    assert row.reason is not None and "once released (held by" in row.reason
    if due_while_held:
        early = h.send(f.due(deadline="restart", due_at=scheduled.due_at, generation=1))
        assert early.disposition == "ignored" and "deferred until released" in early.reason
        assert h.row().deadline == scheduled and h.row().generation == 1
    h.send(f.release(occurred_at=f.at(20)))
    row = h.row()
    assert row.deadline == scheduled and row.reason is not None
    assert "restarts it at" in row.reason and "held" not in row.reason
    late = h.send(f.due(deadline="restart", due_at=scheduled.due_at, generation=1))
    assert late.disposition == "applied", late.reason
    started = late.events[0]
    assert isinstance(started, SandboxStarting) and started.policy == "Always"
    assert (h.row().phase, h.row().generation) == (P.STARTING, 2)
    assert h.rebuilt() == {f.KEY: h.row()}


# -- property: random runs against an independent model ------------------------------------------

EXITS = ("exited 0", "exited non-zero", "vanished", "launch failed", "launch timed out")
NEEDS_NO_READY = ("launch failed", "launch timed out")


@dataclass
class Model:
    """The policy as the issue states it, written apart from the core."""

    policy: str
    initial: float
    maximum: float
    max_restarts: int | None
    in_a_row: int = 0
    total: int = 0

    def after(self, exit_kind: str, ready_for: float | None) -> tuple[str, float | None]:
        """("restart", delay) | ("limit", None) | ("stay", None) for one exit."""
        failure = exit_kind != "exited 0"
        if self.policy == "Never" or (self.policy == "OnFailure" and not failure):
            return "stay", None
        if ready_for is not None and ready_for >= RESET:
            self.in_a_row = 0
        if self.max_restarts is not None and self.in_a_row >= self.max_restarts:
            return "limit", None
        self.in_a_row += 1
        self.total += 1
        return "restart", min(self.initial * 2 ** (self.in_a_row - 1), self.maximum)


def run_generation(
    h: f.Harness, generation: int, t: float, kind: str, ready: float | None
) -> float:
    """Drive one generation to its exit of ``kind``; the exit's time (seconds from T0)."""
    if kind in NEEDS_NO_READY:
        ready = None
    if ready is not None:
        h.send(f.running(generation=generation, occurred_at=f.at(t)))
        t += ready
    match kind:
        case "exited 0" | "exited non-zero":
            code = 0 if kind == "exited 0" else 1
            h.send(f.exited(generation=generation, exit_code=code, occurred_at=f.at(t)))
        case "vanished":
            h.send(f.removed(generation=generation, occurred_at=f.at(t)))
        case "launch failed":
            h.send(f.failed(generation=generation, occurred_at=f.at(t)))
        case "launch timed out":
            launch = h.row().deadline
            assert launch is not None and launch.kind == "launch"
            h.send(f.due(deadline="launch", due_at=launch.due_at, generation=generation))
            t = (launch.due_at - f.T0).total_seconds()
    return t


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["Never", "OnFailure", "Always"]),
    initial=st.sampled_from([0.5, 1.0, 3.0]),
    maximum=st.sampled_from([3.0, 10.0, 300.0]),
    max_restarts=st.none() | st.integers(0, 4),
    runs=st.lists(
        st.tuples(
            st.sampled_from(EXITS), st.none() | st.sampled_from([0.5, 60.0, RESET, RESET * 2])
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_random_runs_follow_the_model(
    policy: RestartPolicy,
    initial: float,
    maximum: float,
    max_restarts: int | None,
    runs: list[tuple[str, float | None]],
) -> None:
    model = Model(policy, initial, max(initial, maximum), max_restarts)
    spec = policy_spec(policy, initial, max(initial, maximum), max_restarts)
    h = created(spec)
    t = 0.0
    for generation, (kind, ready) in enumerate(runs, start=1):
        t = run_generation(h, generation, t + 1, kind, ready)
        expect, delay = model.after(kind, None if kind in NEEDS_NO_READY else ready)
        row = h.row()
        assert row.generation == generation
        if expect == "stay":
            assert row.deadline is None and row.phase in (P.ERROR, P.COMPLETED)
            assert row.reason is None or not row.reason.startswith("RestartLimit")
            break
        if expect == "limit":
            assert (row.phase, row.deadline) == (P.ERROR, None)
            assert row.reason is not None and row.reason.startswith("RestartLimit")
            assert isinstance(h.events()[-1], SandboxRestartsExhausted)
            break
        assert delay is not None and row.deadline is not None
        assert row.deadline.kind == "restart"
        assert row.deadline.due_at == f.at(t) + timedelta(seconds=delay)
        assert row.deadline.attempt == model.in_a_row
        started = due_restart(h)
        assert f"restart_policy {policy}" in started.reason
        t = (row.deadline.due_at - f.T0).total_seconds()
        assert h.row().restarts is not None and h.row().restarts.count == model.total  # type: ignore[union-attr]
    assert h.rebuilt() == {f.KEY: h.row()}
    history = [s.decision.reason for s in h.steps]
    restarts = [r for r in history if r.startswith("DeadlineDue(restart")]
    assert len(restarts) == model.total
    assert all(f"restart_policy {policy}" in r for r in restarts)


# -- review: the policy across the other features ------------------------------------------------


@pytest.mark.parametrize(
    ("restart", "types"),
    [
        (lambda at: f.rotate(occurred_at=at), ["AgentRestarted"]),
        (
            lambda at: f.detach(provider="github", occurred_at=at),
            ["ProviderDetached", "AgentRestarted"],
        ),
    ],
    ids=["rotation", "detach"],
)
def test_a_rotation_or_detach_restart_does_not_end_the_stable_run_that_resets_the_back_off(
    restart: Any, types: list[str]
) -> None:
    """A generation Ready for longer than the reset, then restarted for rotated credentials or
    a detached provider (sandstream's own restart, not a failure), then crashing soon after: the
    sandbox ran stable for long, so the crash is the first restart in a row again, not one past
    max_restarts."""
    h = f.Harness()
    spec = policy_spec("OnFailure", initial=1, maximum=100, max_restarts=1)
    h.send(f.create(sandbox_spec=spec, providers=["github"], occurred_at=f.at(0)))
    h.send(f.exited(exit_code=1, occurred_at=f.at(1)))  # restart 1 of at most 1
    due_restart(h)
    h.send(f.running(generation=2, occurred_at=f.at(3)))
    restarted = h.send(restart(f.at(3 + RESET + 60)))
    assert [e.type for e in restarted.events] == types
    h.send(f.running(generation=3, occurred_at=f.at(4 + RESET + 60)))
    d = h.send(f.exited(generation=3, exit_code=1, occurred_at=f.at(5 + RESET + 60)))
    scheduled = d.events[-1]
    assert isinstance(scheduled, SandboxRestartScheduled), d.reason
    assert scheduled.backoff_reset and scheduled.deadline.attempt == 1
    assert h.rebuilt() == {f.KEY: h.row()}


def test_a_generation_ready_briefly_after_a_rotation_restart_is_no_stable_run() -> None:
    h = f.Harness()
    spec = policy_spec("OnFailure", initial=1, maximum=100, max_restarts=1)
    h.send(f.create(sandbox_spec=spec, providers=["github"], occurred_at=f.at(0)))
    h.send(f.exited(exit_code=1, occurred_at=f.at(1)))
    due_restart(h)
    h.send(f.running(generation=2, occurred_at=f.at(3)))
    h.send(f.rotate(occurred_at=f.at(4)))
    h.send(f.running(generation=3, occurred_at=f.at(5)))
    d = h.send(f.exited(generation=3, exit_code=1, occurred_at=f.at(6)))
    assert isinstance(d.events[-1], SandboxRestartsExhausted)


@pytest.mark.parametrize(
    ("cancel", "why"),
    [
        (lambda: f.set_restart_policy(restart_policy="Never", occurred_at=f.at(3)), "Never"),
    ],
    ids=["never"],
)
def test_a_cancelled_restart_is_not_announced_in_the_reason(cancel: Any, why: str) -> None:
    h = created(policy_spec("OnFailure"))
    h.send(f.running(occurred_at=f.at(1)))
    h.send(f.exited(exit_code=3, occurred_at=f.at(2)))
    assert "restarts it at" in (h.row().reason or "")
    h.send(cancel())
    row = h.row()
    assert row.deadline is None
    assert row.reason is not None and "restarts it at" not in row.reason
    assert row.reason.startswith("runtime exited with code 3") and why in row.reason
    assert h.rebuilt() == {f.KEY: row}


def test_setting_on_failure_cancels_a_restart_scheduled_after_exit_0() -> None:
    """Always scheduled a restart after exit 0; the policy becomes OnFailure, which does not
    restart after exit 0: the restart must not happen (and never under OnFailure's name)."""
    h = created(policy_spec("Always"))
    h.send(f.running(occurred_at=f.at(1)))
    h.send(f.exited(exit_code=0, occurred_at=f.at(2)))
    scheduled = h.row().deadline
    assert scheduled is not None and scheduled.kind == "restart"
    h.send(f.set_restart_policy(restart_policy="OnFailure", occurred_at=f.at(2.5)))
    row = h.row()
    assert (row.phase, row.deadline) == (P.COMPLETED, None)
    assert row.reason is not None and "restart_policy OnFailure" in row.reason
    d = h.send(f.due(deadline="restart", due_at=scheduled.due_at, generation=1))
    assert (d.disposition, d.events) == ("ignored", ())


def test_setting_always_keeps_a_restart_scheduled_after_a_failure() -> None:
    h = created(policy_spec("OnFailure"))
    h.send(f.exited(exit_code=1, occurred_at=f.at(2)))
    h.send(f.set_restart_policy(restart_policy="Always", occurred_at=f.at(2.5)))
    started = due_restart(h)
    (event,) = started.events
    assert isinstance(event, SandboxStarting) and event.policy == "Always"


def test_lowering_max_restarts_below_a_pending_restart_cancels_it() -> None:
    h = created(policy_spec("OnFailure", max_restarts=5))
    for generation in (1, 2):
        h.send(f.exited(generation=generation, exit_code=1, occurred_at=f.at(10 * generation)))
        due_restart(h, occurred_at=f.at(10 * generation + 5))
    h.send(f.exited(generation=3, exit_code=1, occurred_at=f.at(30)))
    scheduled = h.row().deadline
    assert scheduled is not None and scheduled.attempt == 3
    h.send(f.set_restart_policy(max_restarts=2, occurred_at=f.at(31)))
    row = h.row()
    assert row.deadline is None
    assert row.reason is not None and "max_restarts 2" in row.reason
    d = h.send(f.due(deadline="restart", due_at=scheduled.due_at, generation=3))
    assert (d.disposition, d.events) == ("ignored", ())


def test_never_set_again_on_a_spec_that_names_never_is_idempotent() -> None:
    h = created(policy_spec("Never"))
    d = h.send(
        f.set_restart_policy(
            restart_policy="Never", restart_backoff=RestartBackoff(initial_seconds=1, max_seconds=8)
        )
    )
    assert d.disposition == "idempotent", d.reason


def test_two_schedulers_due_messages_for_one_restart_restart_it_once() -> None:
    """The scheduler's lease moves while a restart is due: the old and the new holder both
    publish its DeadlineDue (the same id, their own clocks). One restart, and its identity is
    the same whichever message came first."""
    identities = []
    for first, second in ((5.0, 5.5), (5.5, 5.0)):
        h = f.Harness()
        h.send(
            f.create(command_id="c1", sandbox_spec=policy_spec("OnFailure"), occurred_at=f.at(0))
        )
        h.send(f.exited(exit_code=1, occurred_at=f.at(2)))
        row = h.row()
        assert row.deadline is not None
        due_at, version = row.deadline.due_at, row.version
        messages = [
            deadline_due(f.KEY, 1, version, "restart", due_at, f.at(t)) for t in (first, second)
        ]
        a, b = h.send(messages[0]), h.send(messages[1])
        assert (a.disposition, b.disposition, b.events) == ("applied", "ignored", ())
        assert h.row().generation == 2
        identities.append(h.row().identity)
    assert identities[0] == identities[1]


def test_the_failure_kinds_share_each_policy_row() -> None:
    """A policy change judges a pending restart by the phase it waits in (Completed: after exit
    0; Error: after a failure), which holds while every failure kind restarts alike."""
    failures = [k for k in EXIT_KINDS if k != "exited 0"]
    for policy in RESTART_POLICY_TABLE:
        assert len({restarts_on(policy, k) for k in failures}) == 1


@pytest.mark.parametrize(
    ("policy", "types"),
    [
        ("OnFailure", ["AgentRestartFailed", "SandboxRestartsExhausted", "SandboxDeleting"]),
        ("Always", ["AgentRestartFailed", "SandboxRestartsExhausted", "SandboxDeleting"]),
        ("Never", ["AgentRestartFailed"]),
        (None, ["AgentRestartFailed"]),
    ],
)
def test_a_failed_rotation_restart_meets_the_completion_policy_only_at_the_restart_limit(
    policy: RestartPolicy | None, types: list[str]
) -> None:
    """Found by the lifecycle property test, whose invariant had not followed the restart
    policy: a failed launch of a rotation restart (AgentRestartFailed) is no exit the
    completion policy acts on by itself; reaching the restart limit is (docs/state-machine.md)."""
    spec = SandboxSpec(image=f.IMAGE, restart_policy=policy, max_restarts=0 if policy else None)
    h = f.Harness()
    h.send(f.create(f.KEY, providers=["p"], sandbox_spec=spec, on_exit="delete"))
    h.send(f.running(f.KEY, 1), f.rotate(f.KEY, {"p": 2}))
    decision = h.send(f.failed(f.KEY, 2, "launch"))
    assert [e.type for e in decision.events] == types
    assert h.row().phase is (Phase.DELETING if policy in ("OnFailure", "Always") else Phase.ERROR)


def test_the_completion_policy_of_an_exit_while_held_does_not_act_at_the_release() -> None:
    """What docs/state-machine.md says of holds: an exit while held is not deleted by
    on_exit=delete, then or at the release (the sandbox stays Completed)."""
    h = f.Harness()
    h.send(f.create(on_exit="delete"), f.running(), f.hold())
    assert [e.type for e in h.send(f.exited(exit_code=0)).events] == ["SandboxCompleted"]
    assert [e.type for e in h.send(f.release()).events] == ["SandboxReleased"]
    assert (h.row().phase, h.row().deadline) == (P.COMPLETED, None)
