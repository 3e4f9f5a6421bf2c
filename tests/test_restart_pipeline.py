"""The restart policy on the real stack: Kafka, PostgreSQL, the scheduler and Podman. A process
that exits 1 every time is restarted with growing delays up to ``max_restarts`` and ends in
Error with the reason. Delays are asserted on the recorded events (their due times against
their exits' times), never on the wall clock."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import factories as f
from harness import eventually
from pipeline_support import PodmanKeys, command, history, podman_env, running_plane, wait_row
from podman import PodmanClient
from role_processes import roles_env

from events.codec import EVENTS, decode
from events.common import Deadline, RestartBackoff, SandboxSpec
from events.decided import SandboxRestartScheduled, SandboxRestartsExhausted, SandboxStarting
from events.publisher import now

WAIT = 90.0
FAST = {"scheduler_poll_seconds": 0.5}


async def test_a_process_that_always_fails_is_restarted_with_back_off_until_the_limit(
    podman: PodmanClient,
) -> None:
    async with podman_env(podman, "rst") as (env, driver, keys):
        env.settings = env.settings.model_copy(update=FAST)
        key = keys()
        spec = SandboxSpec(
            image=env.settings.sandbox_image,
            command=["sh", "-c", "exit 1"],
            restart_policy="OnFailure",
            restart_backoff=RestartBackoff(initial_seconds=0.2, max_seconds=0.5),
            max_restarts=3,
        )
        async with (
            running_plane(env, driver, with_scheduler=True, removing=keys),
            await env.publisher() as pub,
        ):
            await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
            row = await wait_row(
                env,
                key,
                lambda r: (r["reason"] or "").startswith("RestartLimit"),
                "the restart limit",
                timeout=WAIT,
            )
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
                restart_backoff=RestartBackoff(initial_seconds=4, max_seconds=4),
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
            row = await wait_row(
                env, key, lambda r: (r["reason"] or "").startswith("RestartLimit"),
                "the restart limit", timeout=WAIT,
            )  # fmt: skip
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
