"""One provider change's restarts do not wait behind one another in the executor's per-caller
lane, where their launch deadlines kept counting: issue "Trust, round four", item 2.

A restart's launch first waits out the old generation's grace period G, then launches; its
deadline lies G + retry window + launch timeout after the decision. In a lane of width w the
k-th restart (from 0) of one caller ends after (k // w + 1) * G, so it timed out once
(k // w + 1) * G > G + retry + launch: at the old defaults (w 16, retry 600 s, launch 300 s) and a
600 s grace from the 33rd restart on. The test scales that inequality through the settings
and nothing else (w 1, G 4 s, retry 1 s, launch 2 s: from the 2nd restart on) and runs the
same code: the lane is the same semaphore at any width, the deadline the same sum, the
scheduler the real one. The fake driver's launch of a new generation takes the grace period
in real time, as Podman's does when the old one ignores SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import secrets
from typing import Any

import factories as f
from harness import isolated_env
from pipeline_support import command, running_plane, wait_phase
from pydantic import SecretStr

from drivers.fake import FakeDriver
from drivers.protocol import LaunchResult, LaunchSpec
from events.codec import EVENTS, decode
from events.common import Phase, SandboxSpec
from events.publisher import now
from services.executor.intents import Intent, intent_of, intent_of_row, takes_lane

KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
GRACE = 4  # seconds the old generation takes to stop
SCALED: dict[str, Any] = {
    "credentials_key": KEY,
    "launch_timeout_seconds": 2.0,
    "executor_retry_seconds": 1.0,
    "scheduler_poll_seconds": 0.5,
    "executor_slow_callers": {"rotator": 1},  # the lane of the rotation's caller: width 1
}
AGENTS = 3
WAIT = 60.0


class SlowStoppingDriver(FakeDriver):
    """A launch that replaces an older generation waits out its grace period first."""

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        if spec.generation > 1:
            await asyncio.sleep(GRACE)  # the simulated grace period, not a synchronisation
        return await super().launch(spec)


async def test_one_rotations_restarts_run_side_by_side_and_none_times_out() -> None:
    """Old code: the 2nd and 3rd restart waited in the rotator's lane for the one before,
    outlived their deadlines (SandboxTimedOut) and ended in Error."""
    spec = SandboxSpec(image="busybox", stop_timeout_seconds=GRACE)
    keys = [f"agent-{i}" for i in range(AGENTS)]
    async with isolated_env(**SCALED) as env:
        async with (
            running_plane(env, SlowStoppingDriver(), with_scheduler=True),
            await env.publisher() as pub,
        ):
            for key in keys:
                create = f.create(key, sandbox_spec=spec, providers=["gh"], occurred_at=now())
                await command(env, pub, create)
            for key in keys:
                await wait_phase(env, key, "Ready", timeout=WAIT)
            for key in keys:
                rotation = f.rotate(key, {"gh": 2}, actor="rotator", occurred_at=now())
                await command(env, pub, rotation)
            rows = [await wait_phase(env, key, "Ready", timeout=WAIT, generation=2) for key in keys]
        events = [decode(EVENTS, r.value) for r in await env.read_topic(env.settings.topic_events)]
    assert [r["reason"] for r in rows] == [None] * AGENTS
    assert [e.type for e in events].count("AgentRestarted") == AGENTS
    assert "SandboxTimedOut" not in [e.type for e in events]


def test_a_picked_up_rotation_restart_takes_no_lane_either() -> None:
    """The reconcile loop's pick-up of a row still Starting for a rotation (or a detach) after
    an executor crash runs as the AgentRestarted would have: no lane. A start or restart an
    operator asked for keeps its caller's lane."""
    for reason, laned in [
        ("restarting for rotated credentials: gh", False),
        ("restarting without detached providers: gh", False),
        ("restart", True),
    ]:
        row = f.harness_in(Phase.STARTING).row(f.KEY)
        intent = intent_of_row(dataclasses.replace(row, reason=reason))
        assert isinstance(intent, Intent) and takes_lane(intent) is laned, reason


def test_rotation_and_detach_restarts_take_no_lane_an_operators_restart_does() -> None:
    """From the decided events: AgentRestarted of a rotation and of a detach run without a
    lane; SandboxStarting of an operator's restart waits for its caller's lane as before."""
    cases = [
        (f.rotate(f.KEY, {"github": 2}), False),
        (f.detach(f.KEY, "github"), False),
        (f.restart(f.KEY), True),
    ]
    for message, laned in cases:
        h = f.harness_in(Phase.READY)
        decision = h.send(message)
        intents = [i for e in decision.events if (i := intent_of(e)) is not None]
        assert [i.operation for i in intents] == ["launch"], message.type
        assert takes_lane(intents[0]) is laned, message.type
