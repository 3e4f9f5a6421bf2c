"""A stop never waits in its caller's lane while its stop deadline counts (found in the hostile
pass of issue "Trust, round four" across deadlines and lanes).

A stop's deadline lies the grace period G plus the margin M after the decision; when it falls
due the executor kills the runtime at once, beside the sandbox's queue. In a lane of width w
the k-th stop (from 0) of one caller sent its SIGTERM only after k // w grace periods of the
stops before it, so from k // w * G > M on the kill came before or early in its own grace
period: at the old defaults (w 16, M 30 s) one caller's stop of 17 agents that take 600 s to stop
killed the 17th 30 s after its SIGTERM, and the 33rd before it got one. Scaled through the
settings only (w 1, G 3 s, M 1 s: from the 2nd stop on), the same code: the lane is the same
semaphore at any width, the deadline the same sum, the scheduler the real one. The fake
driver's runtimes ignore SIGTERM and take their grace period in real time.
"""

from __future__ import annotations

from typing import Any

import factories as f
from harness import isolated_env
from pipeline_support import command, running_plane, wait_phase

from drivers.fake import IGNORES_SIGTERM, FakeDriver
from events.codec import EVENTS, decode
from events.common import SandboxSpec
from events.publisher import now

GRACE = 3
SCALED: dict[str, Any] = {
    "stop_margin_seconds": 1.0,
    "scheduler_poll_seconds": 0.5,
    "executor_slow_callers": {"alice": 1},  # the stopping caller's lane: width 1
}
AGENTS = 3
WAIT = 60.0


async def test_one_callers_stops_each_get_their_grace_period_and_none_is_escalated() -> None:
    """Old code: the 2nd and 3rd stop waited in alice's lane, their stop deadlines fell due and
    the executor killed them (SandboxStopEscalated) before or just after their SIGTERM."""
    spec = SandboxSpec(
        image="busybox", labels={IGNORES_SIGTERM: "true"}, stop_timeout_seconds=GRACE
    )
    keys = [f"agent-{i}" for i in range(AGENTS)]
    driver = FakeDriver(real_grace=True)
    async with isolated_env(**SCALED) as env:
        async with (
            running_plane(env, driver, with_scheduler=True),
            await env.publisher() as pub,
        ):
            for key in keys:
                await command(env, pub, f.create(key, sandbox_spec=spec, occurred_at=now()))
            for key in keys:
                await wait_phase(env, key, "Ready", timeout=WAIT)
            for key in keys:
                await command(env, pub, f.stop(key, actor="alice", occurred_at=now()))
            for key in keys:
                await wait_phase(env, key, "Stopped", timeout=WAIT)
        events = [decode(EVENTS, r.value) for r in await env.read_topic(env.settings.topic_events)]
    assert "SandboxStopEscalated" not in [e.type for e in events]
    assert driver.calls_for("kill") == []
    assert [c.grace for c in driver.calls_for("stop")] == [GRACE] * AGENTS
