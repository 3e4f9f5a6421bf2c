"""The pool controller's plan (pure): what one pool needs from its size, strategy, template
revision, unclaimed members and pending creates. The real-stack runs are in test_pools.py."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import given
from hypothesis import strategies as st

from services.common.pools import Member, Strategy
from services.scheduler.pool_plan import LIVE, plan

_ids = itertools.count()


def m(phase: str = "Ready", revision: int = 1, template: str = "t") -> Member:
    return Member(f"p-{next(_ids):08d}", "p", phase, 3, template, revision, None)


def keys(members: tuple[Member, ...] | list[Member]) -> set[str]:
    return {x.key for x in members}


def test_an_empty_pool_is_filled_and_pending_creates_count() -> None:
    assert plan(3, "Recreate", "t", 1, [], 0).creates == 3
    assert plan(3, "Recreate", "t", 1, [], 2).creates == 1
    assert plan(3, "OnReplenish", "t", 1, [m("Provisioning")], 1).creates == 1


def test_failed_members_are_deleted_and_replaced() -> None:
    members = [m("Ready"), m("Error"), m("Stopped"), m("Deleting")]
    step = plan(3, "OnReplenish", "t", 1, members, 0)
    assert keys(step.deletes) == keys(members[1:3])
    assert step.creates == 2  # the Deleting one counts for nothing


def test_scaling_down_deletes_the_not_ready_first_and_ready_ones_last() -> None:
    ready = [m("Ready") for _ in range(3)]
    waiting = m("Provisioning")
    step = plan(2, "OnReplenish", "t", 1, [*ready, waiting], 0)
    assert step.creates == 0
    assert keys(step.deletes) == {waiting.key, ready[0].key}
    assert keys(plan(0, "Recreate", "t", 1, [*ready, waiting], 0).deletes) == keys(
        [*ready, waiting]
    )


def test_recreate_replaces_old_members_only_once_new_ones_are_ready() -> None:
    old = [m("Ready", revision=1) for _ in range(3)]
    first = plan(3, "Recreate", "t", 2, old, 0)
    assert (first.creates, first.deletes) == (3, ())  # nothing old goes before a new is Ready
    waiting = [m("Provisioning", revision=2) for _ in range(3)]
    assert plan(3, "Recreate", "t", 2, [*old, *waiting], 0).deletes == ()
    one_ready = [m("Ready", revision=2), *waiting[1:]]
    step = plan(3, "Recreate", "t", 2, [*old, *one_ready], 0)
    assert step.creates == 0 and len(step.deletes) == 1 and step.deletes[0] in old


def test_recreate_deletes_an_old_member_not_ready_at_once() -> None:
    old_waiting = m("Provisioning", revision=1)
    step = plan(1, "Recreate", "t", 2, [old_waiting], 0)
    assert step.creates == 1 and keys(step.deletes) == {old_waiting.key}


def test_on_replenish_keeps_old_members_and_refills_with_the_current_revision() -> None:
    old = [m("Ready", revision=1) for _ in range(2)]
    step = plan(3, "OnReplenish", "t", 2, old, 0)
    assert step.creates == 1 and step.deletes == ()


def test_a_member_of_another_template_is_old() -> None:
    other = m("Ready", revision=1, template="u")
    assert plan(1, "Recreate", "t", 1, [other], 0).creates == 1


def test_without_the_template_nothing_is_created_and_nothing_ready_is_rolled() -> None:
    members = [m("Ready"), m("Ready")]
    step = plan(3, "Recreate", "t", None, members, 0)
    assert (step.creates, step.deletes) == (0, ())


PHASES = st.sampled_from(["Provisioning", "Starting", "Ready", "Error", "Stopped", "Deleting"])


@given(
    size=st.integers(0, 6),
    strategy=st.sampled_from(["Recreate", "OnReplenish"]),
    members=st.lists(st.tuples(PHASES, st.integers(1, 2)), max_size=10),
    pending=st.integers(0, 4),
)
def test_a_plan_never_drops_ready_members_below_the_size_nor_overfills(
    size: int, strategy: Strategy, members: list[tuple[str, int]], pending: int
) -> None:
    pool = [m(phase, revision) for phase, revision in members]
    step = plan(size, strategy, "t", 2, pool, pending)
    deleted = keys(step.deletes)
    ready_before = sum(x.phase == "Ready" for x in pool)
    ready_after = sum(x.phase == "Ready" and x.key not in deleted for x in pool)
    assert ready_after >= min(size, ready_before)
    assert all(x.phase != "Deleting" for x in step.deletes)
    live_after = sum(x.phase in LIVE and x.key not in deleted for x in pool)
    current = sum(x.phase in LIVE and x.template_revision == 2 for x in pool)
    if strategy == "OnReplenish":
        assert live_after + pending + step.creates == max(size, live_after + pending)
    assert current + pending + step.creates <= max(size, current + pending)


def test_a_held_member_is_set_aside_neither_counted_nor_deleted() -> None:
    """No claim takes a held member: the pool makes another in its place, and deletes none
    while held (a failed one, a surplus one), nor counts one as a failure."""
    held_ready = dataclasses.replace(m("Ready"), held=True)
    held_failed = dataclasses.replace(m("Error"), held=True)
    step = plan(2, "Recreate", "t", 1, [held_ready, held_failed, m("Ready")], 0)
    assert (step.creates, step.deletes) == (1, ())
    assert plan(0, "OnReplenish", "t", 1, [held_ready], 0).deletes == ()
