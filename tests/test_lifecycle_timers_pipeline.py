"""Deadlines, time to live, completion policy and holds on the real stack: Kafka, PostgreSQL,
the scheduler (in process, or as its own process that gets killed), and Podman where a runtime
is involved. Durations are made short through the settings; waits poll a condition.

Commands here carry the current time (``occurred_at``): deadlines are computed from it.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import factories as f
import pytest
from harness import Env, eventually, isolated_env
from pipeline_support import (
    IGNORE_TERM,
    SLEEPER,
    command,
    containers_of,
    events_of,
    history,
    observations_of,
    podman_env,
    running_plane,
    sandbox_spec,
    status_of,
    trap_set,
    wait_phase,
    wait_row,
)
from podman import PodmanClient

from drivers.fake import FakeDriver
from drivers.podman import container_name
from drivers.protocol import LaunchSpec
from events.codec import EVENTS, OBSERVATIONS, decode, encode
from events.publisher import now
from projections.store import BatchWrite, write_batch
from services.api.readmodel import await_outcome
from services.common.settings import PROJECT_ROOT
from services.executor.backends import podman_driver
from services.executor.executor import Executor
from services.processor.rebuild import rebuild_and_compare
from services.scheduler.scheduler import Scheduler

# Short deadlines for these tests (seconds); the defaults are minutes.
FAST = {
    "launch_timeout_seconds": 1.0,
    # The launch deadline lies beyond the executor's retry window (projections.lifecycle).
    "executor_retry_seconds": 1.0,
    "stop_margin_seconds": 1.0,
    "delete_retry_seconds": 0.5,
    "delete_retry_max_seconds": 2.0,
    "scheduler_poll_seconds": 0.5,
}
WAIT = 60.0


@asynccontextmanager
async def fast_env(**update: Any) -> AsyncIterator[Env]:
    async with isolated_env() as env:
        env.settings = env.settings.model_copy(update={**FAST, **update})
        yield env


@asynccontextmanager
async def scheduler_in(env: Env) -> AsyncIterator[Scheduler]:
    scheduler = Scheduler(env.settings, env.pool)
    await scheduler.start()
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler.run(stop))
    try:
        yield scheduler
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await scheduler.stop()


def spawn_scheduler(env: Env) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.scheduler"],
        cwd=PROJECT_ROOT,
        env=env.env_vars(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def deadline_results(env: Env, key: str) -> list[tuple[str, str]]:
    """(disposition, reason) of every DeadlineDue of ``key`` in its history."""
    return [
        (h["disposition"], h["reason"])
        for h in await history(env, key)
        if h["message_type"] == "DeadlineDue"
    ]


async def deadline_messages(env: Env) -> list[Any]:
    records = await env.read_topic(env.settings.topic_observations)
    found = [decode(OBSERVATIONS, r.value) for r in records]
    return [o for o in found if o.type == "DeadlineDue"]


# -- deadlines ------------------------------------------------------------------------------------


async def test_a_sandbox_stuck_in_provisioning_times_out_and_is_cleaned_up() -> None:
    """No executor ever launches it: the launch deadline falls due, the fold makes it Error
    (ProvisioningTimeout) and asks the executor to clean up (SandboxTimedOut)."""
    async with fast_env() as env, scheduler_in(env):
        await env.start_processor()
        async with await env.publisher() as pub:
            await command(env, pub, f.create("stuck", occurred_at=now()))
            row = await wait_phase(env, "stuck", "Error", timeout=WAIT)
        assert row["reason"] == "ProvisioningTimeout"
        applied = [d for d, _ in await deadline_results(env, "stuck") if d == "applied"]
        assert applied == ["applied"]
        assert await events_of(env, "stuck") == ["SandboxCreated", "SandboxTimedOut"]


async def test_a_launch_timeout_stops_a_runtime_that_comes_up_late() -> None:
    """The launch is held in the driver past its deadline; once it goes through, the cleanup
    intent (a stop of that generation) follows it."""
    driver = FakeDriver()
    held = driver.block("launch", "late")
    async with fast_env() as env, running_plane(env, driver, with_scheduler=True):
        async with await env.publisher() as pub:
            await command(env, pub, f.create("late", occurred_at=now()))
            await held.entered()
            await wait_row(env, "late", lambda r: r["reason"] == "ProvisioningTimeout",
                           "to time out", timeout=WAIT)  # fmt: skip
            held.release()
            await eventually(lambda: driver.calls_for("stop", "late"), bool, timeout=WAIT,
                             what="the cleanup stop")  # fmt: skip
        (runtime,) = await driver.get("late")
        assert runtime.state == "exited"


async def test_a_stop_outliving_grace_plus_margin_is_escalated_to_a_kill(
    podman: PodmanClient,
) -> None:
    """The processor expects a 1 s grace period, but the driver's stop waits 600 s on an
    entrypoint that ignores SIGTERM: the stop deadline falls due and the executor kills it."""
    async with podman_env(podman, "esc") as (env, _, keys):
        # The launch deadline is not what this test is about: long enough that a launch on a
        # loaded machine cannot time out (a cleanup stop would end the agent before its stop).
        slow_launch = {"launch_timeout_seconds": WAIT}
        env.settings = env.settings.model_copy(
            update={**FAST, **slow_launch, "stop_timeout_seconds": 1}
        )
        driver = podman_driver(env.settings, stop_timeout=600)
        key = keys()
        try:
            async with (
                running_plane(env, driver, with_scheduler=True, removing=keys),
                await env.publisher() as pub,
            ):
                spec = sandbox_spec(env.settings, IGNORE_TERM)
                await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
                await wait_phase(env, key, "Ready", timeout=WAIT)
                await trap_set(driver, key, 1)
                await command(env, pub, f.stop(key, occurred_at=now()))
                await wait_phase(env, key, "Stopped", timeout=WAIT)
                inspect = podman.containers.get(container_name(key, 1)).attrs
                assert inspect["State"]["ExitCode"] == 137  # killed
        finally:
            await driver.close()
        assert "SandboxStopEscalated" in await events_of(env, key)
        assert [d for d, _ in await deadline_results(env, key)] == ["applied"]


async def test_a_delete_that_does_not_finish_is_retried_visibly_with_back_off() -> None:
    """The delete hangs in the driver: the row counts the retries, each waits longer, and the
    executor does not pile a second delete onto the one still running."""
    driver = FakeDriver()
    async with fast_env(stop_timeout_seconds=0) as env:
        async with running_plane(env, driver, with_scheduler=True), await env.publisher() as pub:
            await command(env, pub, f.create("slow", occurred_at=now()))
            await wait_phase(env, "slow", "Ready", timeout=WAIT)
            held = driver.block("delete", "slow")
            await command(env, pub, f.delete("slow", occurred_at=now()))
            await held.entered()
            row = await wait_row(
                env,
                "slow",
                lambda r: (r["reason"] or "").endswith("retry 2"),
                "two delete retries",
                timeout=WAIT,
            )
            assert row["phase"] == "Deleting"
            # Two retries fell due while the first delete hung: none reached the driver.
            assert len(driver.calls_for("delete", "slow")) == 1
            held.release()
            await wait_phase(env, "slow", "Deleted", timeout=WAIT)
        # (After the release a retry may still call delete once more, before the first delete's
        # result reaches the row: the driver then finds nothing left. That is not a pile-on.)
        retries = [e for e in await events_of(env, "slow") if e == "SandboxDeleteRetried"]
        assert len(retries) >= 2
        # Each retry's deadline is further out than the one before (back-off).
        records = await env.read_topic(env.settings.topic_events)
        decided = [decode(EVENTS, r.value) for r in records if r.key == b"slow"]
        waits = [
            (e.deadline.due_at - e.occurred_at).total_seconds()
            for e in decided
            if e.type == "SandboxDeleteRetried"
        ]
        assert waits == sorted(waits) and waits[0] < waits[-1]


# -- the scheduler killed and restarted ------------------------------------------------------------


async def test_a_killed_scheduler_catches_up_on_restart_and_nothing_fires_twice() -> None:
    """The scheduler publishes the first deadlines while the processor is away and is
    SIGKILLed; more deadlines fall due while none runs; a new scheduler (it keeps nothing)
    publishes everything due, the first ones again. Once the processor is back, every sandbox
    timed out exactly once: the repeats are ignored."""
    async with fast_env() as env:
        processor = await env.start_processor()
        first = [f"sb-{i}" for i in range(6)]
        later = [f"sb-{i}" for i in range(6, 12)]
        async with await env.publisher() as pub:
            for key in first:  # due in a second
                await command(env, pub, f.create(key, occurred_at=now()))
            for key in later:  # due once the first scheduler is gone
                await command(env, pub, f.create(key, occurred_at=now() + timedelta(seconds=10)))
        await env.stop_processor(processor)  # what the schedulers publish waits for it

        scheduler = spawn_scheduler(env)
        try:
            found = await eventually(
                lambda: deadline_messages(env),
                lambda found: {m.key for m in found} >= set(first),
                timeout=WAIT,
                what="the first deadlines published",
            )
        finally:
            scheduler.send_signal(signal.SIGKILL)
            scheduler.wait(30)
        assert {m.key for m in found} == set(first)
        await eventually(
            lambda: env.fetchval("SELECT count(*) FROM sandboxes WHERE deadline_at > now()"),
            lambda n: n == 0,
            timeout=WAIT,
            what="every deadline to be due",
        )

        scheduler = spawn_scheduler(env)
        try:
            expected = Counter({**dict.fromkeys(first, 2), **dict.fromkeys(later, 1)})
            await eventually(
                lambda: deadline_messages(env),
                lambda found: Counter(m.key for m in found) == expected,
                timeout=WAIT,
                what="the restarted scheduler to catch up",
            )
            await env.start_processor("p2")
            for key in first + later:
                await wait_phase(env, key, "Error", timeout=WAIT)
        finally:
            scheduler.send_signal(signal.SIGTERM)
            code = scheduler.wait(30)
        assert code == 0, scheduler.stderr.read() if scheduler.stderr else ""

        for key in first:
            results = await deadline_results(env, key)
            assert [d for d, _ in results] == ["applied", "ignored"], results
            assert "not pending" in results[1][1]
        for key in later:
            assert [d for d, _ in await deadline_results(env, key)] == ["applied"]
        for key in first + later:
            assert (await events_of(env, key)).count("SandboxTimedOut") == 1


# -- time to live and the completion policy (Podman) -----------------------------------------------


@pytest.mark.parametrize(("policy", "final"), [("stop", "Stopped"), ("delete", "Deleted")])
async def test_time_to_live_stops_or_deletes(podman: PodmanClient, policy: str, final: str) -> None:
    async with podman_env(podman, "ttl") as (env, driver, keys):
        env.settings = env.settings.model_copy(update=FAST)
        key = keys()
        async with (
            running_plane(env, driver, with_scheduler=True, removing=keys),
            await env.publisher() as pub,
        ):
            spec = sandbox_spec(env.settings, SLEEPER)
            create = f.create(
                key, sandbox_spec=spec, ttl_seconds=2, on_expiry=policy, occurred_at=now()
            )
            await command(env, pub, create)
            await wait_phase(env, key, "Ready", timeout=WAIT)
            expires_at = await env.fetchval("SELECT expires_at FROM sandboxes WHERE key = $1", key)
            assert expires_at == create.occurred_at + timedelta(seconds=2)
            row = await wait_phase(env, key, final, timeout=WAIT)
            if final == "Deleted":
                assert containers_of(podman, key) == []
            else:
                assert status_of(podman, container_name(key, 1)) == "exited"
        types = await events_of(env, key)
        follow = {"stop": "SandboxStopping", "delete": "SandboxDeleting"}[policy]
        assert types[types.index("SandboxExpired") + 1] == follow
        assert row["phase"] == final


async def test_an_ephemeral_sandbox_is_deleted_once_its_process_ended(podman: PodmanClient) -> None:
    async with podman_env(podman, "eph") as (env, driver, keys):
        key = keys()
        async with running_plane(env, driver, removing=keys), await env.publisher() as pub:
            spec = sandbox_spec(env.settings, ["sh", "-c", "sleep 1; exit 3"])
            await command(
                env, pub, f.create(key, sandbox_spec=spec, on_exit="delete", occurred_at=now())
            )
            await wait_phase(env, key, "Deleted", timeout=WAIT)
            assert containers_of(podman, key) == []
        ended = next(h for h in await history(env, key) if h["phase"] == "Deleting")
        assert ended["message_type"] in ("RuntimeSnapshot", "DriverOperationResult")
        types = await events_of(env, key)
        assert types[types.index("SandboxFailed") + 1] == "SandboxDeleting"


# -- holds survive restarts of everything ----------------------------------------------------------


async def test_a_hold_survives_restarts_and_the_rebuild_and_defers_expiry() -> None:
    """A held sandbox whose time to live ends is not deleted; after a restart of the whole
    control plane the hold is still there (rows and the rebuild from the log agree), a restart
    is refused naming who held it and why, and once released the deferred expiry applies."""
    driver = FakeDriver()
    async with fast_env() as env:
        async with await env.publisher() as pub:
            async with running_plane(env, driver, with_scheduler=True) as plane:
                create = f.create("held", ttl_seconds=1, on_expiry="delete", occurred_at=now())
                await command(env, pub, create)
                await wait_phase(env, "held", "Ready", timeout=WAIT)
                hold = f.hold("held", reason="incident 7", actor="carol", occurred_at=now())
                await command(env, pub, hold)
                await eventually(
                    lambda: env.fetchval(
                        "SELECT expires_at < now() FROM sandboxes WHERE key = $1", "held"
                    ),
                    bool,
                    timeout=WAIT,
                    what="the time to live to end",
                )
                scheduler = plane.scheduler
                assert scheduler is not None
                seen = scheduler.rounds
                await eventually(lambda: scheduler.rounds, lambda n: n > seen + 1, timeout=WAIT,
                                 what="two more scheduler rounds")  # fmt: skip
                assert await wait_phase(env, "held", "Ready", timeout=1)
            # Everything restarts: a new control plane over the same rows and log.
            async with running_plane(env, driver, with_scheduler=True):
                restart = f.restart("held", occurred_at=now())
                await pub.publish(restart)
                outcome = await await_outcome(env.pool, restart.command_id, 15, key="held")
                assert outcome is not None and outcome.code.value == "FAILED_PRECONDITION"
                assert "held by carol" in outcome.message and "incident 7" in outcome.message
                row = await wait_phase(env, "held", "Ready", generation=1)
                by = await env.fetchval("SELECT hold->>'by' FROM sandboxes WHERE key = 'held'")
                assert by == "carol"
                await eventually(
                    lambda: rebuild_and_compare(env.settings),
                    lambda report: report.equal,
                    timeout=WAIT,
                    what="the rebuild from the log to match the rows",
                )
                await command(env, pub, f.release("held", occurred_at=now()))
                await wait_phase(env, "held", "Deleted", timeout=WAIT)  # the deferred expiry
        assert row["phase"] == "Ready"


async def test_a_delete_retry_with_no_delete_under_way_deletes_again() -> None:
    """The executor runs a SandboxDeleteRetried as a delete when it has none of that
    incarnation queued or running (after a restart, say), and reports its result."""
    driver = FakeDriver()
    async with isolated_env() as env:
        h = f.Harness()
        h.send(f.create("again"), f.running("again"), f.delete("again"))
        pending = h.row("again").deadline
        assert pending is not None
        h.send(f.due("again", "delete", pending.due_at))
        retried = h.events("again")[-1]
        assert retried.type == "SandboxDeleteRetried"
        await driver.launch(LaunchSpec.from_event(h.events("again")[0]))  # type: ignore[arg-type]
        # The executor acts only on what the row still wants: the row is Deleting.
        async with env.pool.acquire() as conn:
            await write_batch(conn, BatchWrite([(0, h.row("again"))], [], [], [], {}))
        executor = Executor(env.settings, driver, env.pool)
        await executor.start()  # a new group starts at the end of the events: produce after
        await env.produce(env.settings.topic_events, [(b"again", encode(retried))])
        stop = asyncio.Event()
        task = asyncio.create_task(executor.run(stop))
        try:
            found = await eventually(
                lambda: observations_of(env, "again"),
                bool,
                timeout=WAIT,
                what="the delete's result",
            )
        finally:
            stop.set()
            await task
            await executor.stop()
        (result, _), *_ = found
        assert (result.type, result.operation, result.outcome) == (
            "DriverOperationResult",
            "delete",
            "succeeded",
        )
        assert await driver.get("again") == []
