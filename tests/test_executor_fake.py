"""The whole pipeline with the fake driver: deterministic races on real Kafka and PostgreSQL.

The fake driver holds or fails operations on request (``block``, ``fail``), so each race is
set up exactly instead of hoped for; waits poll to a deadline and fail with the last value.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import factories as f
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaTimeoutError
from aiokafka.partitioner import DefaultPartitioner
from harness import Env, eventually, isolated_env
from pipeline_support import (
    caught_up,
    command,
    encode_all,
    events_of,
    forget_group,
    history,
    phase,
    processor_caught_up,
    produce_raw,
    rewind_group,
    row,
    wait_phase,
)

from drivers.fake import FakeDriver
from drivers.protocol import LaunchSpec
from events.common import Phase, SandboxSpec
from events.observations import Operation
from events.publisher import CommandPublisher
from events.topics import record_key
from projections.lifecycle import Sandbox
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.executor.calls import RetryPolicy
from services.executor.driver_side import DriverSide
from services.executor.executor import Executor
from services.executor.intents import Intent, unwanted
from services.executor.progress import PartitionProgress, WorkItem
from services.executor.rows import read_row
from services.up.control_plane import ControlPlane

FAST_RETRY = RetryPolicy(first_delay=0.01, max_delay=0.05, give_up_after=5.0)


@asynccontextmanager
async def pipeline(
    driver: FakeDriver, **plane_args: Any
) -> AsyncIterator[tuple[Env, ControlPlane, CommandPublisher]]:
    plane_args.setdefault("reconcile_interval", 3600)
    plane_args.setdefault("retry", FAST_RETRY)
    async with isolated_env() as env:
        plane = ControlPlane(env.settings, driver, env.pool, **plane_args)
        await plane.start()
        try:
            async with await env.publisher() as pub:
                yield env, plane, pub
        finally:
            await plane.stop()


def executor_of(plane: ControlPlane) -> Executor:
    assert plane.executor is not None
    return plane.executor


async def driver_results(env: Env, key: str) -> list[dict[str, Any]]:
    return [h for h in await history(env, key) if h["message_type"] == "DriverOperationResult"]


def assert_confirms_ready(result: dict[str, Any]) -> None:
    """A launch result either made the row Ready, or the watcher's running snapshot won the
    race and the result only confirmed it; it never moves the row anywhere else."""
    assert result["phase"] == "Ready", result
    if result["disposition"] != "applied":
        assert result["disposition"] == "ignored", result
        assert result["reason"].startswith("no effect in phase Ready"), result["reason"]


# -- scenario 3: head-of-line ---------------------------------------------------------------------


async def test_a_blocked_delete_of_a_does_not_delay_b() -> None:
    driver = FakeDriver()
    async with pipeline(driver) as (env, _, pub):
        await command(env, pub, f.create("a"))
        await wait_phase(env, "a", "Ready")

        held = driver.block("delete", "a")
        await command(env, pub, f.delete("a"))
        await held.entered()

        # B lives a whole life while A's delete is held in the driver.
        await command(env, pub, f.create("b"))
        await wait_phase(env, "b", "Ready", generation=1)
        await command(env, pub, f.stop("b"))
        await wait_phase(env, "b", "Stopped", generation=1)
        await command(env, pub, f.start("b"))
        await wait_phase(env, "b", "Ready", generation=2)
        await command(env, pub, f.restart("b"))
        await wait_phase(env, "b", "Ready", generation=3)
        await command(env, pub, f.delete("b"))
        await wait_phase(env, "b", "Deleted")
        assert await phase(env, "a") == "Deleting"
        assert not held.released and held.held == 1

        held.release()
        await wait_phase(env, "a", "Deleted")
        assert len(driver.calls_for("delete", "a")) == 1
        assert await driver.list() == []


async def test_a_delete_delivered_again_by_a_rebalance_while_it_is_held_runs_once() -> None:
    """A's delete is held in the driver when the executor group rebalances (a member joins and
    leaves): the partition comes back from its committed offset, below the held delete, so the
    same event is queued again behind it. Once the held call has reported, the copy is not run
    (the old code deleted twice; a suite run under load hit it when a heartbeat was late)."""
    driver = FakeDriver()
    async with isolated_env() as env:
        await env.start_processor()
        executor = Executor(env.settings, driver, env.pool, retry=FAST_RETRY, revoke_grace=0.2)
        stop = asyncio.Event()
        await executor.start()
        task = asyncio.create_task(executor.run(stop))
        try:
            async with await env.publisher() as pub:
                await command(env, pub, f.create("a"))
                await wait_phase(env, "a", "Ready")
                held = driver.block("delete", "a")
                await command(env, pub, f.delete("a"))
                await held.entered()

                joiner = AIOKafkaConsumer(
                    **kafka_client_args(env.settings, "executor"),
                    group_id=env.settings.executor_group,
                )
                joiner.subscribe([env.settings.topic_events])
                await joiner.start()
                await eventually(lambda: joiner.assignment(), bool, what="the joiner's share")
                await joiner.stop()
                await eventually(
                    lambda: (len(executor.ownership.owned), executor.pending("a")),
                    lambda seen: seen[0] == 4 and seen[1] >= 2,
                    what="every partition back, A's delete queued again behind the held one",
                )
                held.release()
                await wait_phase(env, "a", "Deleted")
                await eventually(lambda: executor.pending("a"), lambda n: n == 0,
                                 what="A's queue done")  # fmt: skip
        finally:
            stop.set()
            await task
            await executor.stop()
        assert len(driver.calls_for("delete", "a")) == 1
        assert executor.queues.repeated >= 1


# -- ordering and concurrency ---------------------------------------------------------------------


async def test_intents_are_serial_per_sandbox() -> None:
    """A restart accepted while the stop is still in the driver waits for it."""
    driver = FakeDriver()
    async with pipeline(driver) as (env, plane, pub):
        executor = executor_of(plane)
        await command(env, pub, f.create("a"))
        await wait_phase(env, "a", "Ready")
        held = driver.block("stop", "a")
        await command(env, pub, f.stop("a"))
        await held.entered()
        await command(env, pub, f.restart("a"))  # admitted in Stopping: launch generation 2
        await eventually(
            lambda: executor.pending("a"),
            lambda n: n == 2,
            what="the launch queued behind the held stop",
        )
        assert [(c.op, c.generation) for c in driver.calls_for(key="a")] == [
            ("launch", 1),
            ("stop", 1),
        ]
        held.release()
        await wait_phase(env, "a", "Ready", generation=2)
        assert [(c.op, c.generation) for c in driver.calls_for(key="a")] == [
            ("launch", 1),
            ("stop", 1),
            ("launch", 2),
        ]


async def test_concurrency_across_sandboxes_is_bounded() -> None:
    driver = FakeDriver()
    async with pipeline(driver, executor_concurrency=2) as (env, plane, pub):
        executor = executor_of(plane)
        held = driver.block("launch")  # every key
        keys = ["c1", "c2", "c3"]
        for key in keys:
            await command(env, pub, f.create(key))
        # Two calls are in the driver, the third waits for a slot (not for the driver).
        await eventually(
            lambda: (held.held, executor.running, executor.waiting),
            lambda state: state == (2, 2, 1),
            what="two launches held, one waiting for a slot",
        )
        assert len(driver.calls_for("launch")) == 2
        held.release()
        for key in keys:
            await wait_phase(env, key, "Ready")
        assert len(driver.calls_for("launch")) == 3
        assert (executor.running, executor.waiting) == (0, 0)


async def test_a_call_still_waiting_for_a_slot_at_shutdown_is_not_made() -> None:
    """Shutdown leaves queued intents to the next executor; one that was waiting for a
    concurrency slot is queued too, and must not reach the driver once it gets the slot."""
    driver = FakeDriver()
    async with pipeline(driver, executor_concurrency=1) as (env, plane, pub):
        executor = executor_of(plane)
        held = driver.block("launch", "a")
        await command(env, pub, f.create("a"))
        await held.entered()
        await command(env, pub, f.create("b"))
        await eventually(lambda: executor.waiting, lambda n: n == 1, what="b waiting for a slot")
        draining = asyncio.create_task(executor.drain(grace=30))
        await eventually(
            lambda: executor.ownership.closing, bool, what="the executor to be closing"
        )
        held.release()
        await asyncio.wait_for(draining, 30)
        assert len(driver.calls_for("launch", "a")) == 1
        assert driver.calls_for("launch", "b") == []
        assert (executor.running, executor.waiting) == (0, 0)


async def test_superseded_intents_are_skipped() -> None:
    """Queued behind a held launch: a stop, then a delete of the same incarnation. The stop
    is pointless once the delete follows it, and is never run."""
    driver = FakeDriver()
    async with pipeline(driver) as (env, plane, pub):
        executor = executor_of(plane)
        held = driver.block("launch", "s")
        await command(env, pub, f.create("s"))
        await held.entered()
        await command(env, pub, f.stop("s"))
        await command(env, pub, f.delete("s"))
        await eventually(
            lambda: executor.pending("s"),
            lambda n: n == 3,
            what="stop and delete queued behind the launch",
        )
        held.release()
        await wait_phase(env, "s", "Deleted")
        assert [c.op for c in driver.calls_for(key="s")] == ["launch", "delete"]
        assert await driver.list() == []


# -- failures and retries -------------------------------------------------------------------------


async def test_a_retryable_failure_is_retried_until_it_succeeds() -> None:
    driver = FakeDriver()
    driver.fail("launch", "r", "podman: connection refused", retryable=True, times=2)
    async with pipeline(driver) as (env, _, pub):
        await command(env, pub, f.create("r"))
        await wait_phase(env, "r", "Ready")
        assert len(driver.calls_for("launch", "r")) == 3
        # One result for the intent: the success; the failed attempts stay in the executor.
        # (Ready may come from the watcher's snapshot first: wait for the result too.)
        [result] = await eventually(
            lambda: driver_results(env, "r"), bool, what="the launch result recorded"
        )
        assert result["message"]["outcome"] == "succeeded"
        assert_confirms_ready(result)


async def test_a_non_retryable_failure_is_reported_at_once() -> None:
    driver = FakeDriver()
    driver.fail("launch", "n", "podman: image not known", retryable=False)
    async with pipeline(driver) as (env, _, pub):
        await command(env, pub, f.create("n"))
        failed = await wait_phase(env, "n", "Error")
        assert "image not known" in failed["reason"]
        assert len(driver.calls_for("launch", "n")) == 1
        results = await eventually(lambda: driver_results(env, "n"), lambda r: len(r) == 2,
                                   what="the launch's result and its cleanup stop's")  # fmt: skip
        assert sorted(r["message"]["operation"] for r in results) == ["launch", "stop"]
        [launch] = [r for r in results if r["message"]["operation"] == "launch"]
        assert (launch["message"]["outcome"], launch["message"]["retryable"]) == ("failed", False)
        # The cleanup stop of what the launch left changes nothing of the row.
        assert (await wait_phase(env, "n", "Error"))["version"] == failed["version"]


async def test_retries_give_up_and_a_failed_stop_stays_stopping() -> None:
    """The executor gives up after its retry window and reports the failure; the runtime still
    runs, so the row stays Stopping, saying why (it followed the backend back to Ready)."""
    driver = FakeDriver()
    policy = RetryPolicy(first_delay=0.01, max_delay=0.02, give_up_after=0.2)
    async with pipeline(driver, retry=policy) as (env, _, pub):
        await command(env, pub, f.create("g"))
        await wait_phase(env, "g", "Ready")
        driver.fail("stop", "g", "podman: timeout", retryable=True, times=None)
        await command(env, pub, f.stop("g"))
        after = await wait_row_reason(env, "g", "gave up after")
        assert after["phase"] == "Stopping"
        assert after["reason"].startswith("StopFailed: still Stopping (retries so far: 0; ")
        assert len(driver.calls_for("stop", "g")) > 2


async def test_a_later_intent_ends_the_retries_of_an_earlier_one() -> None:
    driver = FakeDriver()
    patient = RetryPolicy(first_delay=0.5, max_delay=5.0, give_up_after=600)
    driver.fail("launch", "l", "podman: connection refused", retryable=True, times=None)
    async with pipeline(driver, retry=patient) as (env, _, pub):
        await command(env, pub, f.create("l"))
        await eventually(
            lambda: len(driver.calls_for("launch", "l")),
            lambda n: n >= 2,
            what="the launch being retried",
        )
        await command(env, pub, f.delete("l"))
        await wait_phase(env, "l", "Deleted", timeout=5)  # not 10 minutes of retries
        results = await driver_results(env, "l")
        launch = next(r for r in results if r["message"]["operation"] == "launch")
        assert "a later intent of the sandbox is queued" in launch["message"]["reason"]
        assert launch["disposition"] == "ignored"  # the row was Deleting by then


async def wait_row_reason(env: Env, key: str, text: str) -> dict[str, Any]:
    found = await eventually(
        lambda: row(env, key),
        lambda r: r is not None and text in (r["reason"] or ""),
        what=f"{key} reason containing {text!r}",
    )
    assert found is not None
    return found


# -- redelivery and rebalances --------------------------------------------------------------------


async def test_a_replayed_log_calls_no_driver_for_what_the_rows_moved_past() -> None:
    """An executor whose group committed offset is old (as after a crash long ago) reads the
    log again: every intent is checked against its row, and none the rows moved past reaches
    the driver or reports a result."""
    driver = FakeDriver()
    async with isolated_env() as env:
        plane = ControlPlane(env.settings, driver, env.pool, reconcile_interval=3600)
        await plane.start()
        try:
            async with await env.publisher() as pub:
                await command(env, pub, f.create("x"))
                await command(env, pub, f.create("y"))
                await command(env, pub, f.create("z"))
                await wait_phase(env, "x", "Ready")
                await wait_phase(env, "y", "Ready", generation=1)
                await wait_phase(env, "z", "Ready")
                await command(env, pub, f.restart("y"))
                await wait_phase(env, "y", "Ready", generation=2)
                await command(env, pub, f.stop("x"))
                await wait_phase(env, "x", "Stopped")
                await command(env, pub, f.delete("z"))
                await wait_phase(env, "z", "Deleted")
        finally:
            await plane.stop()
        # The rows may have moved on the watcher's observations before the executor's results
        # were applied: let a processor apply everything already in the log first.
        await env.start_processor()
        await eventually(lambda: processor_caught_up(env), bool, what="the log applied")
        before = await driver.list()
        calls = len(driver.calls)
        rows_before = [await row(env, k) for k in ("x", "y", "z")]
        results_before = [len(await driver_results(env, k)) for k in ("x", "y", "z")]
        observed_before = len(await env.read_topic(env.settings.topic_observations))

        await rewind_group(env.settings, env.settings.executor_group)
        again = Executor(env.settings, driver, env.pool, retry=FAST_RETRY)
        await again.start()
        stop = asyncio.Event()
        task = asyncio.create_task(again.run(stop))
        try:
            await eventually(
                lambda: caught_up(env.settings, env.settings.executor_group),
                bool,
                what="the old executor group committed the end of the log again",
            )
        finally:
            stop.set()
            await task
            await again.stop()
        assert again.dropped >= 4  # launch x, stop x, launch y g2, delete z (+ launch y g1, z)
        assert len(driver.calls) == calls  # no driver call at all
        assert len(await env.read_topic(env.settings.topic_observations)) == observed_before
        await eventually(lambda: processor_caught_up(env), bool, what="the log applied")
        assert await driver.list() == before
        assert [await row(env, k) for k in ("x", "y", "z")] == rows_before
        assert [len(await driver_results(env, k)) for k in ("x", "y", "z")] == results_before


async def test_a_new_executor_group_starts_where_the_decided_work_begins() -> None:
    """Commands decided while no executor ran (the separate-process layout, an executor joining
    later): a new executor group reads their intents from the log at once, well before the
    reconcile loop at its real interval (30 s: it hands a row over at its second pass) could,
    and the intents the rows moved past call no driver. Once
    no row waits, a new group starts at the end (it reads nothing), and an executor of a group
    with committed offsets resumes from them (it reads nothing either)."""
    driver = FakeDriver()
    async with isolated_env() as env:
        await env.start_processor()
        async with await env.publisher() as pub:
            await command(env, pub, f.create("early"))
            await command(env, pub, f.create("gone"))
            await command(env, pub, f.delete("gone"))
            assert await phase(env, "early") == "Provisioning"
            assert await phase(env, "gone") == "Deleting"

            assert env.settings.reconcile_interval_seconds == 30

            def driver_side() -> DriverSide:
                return DriverSide(env.settings, driver, env.pool, retry=FAST_RETRY)

            side = driver_side()
            await side.start()
            try:
                await wait_phase(env, "early", "Ready", timeout=15)
                await wait_phase(env, "gone", "Deleted", timeout=15)
                await command(env, pub, f.create("late"))  # decided after the group joined
                await wait_phase(env, "late", "Ready")
                assert side.reconciler is not None and side.reconciler.picked_up == 0
            finally:
                await side.stop()
        assert len(driver.calls_for("launch", "early")) == 1
        assert len(driver.calls_for("delete", "gone")) == 1
        assert len(driver.calls_for("launch", "gone")) == 0  # superseded by its delete
        assert len(driver.calls_for("launch", "late")) == 1

        def operations() -> int:  # driver calls that act (a reconcile pass lists)
            return sum(1 for c in driver.calls if c.op != "list")

        calls = operations()

        group = env.settings.executor_group
        for new_group in (True, False):
            if new_group:
                await forget_group(env.settings, group)
            side = driver_side()
            await side.start()
            try:
                await eventually(lambda: caught_up(env.settings, group), bool,
                                 what="the executor group at the end of the log")  # fmt: skip
                assert side.executor is not None
                assert (side.executor.dropped, side.executor.skipped) == (0, 0), new_group
            finally:
                await side.stop()
        assert operations() == calls


class DatabaseDown:
    """A pool whose every query fails to connect (PostgreSQL down, injected)."""

    async def fetch(self, *_: object) -> None:
        raise ConnectionRefusedError("postgresql down (injected)")


async def test_a_new_group_that_cannot_read_the_rows_joins_at_the_end() -> None:
    """PostgreSQL is down while a new executor group joins: it cannot find its waiting rows,
    so it starts (and commits) at the end as before, at once, rather than failing the
    assignment (no position fixed, ``start`` waiting out its whole assign timeout)."""
    async with isolated_env() as env:
        executor = Executor(env.settings, FakeDriver(), DatabaseDown(), assign_timeout=20)  # type: ignore[arg-type]
        await executor.start()
        try:
            assert executor.intake.assigned.is_set()
            assert await caught_up(env.settings, env.settings.executor_group)
        finally:
            await executor.stop()


async def test_a_new_group_that_cannot_look_up_offsets_by_time_joins_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row waits, but the broker does not answer the look-up by time (a timeout, injected):
    the new group starts (and commits) at the end at once, and the reconcile loop is left to
    hand the row over, rather than the assignment failing."""
    async with isolated_env() as env:
        await env.start_processor()
        async with await env.publisher() as pub:
            await command(env, pub, f.create("waiting"))
        assert await phase(env, "waiting") == "Provisioning"

        async def no_answer(*_: object) -> None:
            raise KafkaTimeoutError("no answer (injected)")

        monkeypatch.setattr(AIOKafkaConsumer, "offsets_for_times", no_answer)
        executor = Executor(env.settings, FakeDriver(), env.pool, assign_timeout=20)
        await executor.start()
        try:
            assert executor.intake.assigned.is_set()
            assert await caught_up(env.settings, env.settings.executor_group)
        finally:
            await executor.stop()


async def test_an_older_generation_left_running_under_a_newer_row_is_stopped() -> None:
    """Found by the chaos checker: generation 1 of x was launched by an executor that died
    before reporting it; x is then restarted and stopped, so its row is Stopping generation 2
    and no event will ask to stop generation 1 again. The executor group has read the log to
    its end already (else the restart's dropped launch, read again, stops generation 1 itself,
    and which path wins is timing: a CI run's failure): its reconcile loop sees generation 1
    still running under the newer row and stops it (before the fix it ran on under a Stopped
    row)."""
    driver = FakeDriver()
    async with isolated_env() as env:
        await env.start_processor()
        async with await env.publisher() as pub:
            await command(env, pub, f.create("x"))
            created = await read_row(env.pool, "x")
            assert created is not None
            await driver.launch(
                LaunchSpec("x", created.sandbox_id, 1, created.identity, created.spec)
            )
            await produce_raw(env, encode_all([f.running("x", generation=1)]))
            await wait_phase(env, "x", "Ready")
            await command(env, pub, f.restart("x"))
            await command(env, pub, f.stop("x"))
            assert (await row(env, "x") or {}).get("generation") == 2
            assert [(r.generation, r.state) for r in await driver.get("x")] == [(1, "running")]
            await eventually(lambda: events_of(env, "x"), lambda types: types[-1:] == [
                "SandboxStopping"], what="the stop's event in the log")  # fmt: skip
            await rewind_group(env.settings, env.settings.executor_group, offset=None)
            side = DriverSide(
                env.settings, driver, env.pool, reconcile_interval=0.3, retry=FAST_RETRY
            )
            await side.start()
            try:
                await wait_phase(env, "x", "Stopped")
                await eventually(
                    lambda: driver.get("x"),
                    lambda runtimes: [(r.generation, r.state) for r in runtimes] == [(1, "exited")],
                    what="generation 1 of x stopped",
                )
                assert side.reconciler is not None and side.reconciler.stale_stopped >= 1
            finally:
                await side.stop()
        assert len(driver.calls_for("launch", "x")) == 1  # the one made before any executor


async def test_an_intent_in_flight_during_a_rebalance_is_not_lost_or_doubled() -> None:
    """A second executor joins while the first holds a launch in the driver: the first
    drops what it had queued, commits below the held launch and gives partitions away; the
    held launch still completes and reports; every sandbox ends with exactly one runtime."""
    driver = FakeDriver()
    async with isolated_env() as env:
        await env.start_processor()
        first = Executor(env.settings, driver, env.pool, retry=FAST_RETRY, revoke_grace=0.2)
        second = Executor(env.settings, driver, env.pool, retry=FAST_RETRY)
        stop = asyncio.Event()
        await first.start()
        tasks = [asyncio.create_task(first.run(stop))]
        try:
            async with await env.publisher() as pub:
                held = driver.block("launch", "held")
                await command(env, pub, f.create("held"))
                await held.entered()
                others = [f"k{i}" for i in range(6)]
                for key in others:
                    await command(env, pub, f.create(key))
                for key in others:
                    await wait_phase(env, key, "Ready")
                runtimes_before = {r.key: r.runtime_id for r in await driver.list()}

                await second.start()
                tasks.append(asyncio.create_task(second.run(stop)))
                await eventually(
                    lambda: (len(first.ownership.owned), len(second.ownership.owned)),
                    lambda owned: owned[0] > 0 and owned[1] > 0 and sum(owned) == 4,
                    what="the partitions shared by both executors",
                )
                held.release()
                await wait_phase(env, "held", "Ready")
                # More work after the rebalance flows through whichever executor owns it.
                for key in others:
                    await command(env, pub, f.stop(key))
                for key in others:
                    await wait_phase(env, key, "Stopped")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await first.stop()
            await second.stop()
        runtimes = {r.key: r.runtime_id for r in await driver.list()}
        assert sorted(runtimes) == sorted(["held", *others])
        assert {k: runtimes[k] for k in others} == runtimes_before  # nothing launched anew
        # Offsets are committed below the oldest unfinished intent of each partition (at the
        # latest when it is revoked): launches in other partitions than the held one's were
        # never run again; those after it in its partition may be (idempotently).
        partition = {h["key"]: h["partition"] for h in await env.fetch(
            "SELECT key, partition FROM history WHERE message_type = 'CreateSandbox'")}  # fmt: skip
        for key in others:
            runs = len(driver.calls_for("launch", key))
            assert runs == 1 or (runs == 2 and partition[key] == partition["held"]), key
        assert len(driver.calls_for("launch", "held")) in (1, 2)
        results = await driver_results(env, "held")
        assert [r["message"]["outcome"] for r in results] == ["succeeded"] * len(results) != []
        for result in results:
            assert_confirms_ready(result)


async def commands_queued_behind_a_busy_lane(
    driver: FakeDriver, makes: list[Any], generation: int
) -> int:
    """y is Ready; the caller's slow lane (one wide) is busy with a held delete of another
    sandbox (a stop takes no lane) while ``makes`` are decided for y, the last a stop of
    ``generation``; then the lane is freed and y must end Stopped at that generation. The
    executor's dropped intents."""
    async with isolated_env() as env:
        settings = env.settings.model_copy(update={"executor_slow_per_caller": 1})
        plane = ControlPlane(settings, driver, env.pool, reconcile_interval=3600, retry=FAST_RETRY)
        await plane.start()
        try:
            async with await env.publisher() as pub:
                await command(env, pub, f.create("blocker"))
                await command(env, pub, f.create("y"))
                await wait_phase(env, "blocker", "Ready")
                await wait_phase(env, "y", "Ready")
                held = driver.block("delete", "blocker")
                await command(env, pub, f.delete("blocker"))
                await held.entered()  # the caller's lane is taken
                for make in makes:
                    await command(env, pub, make("y"))
                await wait_phase(env, "y", "Stopping", generation=generation)
                held.release()
                await wait_phase(env, "y", "Stopped", generation=generation)
                return executor_of(plane).dropped
        finally:
            await plane.stop()


async def test_a_restart_overtaken_by_a_stop_is_dropped_and_still_stops_the_older_generation() -> (
    None
):
    """y's restart waits for the busy lane; a stop of y is decided meanwhile. The restart's
    launch is dropped (the row is Stopping generation 2), generation 1 is stopped instead of
    left running, and y ends Stopped with no generation 2 runtime."""
    driver = FakeDriver()
    assert await commands_queued_behind_a_busy_lane(driver, [f.restart, f.stop], 2) == 1
    assert [c.generation for c in driver.calls_for("launch", "y")] == [1]
    assert [c.generation for c in driver.calls_for("stop", "y")] == [1, 2]
    assert [(i.generation, i.state) for i in await driver.get("y")] == [(1, "exited")]


async def test_a_chain_of_restarts_and_stops_overtaken_in_the_queue_stops_the_oldest_runtime() -> (
    None
):
    """Found by the chaos checker: y's restart, stop, restart, stop queue up behind the busy
    lane (the chain began with a stop then; a stop now takes no lane, so it runs at once and
    the first restart is what waits). The launches are skipped or dropped and never run, so
    the runtime still running is generation 1, not the last launch's previous generation (2):
    it must be stopped, not left running under a Stopped row."""
    driver = FakeDriver()
    chain = [f.restart, f.stop, f.restart, f.stop]
    await commands_queued_behind_a_busy_lane(driver, chain, 3)
    assert [c.generation for c in driver.calls_for("launch", "y")] == [1]
    assert [(i.generation, i.state) for i in await driver.get("y")] == [(1, "exited")]


def test_an_executor_picks_up_only_sandboxes_of_its_own_partitions() -> None:
    """The reconcile loop runs in every executor process; a row is picked up only by the
    executor that owns its partition (the one the producer's partitioner chose)."""
    settings = Settings().model_copy(update={"kafka_partitions": 4, "topic_events": "ev"})
    executor = Executor(settings, FakeDriver(), None)  # type: ignore[arg-type]
    executor.ownership.owned = {TopicPartition("ev", 2): PartitionProgress()}
    for key in [f"sb-{i}" for i in range(40)]:
        chosen = DefaultPartitioner()(record_key(key), [0, 1, 2, 3], [0, 1, 2, 3])
        assert executor.owns(key) == (chosen == 2), key


def test_a_picked_up_intent_stops_being_ours_when_its_partition_is_revoked() -> None:
    """A stuck row's intent queued by the pick-up is run only while this executor still owns
    the sandbox's partition: after a rebalance gave it away, the new owner acts on it, not
    both."""
    settings = Settings().model_copy(update={"kafka_partitions": 4, "topic_events": "ev"})
    executor = Executor(settings, FakeDriver(), None)  # type: ignore[arg-type]
    key = "sb-1"
    partition = DefaultPartitioner()(record_key(key), [0, 1, 2, 3], [0, 1, 2, 3])
    executor.ownership.owned = {TopicPartition("ev", partition): PartitionProgress()}
    intent = Intent("launch", key, uuid.uuid4(), 1, "result:row:x:1", "reconciler")
    item = WorkItem(intent)  # picked up from a row: no partition offset of its own
    assert executor.ownership.current(item)
    executor.ownership.owned = {}  # revoked
    assert not executor.ownership.current(item)


async def test_a_partition_revoked_while_its_offsets_are_committed_does_not_stop_the_executor() -> (
    None
):
    """The periodic commit awaits the broker; a rebalance revoking one of the partitions in
    that await must not break the commit (a KeyError there ended ``run`` and left the
    executor's partitions assigned to nobody working)."""
    settings = Settings().model_copy(update={"kafka_partitions": 2, "topic_events": "ev"})
    executor = Executor(settings, FakeDriver(), None)  # type: ignore[arg-type]
    kept, revoked = TopicPartition("ev", 0), TopicPartition("ev", 1)
    executor.ownership.owned = {
        kept: PartitionProgress(highest_seen=4),
        revoked: PartitionProgress(),
    }
    revoked_progress = executor.ownership.owned[revoked]
    revoked_progress.highest_seen = 9
    sent: list[dict[TopicPartition, int]] = []

    class RevokedMidCommit:
        """The part of the consumer ``commit`` uses; a rebalance happens during the call."""

        async def commit(self, offsets: dict[TopicPartition, int]) -> None:
            sent.append(dict(offsets))
            executor.ownership.owned.pop(revoked)

    executor.intake.consumer = RevokedMidCommit()  # type: ignore[assignment]
    await executor.commit()
    assert sent == [{kept: 5, revoked: 10}]
    assert executor.ownership.owned[kept].committed == 5
    assert revoked_progress.committed == 10


def test_the_row_decides_which_intents_are_still_wanted() -> None:
    """``unwanted`` (pure): each operation against the rows that want it and those that moved
    past it."""
    sid, other = uuid.uuid4(), uuid.uuid4()
    now = datetime(2026, 1, 1, tzinfo=UTC)
    spec = SandboxSpec(image="busybox")

    def row(phase: Phase, generation: int = 2, sandbox_id: UUID = sid) -> Sandbox:
        return Sandbox("k", sandbox_id, phase, generation, 5, spec, (), "id", None, None, now, now)

    def intent(operation: Operation, generation: int = 2) -> Intent:
        return Intent(operation, "k", sid, generation, "r", "alice")

    wanted = [
        ("launch", row(Phase.PROVISIONING)),
        ("launch", row(Phase.STARTING)),
        ("stop", row(Phase.STOPPING)),
        ("delete", row(Phase.DELETING)),
        ("delete", row(Phase.DELETING, generation=3)),  # a delete covers every generation
    ]
    for operation, current in wanted:
        assert unwanted(intent(operation), current) is None, (operation, current.phase)
    moved_past = [
        ("launch", row(Phase.READY)),  # launched already
        ("launch", row(Phase.STOPPED)),  # stopped: never resurrected
        ("launch", row(Phase.STARTING, generation=3)),  # a newer start
        ("stop", row(Phase.STOPPED)),
        ("stop", row(Phase.STOPPING, generation=3)),
        ("delete", row(Phase.DELETED)),  # the tombstone
        ("delete", row(Phase.DELETING, sandbox_id=other)),  # a re-created name
        ("launch", row(Phase.PROVISIONING, sandbox_id=other)),
        ("launch", None),
    ]
    for operation, maybe in moved_past:
        assert unwanted(intent(operation), maybe) is not None, (operation, maybe)
    # A stale generation's stop (generation 2) is wanted while the row is at a newer one and
    # not launching it.
    stale = replace(intent("stop"), stale=True)
    for moved_on in (Phase.READY, Phase.STOPPING, Phase.STOPPED, Phase.ERROR):
        assert unwanted(stale, row(moved_on, generation=3)) is None, moved_on
    for current in (
        row(Phase.STOPPED),  # the row's own generation: not stale
        row(Phase.STARTING, generation=3),  # its launch removes generation 2
        row(Phase.STOPPED, generation=3, sandbox_id=other),
        None,
    ):
        assert unwanted(stale, current) is not None, current
    # A stray's stop (generation 2 running under a Stopped row of generation 2) is wanted only
    # while the row is still Stopped at that generation.
    stray = replace(intent("stop"), stray=True)
    assert unwanted(stray, row(Phase.STOPPED)) is None
    for current in (
        row(Phase.STARTING, generation=3),  # started again: the launch replaces it
        row(Phase.STOPPED, generation=3),
        row(Phase.READY),
        row(Phase.DELETING),
        row(Phase.STOPPED, sandbox_id=other),
        None,
    ):
        assert unwanted(stray, current) is not None, current
