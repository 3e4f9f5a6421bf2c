"""Where a suspend under way meets a time to live, a stop or a wake (the rules; the pipeline
side is in tests/test_suspend_expiry_pipeline.py).

- An expiry (on_expiry stop) that falls during Suspending records SandboxExpired only; the stop
  it owes used to be lost when the suspend then failed with the runtime running (Ready, no
  time to live: it ran forever). Now the failure goes on to Stopping.
- An operator's stop during Suspending was answered "nothing to do" and then lost the same
  way: it is refused now, naming the phase (projections/lifecycle/commands.py).
- The kill that escalates a suspend's stop overwrote the row's Expired (or IdleSuspend) reason,
  so the sandbox ended Suspended without it and a wake on access resumed an expired sandbox.
- A wake's resume (``ResumeSandbox.wake``) of a sandbox whose time to live ended is refused by
  the rule too, not only at the API's edge; an operator's resume stays allowed.
"""

from __future__ import annotations

from typing import Any

import factories as f
import pytest

from events.commands import ResumeSandbox
from events.common import Phase, SandboxSpec
from events.outcomes import Code
from projections.lifecycle import expired
from projections.lifecycle.model import idle_suspended
from projections.lifecycle.rows import evolve

P = Phase


def suspending_when_it_expires(**create: Any) -> f.Harness:
    """Ready from t=1 with a time to live of 100s, Suspending from t=90, expired at t=100."""
    h = f.Harness()
    h.send(f.create(ttl_seconds=100, occurred_at=f.at(0), **create))
    h.send(f.running(occurred_at=f.at(1)))
    h.send(f.suspend(occurred_at=f.at(90)))
    expires = h.row().expires_at
    assert expires is not None
    h.send(f.due(deadline="ttl", due_at=expires, occurred_at=f.at(100)))
    return h


@pytest.mark.parametrize("observed", ["running", None])
def test_a_failed_suspend_after_an_expiry_during_suspending_goes_on_to_stopping(
    observed: str | None,
) -> None:
    h = suspending_when_it_expires()
    row = h.row()
    assert row.phase is P.SUSPENDING and expired(row.reason, row.expires_at), row
    d = h.send(f.failed(operation="suspend", observed=observed, occurred_at=f.at(105)))  # type: ignore[arg-type]
    assert [e.type for e in d.events] == ["SandboxOperationFailed", "SandboxStopping"], d.events
    row = h.row()
    assert row.phase is P.STOPPING and row.deadline is not None and row.deadline.kind == "stop"
    assert (row.reason or "").startswith("Expired: time to live ended (stop); the suspend failed")
    h.send(f.stopped(occurred_at=f.at(110)))
    assert h.row().phase is P.STOPPED
    assert h.rebuilt()[f.KEY] == h.row()


def test_a_failed_suspend_after_an_expiry_and_a_hold_stays_ready_until_the_release() -> None:
    """A hold keeps the policies off (as it defers an expiry): the owed stop is not made while
    held, and is made at the release. (A review found it lost: the expiry had cleared
    ``expires_at``, so nothing came due again and the sandbox ran on for ever.)"""
    h = suspending_when_it_expires()
    h.send(f.hold(occurred_at=f.at(102)))
    d = h.send(f.failed(operation="suspend", observed="running", occurred_at=f.at(105)))
    assert [e.type for e in d.events] == ["SandboxOperationFailed"]
    assert h.row().phase is P.READY
    d = h.send(f.release(occurred_at=f.at(110)))
    assert [e.type for e in d.events] == ["SandboxReleased", "SandboxStopping"], d.events
    row = h.row()
    assert row.phase is P.STOPPING and row.deadline is not None and row.deadline.kind == "stop"
    assert h.rebuilt()[f.KEY] == row


def test_a_release_of_a_sandbox_that_owes_no_stop_stops_nothing() -> None:
    for h in (f.Harness(), suspending_when_it_expires()):
        if not h.steps:
            h.send(f.create(ttl_seconds=100, occurred_at=f.at(0)), f.running(occurred_at=f.at(1)))
        h.send(f.hold(occurred_at=f.at(102)))
        before = h.row().phase
        d = h.send(f.release(occurred_at=f.at(110)))
        assert [e.type for e in d.events] == ["SandboxReleased"]
        assert h.row().phase is before  # Ready; Suspending (its suspend decides)


def test_an_extend_after_the_expiry_lifts_the_owed_stop() -> None:
    h = suspending_when_it_expires()
    h.send(f.extend(ttl_seconds=600, occurred_at=f.at(102)))
    d = h.send(f.failed(operation="suspend", observed="running", occurred_at=f.at(105)))
    assert [e.type for e in d.events] == ["SandboxOperationFailed"]
    row = h.row()
    assert (row.phase, row.expires_at) == (P.READY, f.at(702))


def test_an_expiry_with_on_expiry_delete_during_suspending_deletes() -> None:
    h = suspending_when_it_expires(on_expiry="delete")
    assert h.row().phase is P.DELETING


def test_a_stop_during_suspending_is_refused_naming_the_phase() -> None:
    """It was "nothing to do", and a suspend that then failed with the runtime running left
    the sandbox Ready: the accepted stop never happened. Refused, the caller knows to ask
    again; once Ready again the stop is admitted, once Suspended it has nothing to do."""
    h = f.Harness()
    h.send(f.create(occurred_at=f.at(0)), f.running(occurred_at=f.at(1)))
    h.send(f.suspend(occurred_at=f.at(90)))
    before = h.row()
    d = h.send(f.stop(occurred_at=f.at(91)))
    assert d.outcome is not None and d.outcome.code is Code.FAILED_PRECONDITION, d.outcome
    assert "current phase: Suspending" in d.outcome.message, d.outcome.message
    assert (d.disposition, d.events, h.row()) == ("rejected", (), before)
    h.send(f.failed(operation="suspend", observed="running", occurred_at=f.at(95)))
    assert h.row().phase is P.READY
    assert h.send(f.stop(occurred_at=f.at(96))).disposition == "applied"
    assert h.row().phase is P.STOPPING


def idle_suspending() -> f.Harness:
    h = f.Harness()
    spec = SandboxSpec(image=f.IMAGE, idle_suspend_seconds=60)
    h.send(f.create(sandbox_spec=spec, occurred_at=f.at(0)), f.running(occurred_at=f.at(1)))
    h.send(f.idle_due(occurred_at=f.at(61)))
    assert h.row().phase is P.SUSPENDING and idle_suspended(h.row())
    return h


@pytest.mark.parametrize("why", ["expired", "idle"])
def test_the_kill_of_a_suspend_keeps_the_reason_suspended_keeps(why: str) -> None:
    """The escalation overwrote it with StopTimeout: the sandbox ended Suspended with no
    reason, and a wake resumed a sandbox whose time to live had ended."""
    h = suspending_when_it_expires() if why == "expired" else idle_suspending()
    reason = h.row().reason
    deadline = h.row().deadline
    assert deadline is not None and deadline.kind == "stop"
    d = h.send(f.due(deadline="stop", due_at=deadline.due_at))
    assert [e.type for e in d.events] == ["SandboxStopEscalated"]
    assert (h.row().phase, h.row().reason, h.row().deadline) == (P.SUSPENDING, reason, None)
    h.send(f.suspended(occurred_at=f.at(140)))
    row = h.row()
    assert (row.phase, row.reason) == (P.SUSPENDED, reason)
    assert expired(row.reason, row.expires_at) if why == "expired" else idle_suspended(row)
    assert h.rebuilt()[f.KEY] == row


def test_a_suspends_kill_recorded_before_it_kept_the_reason_folds_as_it_was_decided() -> None:
    """The rebuild from the log must give the rows that were written: an escalation recorded
    before the decision said ``keeps_reason`` (its JSON has no such field) folds to the
    StopTimeout reason it had, and only a decided ``keeps_reason`` keeps the row's."""
    h = idle_suspending()
    deadline = h.row().deadline
    assert deadline is not None
    [kill] = h.send(f.due(deadline="stop", due_at=deadline.due_at)).events
    before = type(kill).model_validate(kill.model_dump(mode="json", exclude={"keeps_reason"}))
    rows: dict[str, Any] = {}
    for event in [before if e is kill else e for e in h.events()]:
        rows[event.key] = evolve(rows.get(event.key), event)
    assert (rows[f.KEY].reason or "").startswith("StopTimeout:"), rows[f.KEY].reason
    assert kill.model_dump(mode="json")["keeps_reason"] is True
    assert h.rebuilt()[f.KEY].reason == h.row().reason  # as decided now: kept


def test_the_kill_of_an_operators_stop_still_says_so() -> None:
    h = f.Harness()
    h.send(f.create(occurred_at=f.at(0)), f.running(occurred_at=f.at(1)))
    h.send(f.stop(occurred_at=f.at(2)))
    deadline = h.row().deadline
    assert deadline is not None
    h.send(f.due(deadline="stop", due_at=deadline.due_at))
    assert (h.row().reason or "").startswith("StopTimeout:")


def wake(h: f.Harness, at: float) -> ResumeSandbox:
    """The resume the API's wake on access sends for the row as it is now."""
    row = h.row()
    return ResumeSandbox(
        type="ResumeSandbox",
        command_id=f"wake:{row.sandbox_id}:{row.generation}:v{row.version}:0123456789abcdef",
        key=f.KEY,
        occurred_at=f.at(at),
        actor="bob",
        wake=True,
    )


def test_a_wakes_resume_of_a_sandbox_whose_time_to_live_ended_is_refused() -> None:
    """The wake read the row before the expiry (the API checks it there, and again after a
    suspend it waited out) and its resume is decided after: refused, the row unchanged; an
    operator's resume is still allowed."""
    h = f.Harness()
    h.send(f.create(ttl_seconds=100, occurred_at=f.at(0)), f.running(occurred_at=f.at(1)))
    h.send(f.suspend(occurred_at=f.at(10)), f.suspended(occurred_at=f.at(12)))
    resume = wake(h, 99.9)
    h.send(f.due(deadline="ttl", due_at=f.at(100)))
    before = h.row()
    assert before.phase is P.SUSPENDED and expired(before.reason, before.expires_at), before
    d = h.send(resume)
    assert d.outcome is not None and d.outcome.code is Code.FAILED_PRECONDITION, d.outcome
    assert "time to live has ended" in d.outcome.message, d.outcome.message
    assert (d.disposition, h.row()) == ("rejected", before)
    d = h.send(f.resume(occurred_at=f.at(101)))
    assert d.disposition == "applied" and h.row().phase is P.STARTING


def test_a_wakes_resume_of_a_sandbox_not_expired_is_decided_as_before() -> None:
    h = f.Harness()
    h.send(f.create(ttl_seconds=100, occurred_at=f.at(0)), f.running(occurred_at=f.at(1)))
    h.send(f.suspend(occurred_at=f.at(10)), f.suspended(occurred_at=f.at(12)))
    assert h.send(wake(h, 20)).disposition == "applied"
    assert (h.row().phase, h.row().expires_at) == (P.STARTING, f.at(100))


def test_a_resume_without_the_wake_field_serializes_as_before() -> None:
    plain = f.resume()
    assert "wake" not in plain.model_dump(mode="json")
    assert ResumeSandbox.model_validate_json(plain.model_dump_json()) == plain
    woken = plain.model_copy(update={"wake": True})
    assert woken.model_dump(mode="json")["wake"] is True
