"""The operator lifecycle rules of the pure core: deadlines, time to live, completion policy,
holds. Time comes only from DeadlineDue messages (the scheduler's), never from a clock."""

from __future__ import annotations

from datetime import timedelta

import factories as f
import pytest

from events.common import Phase, SandboxSpec
from events.decided import (
    AgentRestartFailed,
    SandboxCompleted,
    SandboxDeleteRetried,
    SandboxDeleting,
    SandboxExpired,
    SandboxStopEscalated,
    SandboxStopping,
    SandboxTimedOut,
)
from events.outcomes import Code
from projections.lifecycle import DEFAULT_LIMITS, Limits, Message, decide, is_held

P = Phase
LIMITS = DEFAULT_LIMITS


def seconds(n: float) -> timedelta:
    return timedelta(seconds=n)


def test_create_records_the_launch_deadline_and_the_expiry() -> None:
    h = f.Harness()
    h.send(f.create(ttl_seconds=90, on_expiry="delete", on_exit="delete", occurred_at=f.at(10)))
    row = h.row()
    assert row.deadline is not None and row.deadline.kind == "launch"
    launch = LIMITS.launch_retry_seconds + (LIMITS.launch_seconds or 0)
    assert row.deadline.due_at == f.at(10) + seconds(launch)
    assert row.expires_at == f.at(100)
    assert (row.on_expiry, row.on_exit) == ("delete", "delete")
    h.send(f.running())
    assert h.row().deadline is None  # Ready has no deadline
    assert h.rebuilt() == {f.KEY: h.row()}


def test_limits_come_from_the_caller_and_travel_in_the_events() -> None:
    limits = Limits(launch_seconds=3, launch_retry_seconds=4)
    command = f.create(occurred_at=f.at(0))
    decision = decide(None, command, f.Causes()(command), limits)
    (event,) = decision.events
    assert event.deadline is not None and event.deadline.due_at == f.at(7)  # type: ignore[union-attr]
    assert (
        decide(None, command, f.Causes()(command), Limits(launch_seconds=None)).state.deadline
        is None
    )  # type: ignore[union-attr]


@pytest.mark.parametrize("phase", [P.PROVISIONING, P.STARTING])
def test_launch_deadline_is_an_error_with_reason_provisioning_timeout(phase: Phase) -> None:
    h = f.harness_in(phase)
    row = h.row()
    assert row.deadline is not None and row.deadline.kind == "launch"
    d = h.send(f.due(deadline="launch", due_at=row.deadline.due_at, generation=row.generation))
    assert d.disposition == "applied"
    (event,) = d.events
    assert isinstance(event, SandboxTimedOut)
    assert (h.row().phase, h.row().reason, h.row().deadline) == (
        P.ERROR,
        "ProvisioningTimeout",
        None,
    )
    # The restarted scheduler says it again: nothing happens.
    again = h.send(f.due(deadline="launch", due_at=row.deadline.due_at, generation=row.generation))
    assert (again.disposition, again.events) == ("ignored", ())
    assert h.rebuilt() == {f.KEY: h.row()}


def test_a_deadline_of_an_older_generation_is_stale() -> None:
    h = f.harness_in(P.STARTING)  # generation 2; generation 1 had a launch deadline too
    first = h.steps[0].decision.state
    assert first is not None and first.deadline is not None
    d = h.send(f.due(deadline="launch", due_at=first.deadline.due_at, generation=1))
    assert d.disposition == "ignored" and d.reason.startswith("stale")
    assert h.row().phase is P.STARTING


def test_a_deadline_the_row_no_longer_holds_is_ignored() -> None:
    h = f.harness_in(P.PROVISIONING)
    due_at = h.row().deadline.due_at  # type: ignore[union-attr]
    h.send(f.running())
    d = h.send(f.due(deadline="launch", due_at=due_at))
    assert d.disposition == "ignored" and "not pending" in d.reason
    assert h.row().phase is P.READY


def test_stop_deadline_is_grace_plus_margin_and_escalates_to_a_kill() -> None:
    h = f.Harness()
    spec = SandboxSpec(image="img", stop_timeout_seconds=7)
    h.send(f.create(sandbox_spec=spec), f.running())
    h.send(f.stop(occurred_at=f.at(100)))
    deadline = h.row().deadline
    assert deadline is not None and deadline.kind == "stop"
    assert deadline.due_at == f.at(100 + 7) + seconds(LIMITS.stop_margin_seconds or 0)
    d = h.send(f.due(deadline="stop", due_at=deadline.due_at))
    (event,) = d.events
    assert isinstance(event, SandboxStopEscalated)
    assert h.row().phase is P.STOPPING and h.row().deadline is None
    assert "StopTimeout" in (h.row().reason or "")
    h.send(f.exited(exit_code=137))
    assert h.row().phase is P.STOPPED


def test_deleting_retries_visibly_with_back_off() -> None:
    h = f.harness_in(P.DELETING)
    waits = []
    for attempt in (1, 2, 3):
        pending = h.row().deadline
        assert pending is not None and pending.kind == "delete"
        at = pending.due_at
        d = h.send(f.due(deadline="delete", due_at=at, occurred_at=at))
        (event,) = d.events
        assert isinstance(event, SandboxDeleteRetried) and event.deadline.attempt == attempt
        assert h.row().phase is P.DELETING
        assert h.row().reason == f"DeleteTimeout: not deleted yet; retry {attempt}"
        waits.append(event.deadline.due_at - at)
    assert waits[0] < waits[1] < waits[2]  # each retry waits longer
    h.send(f.deleted())
    assert h.row().phase is P.DELETED


@pytest.mark.parametrize(
    ("policy", "phase", "follow"),
    [
        ("stop", P.READY, SandboxStopping),
        ("delete", P.READY, SandboxDeleting),
        ("delete", P.STOPPED, SandboxDeleting),
        ("stop", P.STOPPED, None),  # already stopped: the expiry is recorded, nothing else
    ],
)
def test_time_to_live_applies_the_policy(policy: str, phase: Phase, follow: type | None) -> None:
    h = f.Harness()
    h.send(f.create(ttl_seconds=60, on_expiry=policy), f.running())
    if phase is P.STOPPED:
        h.send(f.stop(), f.stopped())
    expires_at = h.row().expires_at
    assert expires_at == f.at(60)
    d = h.send(f.due(deadline="ttl", due_at=expires_at))
    assert isinstance(d.events[0], SandboxExpired)
    assert [type(e) for e in d.events[1:]] == ([follow] if follow else [])
    assert h.row().expires_at is None
    assert h.send(f.due(deadline="ttl", due_at=expires_at)).disposition == "ignored"
    assert h.rebuilt() == {f.KEY: h.row()}


def test_extend_pushes_the_expiry_out_and_the_old_one_no_longer_acts() -> None:
    h = f.Harness()
    h.send(f.create(ttl_seconds=60), f.running())
    old = h.row().expires_at
    h.send(f.extend(ttl_seconds=600, occurred_at=f.at(50)))
    assert h.row().expires_at == f.at(650)
    assert h.send(f.due(deadline="ttl", due_at=old)).disposition == "ignored"  # type: ignore[arg-type]
    assert h.row().phase is P.READY


def test_extend_gives_a_sandbox_without_one_a_time_to_live() -> None:
    h = f.harness_in(P.READY)
    assert h.row().expires_at is None
    h.send(f.extend(ttl_seconds=30, occurred_at=f.at(5)))
    assert h.row().expires_at == f.at(35)


def test_hold_refuses_start_and_restart_naming_who_and_why() -> None:
    h = f.harness_in(P.STOPPED)
    h.send(f.hold(reason="incident 42", actor="carol", occurred_at=f.at(9)))
    assert is_held(h.row())
    for command in (f.start(), f.restart()):
        d = h.send(command)
        assert d.outcome is not None and d.outcome.code is Code.FAILED_PRECONDITION
        assert "held by carol" in d.outcome.message and "incident 42" in d.outcome.message
    assert h.send(f.hold()).disposition == "idempotent"
    h.send(f.release())
    assert not is_held(h.row())
    assert h.send(f.release()).disposition == "idempotent"
    assert h.send(f.start()).disposition == "applied"


def test_a_held_sandbox_admits_stop_and_delete() -> None:
    h = f.harness_in(P.READY)
    h.send(f.hold())
    assert h.send(f.stop()).disposition == "applied"
    assert h.send(f.delete()).disposition == "applied"
    assert is_held(h.row()) and h.row().phase is P.DELETING


def test_a_held_sandbox_does_not_expire_until_released() -> None:
    h = f.Harness()
    h.send(f.create(ttl_seconds=60, on_expiry="delete"), f.running(), f.hold())
    expires_at = h.row().expires_at
    d = h.send(f.due(deadline="ttl", due_at=expires_at))  # type: ignore[arg-type]
    assert d.disposition == "ignored" and "held" in d.reason
    h.send(f.release())
    d = h.send(f.due(deadline="ttl", due_at=expires_at))  # type: ignore[arg-type]
    assert [e.type for e in d.events] == ["SandboxExpired", "SandboxDeleting"]


@pytest.mark.parametrize("exit_code", [0, 3])
def test_on_exit_delete_deletes_once_the_result_is_recorded(exit_code: int) -> None:
    h = f.Harness()
    h.send(f.create(on_exit="delete"), f.running())
    d = h.send(f.exited(exit_code=exit_code))
    first, then = d.events
    assert isinstance(first, SandboxCompleted) == (exit_code == 0)
    assert isinstance(then, SandboxDeleting) and then.version == first.version + 1
    assert then.event_id != first.event_id
    assert h.row().phase is P.DELETING and h.row().exit_code == exit_code
    assert h.rebuilt() == {f.KEY: h.row()}


def test_on_exit_delete_leaves_a_held_sandbox_alone() -> None:
    h = f.Harness()
    h.send(f.create(on_exit="delete"), f.running(), f.hold())
    d = h.send(f.exited(exit_code=0))
    assert [e.type for e in d.events] == ["SandboxCompleted"]


def test_on_exit_keep_is_the_default() -> None:
    h = f.harness_in(P.READY)
    assert [e.type for e in h.send(f.exited(exit_code=0)).events] == ["SandboxCompleted"]


def test_a_provisioning_timeout_of_an_ephemeral_sandbox_deletes_it() -> None:
    h = f.Harness()
    h.send(f.create(on_exit="delete"))
    due_at = h.row().deadline.due_at  # type: ignore[union-attr]
    d = h.send(f.due(deadline="launch", due_at=due_at))
    assert [e.type for e in d.events] == ["SandboxTimedOut", "SandboxDeleting"]


# ---------------------------------------------------------------------------------------------
# What the scheduler publishes for a due row (pure)


def _record(**kw: object) -> dict[str, object]:
    return {"key": "s", "generation": 2, "version": 7, "deadline": None, "expires_at": None,
            "held": False, **kw}  # fmt: skip


def test_the_scheduler_names_the_deadline_exactly_and_skips_a_held_expiry() -> None:
    from events.common import Deadline
    from services.scheduler.scheduler import due_messages

    now = f.at(100)
    deadline = Deadline(kind="stop", due_at=f.at(90))
    (due,) = due_messages(_record(deadline=deadline.model_dump_json()), now)
    assert (due.deadline, due.due_at, due.generation, due.occurred_at) == ("stop", f.at(90), 2, now)
    assert due.observation_id == f"deadline:s:2:stop:{f.at(90).isoformat()}:v7"
    (ttl,) = due_messages(_record(expires_at=f.at(99)), now)
    assert (ttl.deadline, ttl.due_at) == ("ttl", f.at(99))
    assert due_messages(_record(expires_at=f.at(99), held=True), now) == []
    assert due_messages(_record(expires_at=f.at(101)), now) == []  # not due yet
    # The same row read again (a restarted scheduler) gives the same id; a new version, a new one.
    assert due_messages(_record(expires_at=f.at(99)), f.at(200))[0].observation_id == (
        ttl.observation_id
    )
    assert due_messages(_record(expires_at=f.at(99), version=8), now)[0].observation_id != (
        ttl.observation_id
    )


# -- the launch deadline against the replaced generation's grace and the executor's retries ---
# Defaults throughout (Limits(): launch 300 s, the executor's retry window 600 s), the relation
# a deployment has unless it changes them. The scheduler is simulated: before each message,
# the row's deadline is delivered if it fell due by then, as the real scheduler would.

SLOW = SandboxSpec(image="img", stop_timeout_seconds=400)  # an agent that ignores SIGTERM


def at_time(h: f.Harness, t: float, message: Message) -> None:
    """``message`` at ``t`` seconds, after the DeadlineDue the scheduler would have sent by
    then."""
    row = h.row()
    if row.deadline is not None and row.deadline.due_at <= f.at(t):
        due = row.deadline.due_at
        h.send(f.due(deadline=row.deadline.kind, due_at=due, generation=row.generation))
    h.send(message)


def ready_slow_agent() -> f.Harness:
    h = f.Harness()
    h.send(f.create(sandbox_spec=SLOW, providers=["github"], occurred_at=f.at(0)))
    h.send(f.running(occurred_at=f.at(1)))
    assert h.row().phase is P.READY
    return h


def test_a_slow_stopping_agent_is_rotated_without_timing_out() -> None:
    """The restart's launch first waits out the old generation's 400 s grace: its deadline
    must not fall due meanwhile (it did at 300 s: Error ProvisioningTimeout, then Ready when the
    runtime came up, then killed by the cleanup stop)."""
    h = ready_slow_agent()
    h.send(f.rotate(occurred_at=f.at(10)))
    assert (h.row().phase, h.row().generation) == (P.STARTING, 2)
    at_time(h, 410, f.exited(generation=1, exit_code=137, occurred_at=f.at(410)))
    at_time(h, 412, f.launched(generation=2, credentials={"github": 2}, occurred_at=f.at(412)))
    row = h.row()
    assert (row.phase, row.generation, row.reason, row.deadline) == (P.READY, 2, None, None)
    assert not [e for e in h.events() if isinstance(e, SandboxTimedOut)]


def test_a_rotation_restart_failing_until_the_retry_window_ends_is_agent_restart_failed() -> None:
    """The executor retries a transient launch failure for its whole retry window (600 s),
    longer than the launch timeout (300 s), then reports it: that report finds the row still
    Starting, so it is AgentRestartFailed (not a ProvisioningTimeout at 300 s that swallows
    it)."""
    h = ready_slow_agent()
    h.send(f.rotate(occurred_at=f.at(10)))
    gave_up = "podman unavailable; gave up after 70 attempts"
    report = f.failed(generation=2, reason=gave_up, retryable=True, occurred_at=f.at(1015))
    at_time(h, 1015, report)  # 400 s grace, 600 s of retries, the last attempt
    row = h.row()
    assert (row.phase, row.reason) == (P.ERROR, gave_up)
    assert [type(e) for e in h.events()][-1] is AgentRestartFailed
    assert not [e for e in h.events() if isinstance(e, SandboxTimedOut)]


@pytest.mark.parametrize("grace", [None, 400])
def test_the_launch_deadline_covers_the_replaced_grace_the_retries_and_the_launch(
    grace: int | None,
) -> None:
    """create: the retry window plus the launch timeout; a start, restart or rotation restart
    also waits out the grace period of the generation it replaces (the sandbox's, else the
    driver's)."""
    spec = SandboxSpec(image="img", stop_timeout_seconds=grace)
    h = f.Harness()
    h.send(f.create(sandbox_spec=spec, providers=["github"], occurred_at=f.at(0)))
    launch = LIMITS.launch_seconds or 0
    assert h.row().deadline.due_at == f.at(LIMITS.launch_retry_seconds + launch)  # type: ignore[union-attr]
    h.send(f.running())
    replaced = LIMITS.stop_grace_seconds if grace is None else grace
    for message in (f.restart(occurred_at=f.at(20)), f.rotate(occurred_at=f.at(20))):
        h.send(f.running(generation=h.row().generation))
        h.send(message)
        due = f.at(20 + replaced + LIMITS.launch_retry_seconds + launch)
        assert (h.row().phase, h.row().deadline.due_at) == (P.STARTING, due)  # type: ignore[union-attr]
