"""A decided stop is never undone (the rules): a user's StopSandbox or a time to live that fell
due (``on_expiry: stop``) whose stop fails stays Stopping, visibly, with retries on the
delete's back-off, until the runtime is stopped, or a restart or delete takes over. A failed
stop used to follow the phase the backend was seen in: Ready with the runtime running, the
expiry consumed, and nothing left that would stop it again.

The same rules on the real pipeline: tests/test_stop_finishes.py.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from uuid import uuid4

import factories as f
import pytest

from events.common import Phase
from events.decided import (
    SandboxDeleting,
    SandboxOperationFailed,
    SandboxStarting,
    SandboxStopEscalated,
    SandboxStopped,
    SandboxStopRetried,
)
from events.observations import ObservedState
from projections.lifecycle import DEFAULT_LIMITS, Limits, Message, decide, evolve
from services.common.settings import Settings
from services.executor.intents import intent_of, intent_of_row, unwanted

P = Phase

# The windows tests/test_stop_finishes.py runs at (the defaults divided by 100, the stop margin
# and the grace period shorter still): test_the_scaled_stop_timeline_is_the_real_one proves
# they decide the same events in the same order as the defaults.
SCALED_STOP_WINDOWS = {
    "executor_retry_seconds": 6.0,
    "stop_margin_seconds": 0.3,
    "delete_retry_seconds": 1.2,
    "delete_retry_max_seconds": 18.0,
}
SCALED_GRACE = 0


def ttl_stop() -> f.Harness:
    """A running sandbox whose time to live fell due with ``on_expiry: stop``."""
    h = f.Harness()
    h.send(f.create(ttl_seconds=60, on_expiry="stop"), f.running())
    expires_at = h.row().expires_at
    assert expires_at is not None
    h.send(f.due(deadline="ttl", due_at=expires_at))
    assert (h.row().phase, h.row().expires_at) == (P.STOPPING, None)
    return h


@pytest.mark.parametrize("observed", [None, "running"])
@pytest.mark.parametrize("why", ["user", "ttl"])
def test_a_failed_stop_of_a_running_runtime_stays_stopping_with_its_retries(
    why: str, observed: ObservedState | None
) -> None:
    """The reported case: the stop fails, the runtime still running (or its state unknown).
    The row stays Stopping and says why, its retry deadline asks again, and the next failure
    counts that retry; a success then ends it."""
    h = ttl_stop() if why == "ttl" else f.harness_in(P.STOPPING)
    at = f.T0 + timedelta(seconds=600)  # the executor's retry window has passed
    (event,) = h.send(
        f.failed(operation="stop", observed=observed, reason="podman: timeout", occurred_at=at)
    ).events
    assert isinstance(event, SandboxOperationFailed)
    assert (event.operation, event.phase) == ("stop", P.STOPPING)
    row = h.row()
    first = row.deadline
    assert first is not None and (first.kind, first.attempt) == ("stop", 0)
    assert first.due_at == at + timedelta(seconds=10 + 120)  # grace, then the first back-off
    assert row.phase is P.STOPPING
    assert row.reason == (
        "StopFailed: still Stopping (retries so far: 0; next retry at "
        f"{first.due_at.isoformat()}): podman: timeout"
    )
    (retried,) = h.send(f.due(deadline="stop", due_at=first.due_at)).events
    assert isinstance(retried, SandboxStopRetried)
    assert (retried.deadline.kind, retried.deadline.attempt) == ("stop", 1)
    assert retried.deadline.due_at == first.due_at + timedelta(seconds=10 + 240)
    h.send(f.failed(operation="stop", observed=observed, reason="podman: timeout"))
    assert (h.row().phase, h.row().deadline) == (P.STOPPING, retried.deadline)
    assert (h.row().reason or "").startswith("StopFailed: still Stopping (retries so far: 1;")
    (done,) = h.send(f.stopped()).events
    assert isinstance(done, SandboxStopped)
    assert (h.row().phase, h.row().deadline, h.row().reason) == (P.STOPPED, None, None)


@pytest.mark.parametrize("observed", ["exited", "created", "absent"])
def test_a_failed_stop_that_saw_the_runtime_not_running_is_stopped(
    observed: ObservedState,
) -> None:
    """A stop that fails because the runtime is gone already (or not running) has done what it
    was asked: Stopped, the failure in the row's reason."""
    h = ttl_stop()
    (event,) = h.send(f.failed(operation="stop", observed=observed, reason="no such")).events
    assert isinstance(event, SandboxOperationFailed) and event.phase is P.STOPPED
    assert (h.row().phase, h.row().deadline, h.row().reason) == (P.STOPPED, None, "no such")


def test_a_failed_stop_replaces_the_escalation_deadline() -> None:
    """A failure reported before the stop's own deadline (a non-retryable error at once): the
    escalation would kill a runtime whose stop, kill included, has just failed; the retry's
    deadline replaces it, so the next DeadlineDue asks for the stop again."""
    h = f.harness_in(P.STOPPING)
    escalation = h.row().deadline
    assert escalation is not None
    h.send(f.failed(operation="stop", observed="running"))
    retry = h.row().deadline
    assert retry is not None and retry != escalation and retry.attempt == 0
    stale = h.send(f.due(deadline="stop", due_at=escalation.due_at))
    assert stale.disposition == "ignored"
    (event,) = h.send(f.due(deadline="stop", due_at=retry.due_at)).events
    assert isinstance(event, SandboxStopRetried)


def test_an_escalated_stop_that_failed_is_retried() -> None:
    """The usual order with a transient failure: the stop's deadline escalates to a kill
    first (no deadline after it), then the executor reports the failure after its retry
    window: a fresh retry deadline, not nothing."""
    h = f.harness_in(P.STOPPING)
    escalation = h.row().deadline
    assert escalation is not None
    (escalated,) = h.send(f.due(deadline="stop", due_at=escalation.due_at)).events
    assert isinstance(escalated, SandboxStopEscalated) and h.row().deadline is None
    h.send(f.failed(operation="stop", observed="running"))
    assert h.row().phase is P.STOPPING and h.row().deadline is not None


@pytest.mark.parametrize("takeover", ["restart", "delete"])
def test_a_restart_or_delete_takes_over_a_failing_stop(takeover: str) -> None:
    """The user's later word wins: a restart starts a new generation (its launch stops the old
    one first), a delete deletes; the stop's retry deadline goes with the phase."""
    h = ttl_stop()
    h.send(f.failed(operation="stop", observed="running"))
    if takeover == "restart":
        (event,) = h.send(f.restart()).events
        assert isinstance(event, SandboxStarting) and h.row().phase is P.STARTING
        assert h.row().deadline is not None and h.row().deadline.kind == "launch"  # type: ignore[union-attr]
    else:
        (event,) = h.send(f.delete()).events
        assert isinstance(event, SandboxDeleting) and h.row().phase is P.DELETING
        assert h.row().deadline is not None and h.row().deadline.kind == "delete"  # type: ignore[union-attr]


def test_a_running_runtime_never_lifts_a_failing_stop_to_ready() -> None:
    """The watcher keeps seeing the runtime run while the stop fails: nothing moves the row."""
    h = ttl_stop()
    h.send(f.failed(operation="stop", observed="running"))
    before = h.row()
    decision = h.send(f.running())
    assert decision.disposition == "ignored" and h.row() == before


def test_with_retry_deadlines_off_a_failed_stop_stays_stopping_for_the_pick_up() -> None:
    """delete_retry_seconds 0 turns the back-off off for stops too: the row stays Stopping
    without a deadline, and the reconcile loop's pick-up asks again."""
    h = f.harness_in(P.STOPPING)
    off = Limits(delete_seconds=None)
    message = f.failed(operation="stop", observed="running", reason="podman: timeout")
    decision = decide(h.row(), message, f.cause(message), off)
    assert decision.state is not None
    assert (decision.state.phase, decision.state.deadline) == (P.STOPPING, None)
    assert decision.state.reason == (
        "StopFailed: still Stopping (stop retries off; the reconcile loop asks again): "
        "podman: timeout"
    )


def test_old_failed_stop_events_replay_as_they_were() -> None:
    """A failed stop decided by the older rules (it followed the observed phase: Ready) rebuilds
    to that phase: the rebuild from the log never rewrites history."""
    h = f.harness_in(P.STOPPING)
    row = h.row()
    old = SandboxOperationFailed(
        type="SandboxOperationFailed", event_id=uuid4(), key=row.key,
        sandbox_id=row.sandbox_id, version=row.version + 1, generation=row.generation,
        occurred_at=f.T0, actor="executor", cause=h.steps[-1].cause, operation="stop",
        phase=P.READY, reason="timeout",
    )  # fmt: skip
    rebuilt = evolve(row, old)
    assert (rebuilt.phase, rebuilt.deadline, rebuilt.reason) == (P.READY, None, "timeout")


def stop_timeline(
    limits: Limits, grace: int, retry_window: float, steps: int = 8
) -> list[tuple[str, int]]:
    """The decided events of a time-to-live stop whose every stop (and kill) fails
    transiently: deadlines fall due on time; the executor reports each stop's failure once its
    retry window has passed, and skips a retry while a stop of the generation is still running
    (services/executor/intake.py). (event type, the row's deadline attempt after it, -1: none)"""
    h = f.Harness()
    spec = f.spec(f.IMAGE).model_copy(update={"stop_timeout_seconds": grace})
    h.send(f.create(sandbox_spec=spec, ttl_seconds=60, on_expiry="stop"), f.running())
    out: list[tuple[str, int]] = []

    def send(message: Message) -> None:
        decision = decide(h.row(), message, f.cause(message), limits)
        assert decision.state is not None
        h.states[f.KEY] = decision.state
        for e in decision.events:
            out.append((e.type, getattr(decision.state.deadline, "attempt", -1)))

    expires_at = h.row().expires_at
    assert expires_at is not None
    send(f.due(deadline="ttl", due_at=expires_at))
    stop_reports_at: datetime | None = expires_at + timedelta(seconds=retry_window)
    while len(out) < steps:
        row = h.row()
        assert row.phase is P.STOPPING  # never undone
        deadline = row.deadline
        report = stop_reports_at
        if report is not None and (deadline is None or report < deadline.due_at):
            send(f.failed(operation="stop", observed="running", occurred_at=report))
            stop_reports_at = None
            continue
        assert deadline is not None, "a failed stop with nothing left to stop it again"
        send(f.due(deadline="stop", due_at=deadline.due_at))
        if out[-1][0] == "SandboxStopRetried" and stop_reports_at is None:
            stop_reports_at = deadline.due_at + timedelta(seconds=retry_window)
    return out


def test_the_scaled_stop_timeline_is_the_real_one() -> None:
    """tests/test_stop_finishes.py runs a failing time-to-live stop at SCALED_STOP_WINDOWS and
    SCALED_GRACE; with the defaults (600 s of executor retries, 30 s of stop margin, 120 s to
    1800 s of back-off, the driver's 10 s grace) the same events are decided in the same
    order: the escalation's kill, the failure (still Stopping, a retry deadline), retries
    (one skipped by the executor while the stop it asked for still runs), the next failure
    keeping the next retry's deadline."""
    real = stop_timeline(DEFAULT_LIMITS, grace=10, retry_window=600)
    scaled_settings = Settings(**SCALED_STOP_WINDOWS)  # type: ignore[arg-type]
    scaled = stop_timeline(
        scaled_settings.lifecycle_limits,
        grace=SCALED_GRACE,
        retry_window=scaled_settings.executor_retry_seconds,
    )
    assert (
        real
        == scaled
        == [
            ("SandboxExpired", 0),
            ("SandboxStopping", 0),
            ("SandboxStopEscalated", -1),  # the kill: fails too, reports nothing
            ("SandboxOperationFailed", 0),  # still Stopping: the first retry's deadline
            ("SandboxStopRetried", 1),  # the stop again
            ("SandboxStopRetried", 2),  # skipped by the executor: that stop still retries
            ("SandboxOperationFailed", 2),  # still Stopping, the deadline of retry 3 kept
            ("SandboxStopRetried", 3),
        ]
    )


def test_the_executor_stops_again_on_a_retry_and_leaves_a_failed_stop_to_its_deadline() -> None:
    """SandboxStopRetried asks the executor for the stop; the reconcile loop's pick-up leaves a
    failed stop to its retry deadline (picking it up every other pass would undo the back-off)
    and picks it up again once retry deadlines are off."""
    h = f.harness_in(P.STOPPING)
    assert intent_of_row(h.row()) is not None  # e.g. decided before this executor group joined
    h.send(f.failed(operation="stop", observed="running"))
    assert intent_of_row(h.row()) is None
    assert intent_of_row(replace(h.row(), deadline=None)) is not None  # retries off
    deadline = h.row().deadline
    assert deadline is not None
    (retried,) = h.send(f.due(deadline="stop", due_at=deadline.due_at)).events
    intent = intent_of(retried)
    assert intent is not None and (intent.operation, intent.generation) == ("stop", 1)
    assert unwanted(intent, h.row()) is None
    assert intent_of_row(h.row()) is None  # the retry runs; the next deadline follows it


def test_an_expiry_during_a_failing_stop_keeps_its_retries() -> None:
    """A sandbox stopped by hand keeps its time to live; when that falls due while the stop is
    failing, the row still says why it is not stopped, and the next DeadlineDue of the stop is
    still the retry (not the escalation, which would end the retries with a kill that reports
    nothing)."""
    h = f.Harness()
    h.send(f.create(ttl_seconds=600), f.running(), f.stop())
    h.send(f.failed(operation="stop", observed="running", reason="podman: timeout"))
    reason, retry, expires_at = h.row().reason, h.row().deadline, h.row().expires_at
    assert reason is not None and retry is not None and expires_at is not None
    assert [e.type for e in h.send(f.due(deadline="ttl", due_at=expires_at)).events] == [
        "SandboxExpired"
    ]
    assert (h.row().phase, h.row().reason, h.row().deadline) == (P.STOPPING, reason, retry)
    (event,) = h.send(f.due(deadline="stop", due_at=retry.due_at)).events
    assert isinstance(event, SandboxStopRetried)
