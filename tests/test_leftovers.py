"""The pure parts of collecting a deleted incarnation's leftovers (services/executor/reconcile.py,
``Executor.collect``): which incarnations the backend holds that no live row is, and when a
leftover delete is still wanted. The real-Podman test is in tests/test_delete_finishes.py."""

from __future__ import annotations

from dataclasses import replace
from uuid import uuid4

import factories as f

from drivers.fake import FakeDriver
from drivers.labels import incarnation_of, workspace_labels
from drivers.protocol import HoldingsDriver, LaunchSpec
from drivers.routing import RoutingDriver
from events.common import Phase, SandboxSpec
from services.executor.intents import Intent, intent_of_row, unwanted
from services.executor.reconcile import LiveRow, leftover_candidates

P = Phase


def test_candidates_are_the_held_incarnations_no_live_row_is() -> None:
    live, old, stranger = uuid4(), uuid4(), uuid4()
    rows = [LiveRow("a", live, 3, P.READY, version=1)]
    held = {("a", live), ("a", old), ("b", stranger)}
    assert leftover_candidates(rows, held) == {("a", old), ("b", stranger)}


def test_a_leftover_delete_is_wanted_only_while_its_incarnation_is_not_live() -> None:
    h = f.harness_in(P.READY)
    row = h.row()
    intent = Intent("delete", row.key, row.sandbox_id, row.generation, "result:leftover:x",
                    "reconciler", leftover=True)  # fmt: skip
    assert unwanted(intent, row) == f"incarnation {row.sandbox_id} is live (Ready)"
    assert unwanted(intent, replace(row, phase=P.DELETING)) is not None  # its delete is under way
    assert unwanted(intent, replace(row, phase=P.DELETED)) is None
    assert unwanted(intent, replace(row, sandbox_id=uuid4())) is None  # the name re-created
    assert unwanted(intent, None) is None  # the tombstone itself pruned
    # An ordinary delete of that incarnation is not wanted after its tombstone.
    assert unwanted(replace(intent, leftover=False), replace(row, phase=P.DELETED)) is not None


def test_incarnation_of_reads_only_our_labels() -> None:
    sandbox_id = uuid4()
    assert incarnation_of(workspace_labels("a-1", sandbox_id)) == ("a-1", sandbox_id)
    labels = workspace_labels("a-1", sandbox_id)
    assert incarnation_of({**labels, "io.sandstream.managed-by": "other"}) is None
    assert incarnation_of({**labels, "io.sandstream.sandbox-id": "nope"}) is None
    assert incarnation_of({**labels, "io.sandstream.key": "Bad Key"}) is None
    assert incarnation_of(None) is None


def test_a_failed_delete_awaiting_its_deadline_is_not_picked_up() -> None:
    h = f.harness_in(P.DELETING)
    assert intent_of_row(h.row()) is not None  # e.g. decided before this executor group joined
    h.send(f.failed(operation="delete", reason="volume in use"))
    assert intent_of_row(h.row()) is None  # its deadline asks again
    assert intent_of_row(replace(h.row(), deadline=None)) is not None  # deadlines off
    deadline = h.row().deadline
    assert deadline is not None
    h.send(f.due(deadline="delete", due_at=deadline.due_at))  # retried: a pick-up may help
    assert intent_of_row(h.row()) is not None


async def test_a_routing_driver_lists_each_backends_incarnations_of_its_own_names() -> None:
    default, routed = FakeDriver(), FakeDriver()
    driver = RoutingDriver(default, routed, prefix="pm-")
    mine, theirs, other = uuid4(), uuid4(), uuid4()
    await default.launch(LaunchSpec("a", mine, 1, "rid", SandboxSpec(image="x")))
    await default.launch(LaunchSpec("pm-b", theirs, 1, "rid", SandboxSpec(image="x")))  # not its
    await routed.launch(LaunchSpec("pm-c", other, 1, "rid", SandboxSpec(image="x")))
    assert isinstance(driver, HoldingsDriver)
    assert await driver.incarnations() == {("a", mine), ("pm-c", other)}
    await default.delete("a", mine)
    assert await driver.incarnations() == {("pm-c", other)}
