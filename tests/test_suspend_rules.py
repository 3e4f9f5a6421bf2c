"""The rules where suspend meets what exists, one regression test each (pure core).

Suspend removes the runtime and keeps the workspace and everything the sandbox is; resume
starts a new generation on the same workspace. docs/state-machine.md states each rule.
"""

from __future__ import annotations

import factories as f
import pytest

from events.common import Phase, SandboxSpec
from events.decided import (
    AgentRestartSkipped,
    SandboxDeleting,
    SandboxExpired,
    SandboxRestartScheduled,
    SandboxStarting,
    SandboxSuspended,
    SandboxSuspending,
)
from events.outcomes import Code
from projections.lifecycle import ROTATION_TABLE, expired
from projections.lifecycle.model import idle_suspended

P = Phase


def suspended(spec: SandboxSpec | None = None, **create: object) -> f.Harness:
    """A sandbox that ran generation 1 and is Suspended."""
    h = f.Harness()
    h.send(f.create(providers=["github"], sandbox_spec=spec, **create))  # type: ignore[arg-type]
    h.send(f.running(occurred_at=f.at(1)), f.suspend(occurred_at=f.at(2)))
    h.send(f.suspended(occurred_at=f.at(3)))
    assert h.row().phase is P.SUSPENDED
    return h


def test_suspend_keeps_the_generation_and_everything_the_sandbox_is() -> None:
    h = f.Harness()
    h.send(f.create(providers=["github"], ttl_seconds=600), f.running())
    before = h.row()
    d = h.send(f.suspend())
    (event,) = d.events
    assert isinstance(event, SandboxSuspending) and event.deadline is not None
    assert event.deadline.kind == "stop"
    h.send(f.suspended())
    after = h.row()
    assert after.phase is P.SUSPENDED and after.deadline is None
    same = ("sandbox_id", "generation", "identity", "spec", "providers", "expires_at", "on_exit")
    assert {k: getattr(after, k) for k in same} == {k: getattr(before, k) for k in same}


@pytest.mark.parametrize(
    "late",
    [
        f.running(),
        f.created_snapshot(),
        f.exited(exit_code=0),
        f.exited(exit_code=137),
        f.removed(),
        f.result(operation="launch"),
        f.result(operation="stop"),
        f.failed(operation="suspend", observed="running"),
        f.result(operation="suspend", outcome="already_absent"),
    ],
    ids=lambda m: f"{m.type}-{getattr(m, 'state', getattr(m, 'operation', ''))}",
)
def test_late_observations_of_the_suspended_generation_change_nothing(late: object) -> None:
    h = suspended(SandboxSpec(image=f.IMAGE, restart_policy="Always"), on_exit="delete")
    row = h.row()
    d = h.send(late)  # type: ignore[arg-type]
    assert d.disposition == "ignored" and d.events == ()
    assert h.row() is row


def test_the_suspends_stop_is_no_exit_restart_and_completion_policies_stay_away() -> None:
    h = f.Harness()
    spec = SandboxSpec(image=f.IMAGE, restart_policy="Always")
    h.send(f.create(sandbox_spec=spec, on_exit="delete"), f.running(), f.suspend())
    for exit_seen in (f.exited(exit_code=143), f.exited(exit_code=0)):
        d = h.send(exit_seen)
        assert d.disposition == "ignored" and h.row().phase is P.SUSPENDING
    d = h.send(f.removed())
    assert [type(e) for e in d.events] == [SandboxSuspended]
    assert not any(isinstance(e, SandboxRestartScheduled | SandboxDeleting) for e in h.events())


def test_suspend_cancels_a_scheduled_restart() -> None:
    h = f.Harness()
    h.send(f.create(sandbox_spec=SandboxSpec(image=f.IMAGE, restart_policy="Always")))
    h.send(f.running(), f.exited(exit_code=1, occurred_at=f.at(1)))
    scheduled = h.row().deadline
    assert scheduled is not None and scheduled.kind == "restart"
    h.send(f.suspend(occurred_at=f.at(2)), f.suspended(occurred_at=f.at(3)))
    late = h.send(f.due(deadline="restart", due_at=scheduled.due_at))
    assert late.disposition == "ignored" and h.row().phase is P.SUSPENDED


def test_rotation_while_suspended_restarts_nothing_and_resume_reads_the_newest() -> None:
    h = suspended()
    d = h.send(f.rotate(rotations={"github": 7}))
    (skip,) = d.events
    assert isinstance(skip, AgentRestartSkipped)
    assert skip.reason == ROTATION_TABLE[P.SUSPENDED]
    assert h.row().phase is P.SUSPENDED and h.row().generation == 1
    d = h.send(f.resume())
    (start,) = d.events
    # The resume is a launch like any start: its intent reads the providers' values when it
    # runs (the executor, services/executor/credentials.py), so it gets revision 7.
    assert isinstance(start, SandboxStarting) and start.reason == "resume"
    assert start.generation == 2 and start.previous_generation == 1
    assert h.row().providers == ("github",)


def test_detach_while_suspended_restarts_nothing() -> None:
    h = suspended()
    h.send(f.detach(provider="github"))
    assert h.row().phase is P.SUSPENDED and h.row().providers == ()


@pytest.mark.parametrize(("policy", "phase"), [("stop", P.SUSPENDED), ("delete", P.DELETING)])
def test_time_to_live_keeps_counting_while_suspended(policy: str, phase: Phase) -> None:
    h = suspended(ttl_seconds=60, on_expiry=policy)
    expires = h.row().expires_at
    assert expires is not None
    d = h.send(f.due(deadline="ttl", due_at=expires))
    assert isinstance(d.events[0], SandboxExpired)
    assert h.row().phase is phase


@pytest.mark.parametrize("when", ["suspending", "suspended"])
def test_an_expiry_while_suspended_is_kept_on_the_row_until_an_extend(when: str) -> None:
    """The row says the time to live ended (a wake on access refuses it then), also when it
    ended during the suspend itself; an extend gives it a time to live again."""
    h = f.Harness()
    h.send(f.create(ttl_seconds=60), f.running(occurred_at=f.at(1)), f.suspend(occurred_at=f.at(2)))
    expires = h.row().expires_at
    assert expires is not None
    if when == "suspended":
        h.send(f.suspended(occurred_at=f.at(3)))
    h.send(f.due(deadline="ttl", due_at=expires))
    h.send(f.suspended(occurred_at=f.at(90)))
    row = h.row()
    assert row.phase is P.SUSPENDED and expired(row.reason, row.expires_at), row.reason
    h.send(f.extend(ttl_seconds=600))
    row = h.row()
    assert row.phase is P.SUSPENDED and not expired(row.reason, row.expires_at)


def test_delete_of_a_suspended_sandbox_deletes_it_workspace_included() -> None:
    h = suspended()
    d = h.send(f.delete())
    (event,) = d.events
    assert isinstance(event, SandboxDeleting)  # the delete intent removes the workspace
    h.send(f.deleted())
    assert h.row().tombstoned


def test_a_restart_racing_a_suspend_wins_and_the_suspends_late_result_is_stale() -> None:
    h = f.Harness()
    h.send(f.create(), f.running(), f.suspend(), f.restart())
    assert (h.row().phase, h.row().generation) == (P.STARTING, 2)
    late = h.send(f.suspended(generation=1))
    assert late.disposition == "ignored" and h.row().phase is P.STARTING


def test_a_suspend_of_a_pending_launch_removes_what_the_launch_brings_up() -> None:
    h = f.Harness()
    h.send(f.create(), f.suspend())
    assert h.row().phase is P.SUSPENDING
    # The launch's late report and its runtime seen running do not make it Ready.
    for late in (f.result(operation="launch"), f.running()):
        assert h.send(late).disposition == "ignored"
    h.send(f.suspended())
    assert h.row().phase is P.SUSPENDED


def test_a_delete_racing_a_suspend_wins() -> None:
    h = f.Harness()
    h.send(f.create(), f.running(), f.suspend(), f.delete())
    assert h.row().phase is P.DELETING
    assert h.send(f.suspended()).disposition == "ignored"
    d = h.send(f.suspend())
    assert d.outcome is not None and d.outcome.code is Code.FAILED_PRECONDITION


def test_a_failed_suspend_follows_what_the_backend_was_seen_in() -> None:
    seen = (("running", P.READY), ("created", P.SUSPENDED), ("exited", P.SUSPENDED),
            ("absent", P.SUSPENDED), (None, P.ERROR))  # fmt: skip
    for observed, phase in seen:
        h = f.Harness()
        h.send(f.create(), f.running(), f.suspend())
        h.send(f.failed(operation="suspend", observed=observed))  # type: ignore[arg-type]
        assert h.row().phase is phase, observed


@pytest.mark.parametrize("observed", ["exited", "created"])
def test_a_failed_idle_suspend_that_left_the_runtime_not_running_is_suspended(
    observed: str,
) -> None:
    """An idle suspend whose removal failed after its stop (the backend saw the runtime
    exited) left the row Stopped: no wake resumed it, no restart policy restarted it. Nothing
    runs, the workspace is kept: it is Suspended, says why, and a wake's resume starts it. The
    exit was the suspend's stop: neither the restart nor the completion policy acts on it."""
    spec = SandboxSpec(image=f.IMAGE, idle_suspend_seconds=60, restart_policy="Always")
    h = f.Harness()
    h.send(f.create(sandbox_spec=spec, on_exit="delete"), f.running(occurred_at=f.at(1)))
    h.send(f.idle_due(occurred_at=f.at(61)))
    assert h.row().phase is P.SUSPENDING
    failure = f.failed(operation="suspend", observed=observed, exit_code=143, reason="busy")  # type: ignore[arg-type]
    d = h.send(failure)
    assert [e.type for e in d.events] == ["SandboxOperationFailed"], d.events
    row = h.row()
    assert (row.phase, row.exit_code, row.deadline) == (P.SUSPENDED, None, None)
    assert idle_suspended(row) and (row.reason or "").endswith("; the suspend failed: busy")
    d = h.send(f.resume(occurred_at=f.at(70)))  # what a wake on access sends
    assert d.outcome is not None and d.outcome.accepted, d.outcome
    assert (h.row().phase, h.row().generation) == (P.STARTING, 2)
    assert h.rebuilt()[f.KEY] == h.row()


def test_an_operators_failed_suspend_that_left_the_runtime_exited_is_suspended() -> None:
    """What was asked for is done but the runtime's removal: Suspended, resumable; its row
    says what failed (the reconcile loop removes a runtime left under a Suspended row)."""
    h = f.Harness()
    h.send(f.create(), f.running(), f.suspend())
    h.send(f.failed(operation="suspend", observed="exited", exit_code=0, reason="busy"))
    assert (h.row().phase, h.row().reason) == (P.SUSPENDED, "busy")
    assert h.send(f.resume()).disposition == "applied"


@pytest.mark.parametrize("observed", ["exited", "absent"])
def test_an_expiry_during_a_suspend_that_failed_is_kept_on_the_row(observed: str) -> None:
    """The time to live ended while Suspending and the suspend then failed with the runtime
    not running: Suspended, and still no wake on access resumes it."""
    h = f.Harness()
    h.send(f.create(ttl_seconds=60), f.running(occurred_at=f.at(1)), f.suspend(occurred_at=f.at(2)))
    expires = h.row().expires_at
    assert expires is not None
    h.send(f.due(deadline="ttl", due_at=expires))
    h.send(f.failed(operation="suspend", observed=observed, occurred_at=f.at(90)))  # type: ignore[arg-type]
    row = h.row()
    assert row.phase is P.SUSPENDED and expired(row.reason, row.expires_at), row.reason


def test_resume_is_refused_while_held_and_suspend_is_not() -> None:
    h = f.Harness()
    h.send(f.create(), f.running(), f.hold())
    assert h.send(f.suspend()).disposition == "applied"
    h.send(f.suspended())
    d = h.send(f.resume())
    assert d.outcome is not None and d.outcome.code is Code.FAILED_PRECONDITION
    assert "held by" in d.outcome.message


def test_resume_elsewhere_names_the_phase_it_needs() -> None:
    h = f.Harness()
    h.send(f.create(), f.running(), f.stop(), f.stopped())
    d = h.send(f.resume())
    assert d.outcome is not None and d.outcome.code is Code.FAILED_PRECONDITION
    assert d.outcome.message == "sandbox must be Suspended to resume (current phase: Stopped)"
    h.send(f.start(), f.running(generation=2))
    d = h.send(f.resume())
    assert d.disposition == "idempotent"


def test_ten_suspend_resume_cycles_keep_the_incarnation() -> None:
    h = f.Harness()
    h.send(f.create(providers=["github"]), f.running())
    first = h.row()
    for cycle in range(10):
        gen = h.row().generation
        h.send(f.suspend(), f.suspended(generation=gen), f.resume())
        h.send(f.running(generation=gen + 1))
        assert h.row().phase is P.READY and h.row().generation == gen + 1, cycle
    assert h.row().sandbox_id == first.sandbox_id and h.row().providers == first.providers
    assert h.rebuilt() == dict(h.states)
