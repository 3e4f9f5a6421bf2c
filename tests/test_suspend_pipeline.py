"""Suspend and resume through the whole pipeline (real Kafka and PostgreSQL, the fake driver):
the executor turns SandboxSuspending into the driver's suspend, resume into a launch of a new
generation on the kept workspace; a delete of a suspended sandbox removes the workspace."""

from __future__ import annotations

import factories as f
from harness import eventually, isolated_env
from pipeline_support import command, wait_phase
from test_audit import feed
from test_executor_fake import pipeline
from test_reconcile import OTHER, live, runtime

from drivers.fake import FakeDriver
from drivers.protocol import LaunchSpec
from events.common import Phase
from projections.lifecycle import Sandbox
from services.audit import entries, timeline
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


async def test_the_audit_links_a_suspend_to_the_driver_result_it_got() -> None:
    key = "aud"
    async with isolated_env() as env:
        await env.start_processor()
        await feed(env, [
            f.create(key, occurred_at=f.at(1)), f.launched(key, 1, occurred_at=f.at(2)),
            f.suspend(key, occurred_at=f.at(3)), f.suspended(key, 1, occurred_at=f.at(4)),
            f.resume(key, occurred_at=f.at(5)), f.launched(key, 2, occurred_at=f.at(6)),
        ])  # fmt: skip
        async with env.pool.acquire() as conn:
            recorded = await entries.of_sandbox(conn, key)
        story = timeline.explain(key, timeline.replay(recorded, env.settings.topic_commands))
        calls = [c for cs in story.calls.values() for c in cs]
        assert [(c.operation, c.generation, len(c.results)) for c in calls] == [
            ("launch", 1, 1), ("suspend", 1, 1), ("launch", 2, 1),
        ]  # fmt: skip
