"""Idle suspend in the pure core: what a DeadlineDue(idle) does, one regression test per rule
(docs/state-machine.md, "Idle suspend"). The doors' use reaches the rule only as the message's
``last_used_at``; the row's own last change counts as use too."""

from __future__ import annotations

import factories as f
import pytest

from events.common import Phase, SandboxSpec
from events.decided import IdleSuspendChanged, SandboxStarting, SandboxSuspending
from events.outcomes import Code
from projections.lifecycle import IDLE_SUSPEND
from projections.lifecycle.model import idle_suspended

P = Phase
IDLE = 60


def ready(idle: int | None = IDLE, **create: object) -> f.Harness:
    """A sandbox with an idle timeout of ``idle`` seconds, Ready since f.at(1)."""
    h = f.Harness()
    spec = SandboxSpec(image=f.IMAGE, idle_suspend_seconds=idle)
    h.send(f.create(sandbox_spec=spec, **create))  # type: ignore[arg-type]
    h.send(f.running(occurred_at=f.at(1)))
    assert h.row().phase is P.READY
    return h


def test_an_idle_sandbox_is_suspended_and_its_row_says_why() -> None:
    h = ready()
    d = h.send(f.idle_due(occurred_at=f.at(1 + IDLE), last_used_at=None))
    (event,) = d.events
    assert isinstance(event, SandboxSuspending) and event.deadline is not None
    assert event.deadline.kind == "stop"
    assert h.row().phase is P.SUSPENDING
    assert (h.row().reason or "").startswith(f"{IDLE_SUSPEND}: no use since ")
    h.send(f.suspended(occurred_at=f.at(IDLE + 5)))
    assert h.row().phase is P.SUSPENDED
    assert (h.row().reason or "").startswith(IDLE_SUSPEND)  # kept until the resume
    h.send(f.resume(occurred_at=f.at(IDLE + 10)))
    assert h.row().phase is P.STARTING and not idle_suspended(h.row())
    assert h.rebuilt()[f.KEY] == h.row()  # the rebuild from the log decides alike


def test_a_use_recorded_within_the_timeout_keeps_it_awake() -> None:
    h = ready()
    d = h.send(f.idle_due(occurred_at=f.at(1 + IDLE), last_used_at=f.at(30)))
    assert d.disposition == "ignored" and "used at" in d.reason
    assert h.row().phase is P.READY
    d = h.send(f.idle_due(occurred_at=f.at(30 + IDLE), last_used_at=f.at(30), version=1))
    assert d.disposition == "applied" and h.row().phase is P.SUSPENDING


def test_the_message_is_not_early_by_a_second() -> None:
    h = ready()
    d = h.send(f.idle_due(occurred_at=f.at(IDLE), last_used_at=None))
    assert d.disposition == "ignored" and h.row().phase is P.READY


def test_a_change_of_the_row_counts_as_use() -> None:
    """A message read before the row changed (a provider attached) does not suspend it."""
    h = ready()
    h.send(f.attach(provider="github", occurred_at=f.at(50)))
    d = h.send(f.idle_due(occurred_at=f.at(1 + IDLE), last_used_at=None))
    assert d.disposition == "ignored" and h.row().phase is P.READY


def test_a_held_sandbox_is_never_idle_suspended() -> None:
    h = ready()
    h.send(f.hold(occurred_at=f.at(2)))
    d = h.send(f.idle_due(occurred_at=f.at(10 * IDLE), last_used_at=None))
    assert d.disposition == "ignored" and "held by" in d.reason
    assert h.row().phase is P.READY


def test_a_pools_unclaimed_member_is_never_idle_suspended_and_a_claimed_one_is() -> None:
    h, member = f.Harness(), "pool-a1b2c3d4"
    spec = SandboxSpec(image=f.IMAGE, idle_suspend_seconds=IDLE)
    h.send(f.create(member, sandbox_spec=spec, pool="pool"))
    h.send(f.running(member, occurred_at=f.at(1)))
    d = h.send(f.idle_due(member, occurred_at=f.at(10 * IDLE), last_used_at=None))
    assert d.disposition == "ignored" and "member of pool 'pool'" in d.reason
    assert h.row(member).phase is P.READY
    h.send(f.adopt(member, "mine", "c1", occurred_at=f.at(2)))
    d = h.send(f.idle_due(member, occurred_at=f.at(10 * IDLE), last_used_at=None))
    assert d.disposition == "applied" and h.row(member).phase is P.SUSPENDING


def test_without_a_timeout_nothing_is_idle() -> None:
    h = ready(idle=None)
    d = h.send(f.idle_due(occurred_at=f.at(10_000), last_used_at=None))
    assert d.disposition == "ignored" and "no idle timeout" in d.reason


@pytest.mark.parametrize("phase", [p for p in P if p not in (P.READY, P.DELETED)])
def test_only_a_ready_sandbox_is_idle(phase: Phase) -> None:
    h = f.harness_in(phase)
    h.send(f.set_idle_suspend(idle_suspend_seconds=IDLE, occurred_at=f.at(0)))
    before = h.row()
    d = h.send(f.idle_due(occurred_at=f.at(10_000), generation=before.generation))
    assert d.disposition == "ignored" and h.row() == before


def test_a_repeat_from_a_restarted_scheduler_changes_nothing() -> None:
    h = ready()
    due = f.idle_due(occurred_at=f.at(1 + IDLE))
    assert h.send(due).disposition == "applied"
    again = f.idle_due(occurred_at=f.at(2 + IDLE))  # another scheduler, a moment later
    assert h.send(again).disposition == "ignored"
    h.send(f.suspended(occurred_at=f.at(IDLE + 5)), f.resume(occurred_at=f.at(IDLE + 6)))
    h.send(f.running(generation=2, occurred_at=f.at(IDLE + 7)))
    late = f.idle_due(occurred_at=f.at(2 * IDLE), generation=2)  # idle since the resume only
    assert h.send(late).disposition == "ignored"
    assert sum(isinstance(e, SandboxSuspending) for e in h.events()) == 1


def test_set_idle_suspend_changes_the_spec_and_counts_anew() -> None:
    h = ready(idle=None)
    d = h.send(f.set_idle_suspend(idle_suspend_seconds=IDLE, occurred_at=f.at(100)))
    (event,) = d.events
    assert isinstance(event, IdleSuspendChanged)
    assert h.row().spec.idle_suspend_seconds == IDLE
    assert h.send(f.idle_due(occurred_at=f.at(99 + IDLE))).disposition == "ignored"
    same = h.send(f.set_idle_suspend(idle_suspend_seconds=IDLE, occurred_at=f.at(120)))
    assert same.disposition == "idempotent" and same.outcome is not None
    assert same.outcome.code is Code.OK
    h.send(f.set_idle_suspend(idle_suspend_seconds=None, occurred_at=f.at(130)))
    assert h.row().spec.idle_suspend_seconds is None
    assert h.send(f.idle_due(occurred_at=f.at(10_000))).disposition == "ignored"
    assert h.rebuilt()[f.KEY] == h.row()


def test_a_timeout_set_at_create_travels_with_the_resume() -> None:
    h = ready()
    h.send(f.idle_due(occurred_at=f.at(1 + IDLE)), f.suspended(occurred_at=f.at(IDLE + 5)))
    d = h.send(f.resume(occurred_at=f.at(IDLE + 6)))
    (event,) = d.events
    assert isinstance(event, SandboxStarting) and event.spec.idle_suspend_seconds == IDLE
