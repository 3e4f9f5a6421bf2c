"""The restart policy on the real stack: Kafka, PostgreSQL, the scheduler and Podman. A process
that exits 1 every time is restarted with growing delays up to ``max_restarts`` and ends in
Error with the reason. Delays are asserted on the recorded events (their due times against
their exits' times), never on the wall clock."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import factories as f
from harness import Env, eventually
from pipeline_support import (
    PodmanKeys,
    command,
    history,
    observations_of,
    podman_env,
    produce_raw,
    row,
    running_plane,
    wait_history_at,
    wait_phase,
    wait_restart_limit,
)
from podman import PodmanClient
from role_processes import roles_env

from events.codec import EVENTS, decode
from events.common import Deadline, RestartBackoff, RestartPolicy, SandboxSpec
from events.decided import SandboxRestartScheduled, SandboxRestartsExhausted, SandboxStarting
from events.observations import RuntimeSnapshot
from events.publisher import now

WAIT = 90.0
FAST = {"scheduler_poll_seconds": 0.5}
# The back-off of the killed-plane test: the time from the exit (the due time's origin) to the
# plane's kill. The test sees the deadline only after the watcher, Kafka, the processor and its
# own poll; on a loaded CI machine that took over 4.6 s, so 4 s left nothing to kill before.
KILL_WINDOW = 12.0


def exiting(
    env: Env, code: int, policy: RestartPolicy, max_restarts: int, max_delay: float = 0.2
) -> SandboxSpec:
    """A process that exits with ``code`` at once, under ``policy`` (back-off from 0.2 s)."""
    return SandboxSpec(
        image=env.settings.sandbox_image,
        command=["sh", "-c", f"exit {code}"],
        restart_policy=policy,
        restart_backoff=RestartBackoff(initial_seconds=0.2, max_seconds=max_delay),
        max_restarts=max_restarts,
    )


async def test_a_process_that_always_fails_is_restarted_with_back_off_until_the_limit(
    podman: PodmanClient,
) -> None:
    async with podman_env(podman, "rst") as (env, driver, keys):
        env.settings = env.settings.model_copy(update=FAST)
        key = keys()
        spec = exiting(env, 1, "OnFailure", max_restarts=3, max_delay=0.5)
        async with (
            running_plane(env, driver, with_scheduler=True, removing=keys),
            await env.publisher() as pub,
        ):
            await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
            row = await wait_restart_limit(env, key, WAIT)
        assert row["phase"] == "Error" and row["generation"] == 4
        assert "max_restarts 3" in row["reason"] and "code 1" in row["reason"]
        records = await env.read_topic(env.settings.topic_events)
        events = [decode(EVENTS, r.value) for r in records if r.key == key.encode()]
        scheduled = [e for e in events if isinstance(e, SandboxRestartScheduled)]
        delays = [e.deadline.due_at - e.occurred_at for e in scheduled]
        assert delays == [timedelta(seconds=s) for s in (0.2, 0.4, 0.5)]
        assert [e.deadline.attempt for e in scheduled] == [1, 2, 3]
        starts = [e for e in events if isinstance(e, SandboxStarting)]
        assert [(e.policy, e.attempt, e.generation) for e in starts] == [
            ("OnFailure", n, n + 1) for n in (1, 2, 3)
        ]
        # Each restart happened at or after its due time (the DeadlineDue's occurred_at).
        for s, start in zip(scheduled, starts, strict=True):
            assert start.occurred_at >= s.deadline.due_at
        assert isinstance(events[-1], SandboxRestartsExhausted)
        restarts = [h for h in await history(env, key) if h["message_type"] == "DeadlineDue"]
        assert len(restarts) == 3
        assert all("restart_policy OnFailure" in h["reason"] for h in restarts)


async def test_a_start_sent_again_after_the_exit_lifts_nothing_and_decides_no_exit_again(
    podman: PodmanClient,
) -> None:
    """Generation 2's start sent again after its exit (as Podman 4.3's stream does when it
    rotates its event log, to a watch that cannot recognise it: one begun after it, or
    reopened): the row stays in Error with the limit's reason and the exit is not decided
    again (a CI run: Ready again, then three SandboxCompleted for two once a reconcile pass
    found the exit)."""
    async with podman_env(podman, "rstl") as (env, driver, keys):
        env.settings = env.settings.model_copy(update=FAST)
        key = keys()
        spec = exiting(env, 0, "Always", max_restarts=1)
        async with (
            running_plane(env, driver, with_scheduler=True, removing=keys),
            await env.publisher() as pub,
        ):
            await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
            before = await wait_restart_limit(env, key, WAIT)
            [start] = [
                raw for o, raw in await observations_of(env, key)
                if isinstance(o, RuntimeSnapshot) and o.generation == 2 and o.state == "running"
            ]  # fmt: skip
            placed = await produce_raw(env, [(key.encode(), start)])  # the same record again
            [decided] = await wait_history_at(env, placed)
        assert decided["disposition"] == "ignored" and decided["reason"].startswith("late: ")
        after = await row(env, key)
        assert after is not None and after["phase"] == "Error"
        assert after["version"] == before["version"]
        records = await env.read_topic(env.settings.topic_events)
        events = [decode(EVENTS, r.value) for r in records if r.key == key.encode()]
        assert [e.type for e in events].count("SandboxCompleted") == 2
        assert [e.type for e in events][-1] == "SandboxRestartsExhausted"


async def test_always_restarts_an_exit_0_and_never_restarts_no_exit(
    podman: PodmanClient,
) -> None:
    """Always restarts a process that exits 0 (up to its max_restarts, then Error naming the
    policy); Never leaves a process that exits 1 in Error with nothing scheduled."""
    async with podman_env(podman, "rsta") as (env, driver, keys):
        env.settings = env.settings.model_copy(update=FAST)
        always, never = keys(), keys()

        async with (
            running_plane(env, driver, with_scheduler=True, removing=keys),
            await env.publisher() as pub,
        ):
            await command(
                env,
                pub,
                f.create(never, sandbox_spec=exiting(env, 1, "Never", 1), occurred_at=now()),
            )
            await command(
                env,
                pub,
                f.create(always, sandbox_spec=exiting(env, 0, "Always", 1), occurred_at=now()),
            )
            failed = await wait_phase(env, never, "Error", timeout=WAIT)
            row = await wait_restart_limit(env, always, WAIT)
        assert (row["phase"], row["generation"], row["exit_code"]) == ("Error", 2, 0)
        assert "restart_policy Always made 1 restarts in a row (max_restarts 1)" in row["reason"]
        records = await env.read_topic(env.settings.topic_events)
        events = [decode(EVENTS, r.value) for r in records if r.key == always.encode()]
        assert [e.type for e in events if e.type == "SandboxCompleted"] == ["SandboxCompleted"] * 2
        starts = [e for e in events if isinstance(e, SandboxStarting)]
        assert [(e.policy, e.attempt, e.generation) for e in starts] == [("Always", 1, 2)]
        restarts = [h for h in await history(env, always) if h["message_type"] == "DeadlineDue"]
        assert len(restarts) == 1 and "restart_policy Always" in restarts[0]["reason"]
        # Never: the exit is the end, decided with nothing scheduled and no second generation.
        assert (failed["generation"], failed["exit_code"]) == (1, 1)
        assert await env.fetchval("SELECT deadline FROM sandboxes WHERE key = $1", never) is None
        ended = [decode(EVENTS, r.value) for r in records if r.key == never.encode()]
        assert "SandboxFailed" in [e.type for e in ended]
        assert not [e for e in ended if isinstance(e, SandboxRestartScheduled | SandboxStarting)]


async def test_on_failure_restarts_a_failed_launch(podman: PodmanClient) -> None:
    """A launch that cannot succeed (an image Podman does not know: the driver reports it at
    once, without retrying) is a failure: OnFailure restarts it, up to max_restarts."""
    async with podman_env(podman, "rstl") as (env, driver, keys):
        env.settings = env.settings.model_copy(update=FAST)
        key = keys()
        spec = SandboxSpec(
            image="localhost/sandstream-no-such-image:0",
            command=["true"],
            restart_policy="OnFailure",
            restart_backoff=RestartBackoff(initial_seconds=0.2, max_seconds=0.2),
            max_restarts=1,
        )
        async with (
            running_plane(env, driver, with_scheduler=True, removing=keys),
            await env.publisher() as pub,
        ):
            await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
            row = await wait_restart_limit(env, key, WAIT)
        assert (row["phase"], row["generation"]) == ("Error", 2)
        assert "image not known" in row["reason"], row["reason"]
        records = await env.read_topic(env.settings.topic_events)
        events = [decode(EVENTS, r.value) for r in records if r.key == key.encode()]
        (scheduled,) = [e for e in events if isinstance(e, SandboxRestartScheduled)]
        assert "image not known" in scheduled.reason
        starts = [e for e in events if isinstance(e, SandboxStarting)]
        assert [(e.policy, e.attempt, e.generation) for e in starts] == [("OnFailure", 1, 2)]
        restarts = [h for h in await history(env, key) if h["message_type"] == "DeadlineDue"]
        assert len(restarts) == 1 and "restart_policy OnFailure" in restarts[0]["reason"]


async def test_a_control_plane_killed_before_a_scheduled_restart_restarts_exactly_once(
    tmp_path: Path, podman: PodmanClient
) -> None:
    """The runtime exits 1 and the restart is scheduled; then every role of the control plane
    (processor, executor, watcher, scheduler: each its own process) is SIGKILLed. Started
    again after the due time, they restart the sandbox exactly once: one DeadlineDue acts, one
    new generation, at or after the recorded due time."""
    keys = PodmanKeys(podman, "rstk")
    try:
        async with roles_env(tmp_path, scheduler_poll_seconds=0.5) as roles:
            prepared = await asyncio.to_thread(roles.run, "prepare")
            assert prepared.returncode == 0, prepared.stderr
            plane = ["processor", "executor", "watcher", "scheduler"]
            first = [roles.start(r) for r in plane]
            for p in first:
                await p.ready()
            env, key = roles.env, keys()
            spec = SandboxSpec(
                image=env.settings.sandbox_image,
                command=["sh", "-c", "exit 1"],
                restart_policy="OnFailure",
                restart_backoff=RestartBackoff(
                    initial_seconds=KILL_WINDOW, max_seconds=KILL_WINDOW
                ),
                max_restarts=1,
            )
            async with await env.publisher() as pub:
                await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
            scheduled = await eventually(
                lambda: env.fetchval(
                    "SELECT deadline FROM sandboxes WHERE key = $1 "
                    "AND deadline->>'kind' = 'restart'", key,
                ),
                lambda d: d is not None, timeout=WAIT, what="the restart scheduled",
            )  # fmt: skip
            due = Deadline.model_validate_json(scheduled).due_at
            for p in first:
                p.kill()
            assert now() < due, "the plane was killed after the due time: nothing was shown"
            await eventually(now, lambda t: t > due, timeout=30, what="the due time to pass")
            second = [roles.start(r) for r in plane]
            row = await wait_restart_limit(env, key, WAIT)
            assert row["generation"] == 2
            records = await env.read_topic(env.settings.topic_events)
            events = [decode(EVENTS, r.value) for r in records if r.key == key.encode()]
            starts = [e for e in events if isinstance(e, SandboxStarting)]
            assert [(e.policy, e.generation) for e in starts] == [("OnFailure", 2)]
            assert starts[0].occurred_at >= due
            acted = [
                h for h in await history(env, key)
                if h["message_type"] == "DeadlineDue" and h["disposition"] == "applied"
            ]  # fmt: skip
            assert len(acted) == 1 and "restart_policy OnFailure" in acted[0]["reason"]
            for p in second:
                p.kill()
    finally:
        await asyncio.to_thread(keys.cleanup)


async def test_a_restart_deferred_by_a_hold_happens_after_the_release(
    podman: PodmanClient,
) -> None:
    """Regression: a hold cancelled the restart Always had scheduled, and the release scheduled
    none, so the agent stayed down. Here the hold comes before the due time; the scheduler's
    DeadlineDue while held is ignored ("deferred until released"); after the release the
    scheduler sends it again (the row's version changed) and the sandbox restarts."""
    async with podman_env(podman, "rsth") as (env, driver, keys):
        env.settings = env.settings.model_copy(update=FAST)
        key = keys()
        spec = SandboxSpec(
            image=env.settings.sandbox_image,
            command=["sh", "-c", "exit 1"],
            restart_policy="Always",
            restart_backoff=RestartBackoff(initial_seconds=2, max_seconds=2),
            max_restarts=1,
        )
        async with (
            running_plane(env, driver, with_scheduler=True, removing=keys),
            await env.publisher() as pub,
        ):
            await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
            await command(env, pub, f.hold(key, occurred_at=now()))

            async def deferred() -> list[dict[str, object]]:
                return [
                    h
                    for h in await history(env, key)
                    if h["message_type"] == "DeadlineDue"
                    and "deferred until released" in str(h["reason"])
                ]

            await eventually(deferred, bool, timeout=WAIT, what="the due restart, deferred")
            row = await env.pool.fetchrow(
                "SELECT generation, deadline FROM sandboxes WHERE key = $1", key
            )
            assert row is not None and row["generation"] == 1
            assert Deadline.model_validate_json(row["deadline"]).kind == "restart"
            await command(env, pub, f.release(key, occurred_at=now()))
            row = await wait_restart_limit(env, key, WAIT)  # generation 2 ran and exited
        assert row["generation"] == 2
        records = await env.read_topic(env.settings.topic_events)
        events = [decode(EVENTS, r.value) for r in records if r.key == key.encode()]
        starts = [e for e in events if isinstance(e, SandboxStarting)]
        assert [(e.policy, e.attempt, e.generation) for e in starts] == [("Always", 1, 2)]
        released = [e for e in events if e.type == "SandboxReleased"]
        assert released and starts[0].occurred_at >= released[0].occurred_at
