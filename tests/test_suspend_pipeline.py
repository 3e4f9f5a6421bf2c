"""Suspend and resume through the whole pipeline (real Kafka and PostgreSQL, the fake driver):
the executor turns SandboxSuspending into the driver's suspend, resume into a launch of a new
generation on the kept workspace; a delete of a suspended sandbox removes the workspace."""

from __future__ import annotations

import factories as f
from harness import eventually
from pipeline_support import command, wait_phase
from test_executor_fake import pipeline
from test_reconcile import OTHER, live, runtime

from drivers.fake import FakeDriver
from drivers.protocol import LaunchSpec
from events.common import Phase
from projections.lifecycle import Sandbox
from services.executor.intents import Intent, intent_of_row, takes_lane, unwanted
from services.executor.reconcile import suspended_leftovers


async def test_suspend_removes_the_runtime_keeps_the_workspace_and_resume_launches_anew() -> None:
    driver = FakeDriver()
    async with pipeline(driver) as (env, _, pub):
        await command(env, pub, f.create("s"))
        await wait_phase(env, "s", "Ready")
        await command(env, pub, f.suspend("s"))
        await wait_phase(env, "s", "Suspended", generation=1)
        assert await driver.get("s") == [] and driver.has_workspace("s")
        await command(env, pub, f.resume("s"))
        await wait_phase(env, "s", "Ready", generation=2)
        changes = [c for c in driver.calls_for(key="s") if c.op not in ("get", "list")]
        assert [(c.op, c.generation) for c in changes] == [
            ("launch", 1),
            ("suspend", 1),
            ("launch", 2),
        ]
        await command(env, pub, f.suspend("s"))
        await wait_phase(env, "s", "Suspended", generation=2)
        await command(env, pub, f.delete("s"))
        await wait_phase(env, "s", "Deleted")
        assert not driver.has_workspace("s")


def test_a_suspending_row_wants_the_suspend_and_nothing_else() -> None:
    h = f.Harness()
    h.send(f.create(), f.running(), f.suspend())
    row: Sandbox = h.row()
    intent = intent_of_row(row)
    assert intent is not None and intent.operation == "suspend"
    assert unwanted(intent, row) is None
    # A stop's deadline counts from its decision: the suspend takes no lane either.
    assert not takes_lane(intent)
    h.send(f.suspended())
    assert unwanted(intent, h.row()) == f"the row is Suspended (version {h.row().version})"
    launch = Intent("launch", row.key, row.sandbox_id, row.generation, "r", "u")
    assert unwanted(launch, row) is not None


def test_the_reconcile_loop_finds_a_runtime_left_under_a_suspended_row() -> None:
    rows = [
        live("s", 3, Phase.SUSPENDED),
        live("stopped", 2, Phase.STOPPED),
        live("other", 2, Phase.SUSPENDED),
    ]
    runtimes = [
        runtime("s", 3, "exited"),  # any state: a suspend removes it
        runtime("s", 2, "exited"),  # older: a stale runtime or an orphan, as under any row
        runtime("stopped", 2, "exited"),
        runtime("other", 2, sandbox_id=OTHER),  # another incarnation
    ]
    assert [(r.key, r.generation) for r in suspended_leftovers(rows, runtimes)] == [("s", 3)]


async def test_a_runtime_started_behind_a_suspended_rows_back_is_removed_again() -> None:
    driver = FakeDriver()
    async with pipeline(driver, reconcile_interval=0.2) as (env, _plane, pub):
        await command(env, pub, f.create("s"))
        await wait_phase(env, "s", "Ready")
        await command(env, pub, f.suspend("s"))
        suspended = await wait_phase(env, "s", "Suspended", generation=1)
        spec = LaunchSpec("s", suspended["sandbox_id"], 1, suspended["identity"], f.spec())
        await driver.launch(spec)  # behind sandstream's back
        await eventually(lambda: driver.get("s"), lambda found: found == [], what="removed")
        assert driver.has_workspace("s")
        assert (await wait_phase(env, "s", "Suspended", generation=1))["version"] == suspended[
            "version"
        ]
