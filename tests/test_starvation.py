"""Slow sandboxes cannot starve the others (issue: 64 SIGTERM-ignoring sandboxes with a long
stop timeout, deleted at once, used to hold every executor slot and Podman thread).

A stop, a delete or a restart's launch may wait out a grace period; it never takes the shared
slots (a delete and an operator's restart run in the caller's own lane,
``executor_slow_per_caller`` at once per caller; a stop takes no lane at all), and the
Podman driver gives each lifecycle call its own thread and reads their own pool. These tests
assert behaviour (another caller's sandbox reaches Ready and Stopped while every stuck one is
still Deleting); ``services/bench/drivers.py`` prints the latencies.
"""

from __future__ import annotations

import asyncio
import uuid

import factories as f
from harness import eventually, isolated_env
from pipeline_support import (
    IGNORE_TERM,
    SLEEPER,
    await_podman,
    command,
    podman_env,
    sandbox_spec,
    status_of,
    stop_after_removing,
    trap_set,
    wait_phase,
)
from podman import PodmanClient

from drivers.fake import IGNORES_SIGTERM, FakeDriver
from drivers.podman import container_name
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.executor.backends import podman_driver
from services.up.control_plane import ControlPlane

HOSTILE, ALICE = "hostile", "alice"
STUCK_FOR = 3600  # seconds of grace each stuck sandbox asks for


async def deleting(env: object, keys: list[str]) -> int:
    return int(
        await env.fetchval(  # type: ignore[attr-defined]
            "SELECT count(*) FROM sandboxes WHERE key = ANY($1::text[]) AND phase = 'Deleting'",
            keys,
        )
    )


async def test_a_hundred_stuck_deletes_of_one_caller_do_not_starve_another_caller() -> None:
    """Fake driver with real timing: 100 sandboxes that ignore SIGTERM, deleted with an hour
    of grace each, more than the executor's 64 shared slots; another caller's create reaches
    Ready and its stop reaches Stopped while all 100 are still being deleted."""
    driver = FakeDriver(real_grace=True)
    stubborn = SandboxSpec(
        image="busybox", labels={IGNORES_SIGTERM: "true"}, stop_timeout_seconds=STUCK_FOR
    )
    async with isolated_env() as env:
        # The hostile caller's lane is narrower than the default (a per-caller setting).
        lane = 5
        settings = env.settings.model_copy(update={"executor_slow_callers": {HOSTILE: lane}})
        plane = ControlPlane(settings, driver, env.pool, reconcile_interval=3600)
        await plane.start()
        try:
            async with await env.publisher() as pub:
                stuck = [f"stuck-{i}" for i in range(100)]
                for key in stuck:
                    await pub.publish(f.create(key, sandbox_spec=stubborn, actor=HOSTILE))
                await command(env, pub, f.create("bystander", actor=ALICE))
                for key in stuck:
                    await wait_phase(env, key, "Ready")
                await wait_phase(env, "bystander", "Ready")

                for key in stuck:
                    await pub.publish(f.delete(key, actor=HOSTILE))
                executor = plane.executor
                assert executor is not None
                await eventually(
                    lambda: deleting(env, stuck), lambda n: n == 100, what="100 rows Deleting"
                )
                await eventually(
                    lambda: executor.running, lambda n: n >= lane, what="stuck deletes running"
                )

                await command(env, pub, f.create("victim", actor=ALICE))
                await wait_phase(env, "victim", "Ready")
                await command(env, pub, f.stop("bystander", actor=ALICE))
                await wait_phase(env, "bystander", "Stopped")
                assert await deleting(env, stuck) == 100  # every stuck one still stuck
                # Only the hostile caller's lane's worth runs; the rest waits in its lane.
                assert (executor.running, executor.waiting) == (lane, 100 - lane)
                assert len(driver.calls_for("delete")) == lane
        finally:
            if plane.executor is not None:
                plane.executor.shutdown_grace = 0.5  # the stuck deletes are abandoned
            await plane.stop()


async def test_one_callers_burst_of_deletes_runs_as_wide_as_the_shared_slots() -> None:
    """Fake driver with real timing: one caller deletes 100 sandboxes that wait out an hour of
    grace each. By default 64 deletes run at once (as many as the shared slots: a Kubernetes
    node removes them in parallel) and the rest wait in the caller's lane; at 16, a burst of
    300 deletes waited out 19 rounds of the node's removals one after the other."""
    driver = FakeDriver(real_grace=True)
    stubborn = SandboxSpec(
        image="busybox", labels={IGNORES_SIGTERM: "true"}, stop_timeout_seconds=STUCK_FOR
    )
    async with isolated_env() as env:
        plane = ControlPlane(env.settings, driver, env.pool, reconcile_interval=3600)
        await plane.start()
        try:
            async with await env.publisher() as pub:
                stuck = [f"burst-{i}" for i in range(100)]
                for key in stuck:
                    await pub.publish(f.create(key, sandbox_spec=stubborn, actor=HOSTILE))
                for key in stuck:
                    await wait_phase(env, key, "Ready")
                for key in stuck:
                    await pub.publish(f.delete(key, actor=HOSTILE))
                executor = plane.executor
                assert executor is not None
                await eventually(
                    lambda: executor.running + executor.waiting,
                    lambda n: n == 100,
                    what="every delete running or waiting",
                )
                assert (executor.running, executor.waiting) == (64, 36)
                assert len(driver.calls_for("delete")) == 64
                assert await deleting(env, stuck) == 100
        finally:
            if plane.executor is not None:
                plane.executor.shutdown_grace = 0.5  # the stuck deletes are abandoned
            await plane.stop()


async def test_stuck_deletes_on_podman_do_not_starve_another_caller(
    podman: PodmanClient,
) -> None:
    """The same on real Podman, smaller: two shared slots, a lane of two per caller, four
    SIGTERM-ignoring sandboxes deleted with two minutes of grace each."""
    async with podman_env(podman, "starve") as (env, driver, keys):
        settings = env.settings.model_copy(update={"executor_slow_per_caller": 2})
        plane = ControlPlane(
            settings, driver, env.pool, reconcile_interval=3600, executor_concurrency=2
        )
        await plane.start()
        stuck = [keys() for _ in range(4)]
        try:
            async with await env.publisher() as pub:
                stubborn = sandbox_spec(settings, IGNORE_TERM, stop_timeout=120)
                for key in stuck:
                    await pub.publish(f.create(key, sandbox_spec=stubborn, actor=HOSTILE))
                bystander, victim = keys(), keys()
                plain = sandbox_spec(settings, SLEEPER)
                await command(env, pub, f.create(bystander, sandbox_spec=plain, actor=ALICE))
                for key in stuck:
                    await wait_phase(env, key, "Ready", timeout=60)
                    await trap_set(driver, key, 1)
                await wait_phase(env, bystander, "Ready")

                for key in stuck:
                    await pub.publish(f.delete(key, actor=HOSTILE))
                executor = plane.executor
                assert executor is not None
                await eventually(
                    lambda: deleting(env, stuck), lambda n: n == 4, what="4 rows Deleting"
                )
                await eventually(
                    lambda: executor.running, lambda n: n == 2, what="two stuck deletes running"
                )

                await command(env, pub, f.create(victim, sandbox_spec=plain, actor=ALICE))
                await wait_phase(env, victim, "Ready", timeout=60)
                await command(env, pub, f.stop(bystander, actor=ALICE))
                await wait_phase(env, bystander, "Stopped", timeout=60)
                assert await deleting(env, stuck) == 4
        finally:
            if plane.executor is not None:
                plane.executor.shutdown_grace = 5
            # Kill the stuck containers first: their deletes finish instead of waiting 2 min.
            await stop_after_removing(plane, keys)


async def test_reads_never_queue_behind_a_stop_waiting_out_its_grace_on_podman(
    podman: PodmanClient,
) -> None:
    """One lifecycle thread, held by a stop that waits out two minutes of grace: listing and
    getting (the watcher's and the reconciler's calls) still answer at once."""
    async with podman_env(podman, "reads") as (env, _, keys):
        driver = podman_driver(env.settings, max_workers=1)
        key = keys()
        spec = sandbox_spec(env.settings, IGNORE_TERM, stop_timeout=120)
        try:
            await driver.launch(LaunchSpec(key, uuid.uuid4(), 1, "id-1", spec))
            await trap_set(driver, key, 1)
            stopping = asyncio.create_task(driver.stop(key, 1))
            await await_podman(
                podman,
                lambda c: status_of(c, container_name(key, 1)),
                lambda s: s == "stopping",
                "the stop waiting out its grace",
            )
            # A deadline, not a measurement: behind the stop these would wait two minutes.
            listed = await asyncio.wait_for(driver.list(), 30)
            got = await asyncio.wait_for(driver.get(key), 30)
            assert [i.key for i in listed if i.key == key] == [key]
            assert [i.state for i in got] == ["stopping"]  # Podman's own "stopping"
            assert not stopping.done()
            # End the stop rather than abandon it: a kill is not queued behind it.
            await asyncio.wait_for(driver.kill(key, 1), 30)
            assert (await asyncio.wait_for(stopping, 30)).exit_code == 137
        finally:
            try:
                await asyncio.to_thread(keys.cleanup)  # ends the stop if the test did not
            finally:
                await driver.close()
