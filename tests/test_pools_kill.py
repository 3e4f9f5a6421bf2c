"""The pool controller as it runs: killed (SIGKILL) in the middle of a refill it never
over-creates (the scheduler role as its own process on the real stack, Kafka and PostgreSQL;
the processor in this one with the fake driver), and `sandstream up`'s supervised control
plane runs it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from harness import eventually, isolated_env
from role_processes import roles_env

from drivers.fake import FakeDriver
from events.common import SandboxSpec
from services.common import pools, templates
from services.up.control_plane import ControlPlane

SIZE = 20


async def test_a_scheduler_killed_mid_refill_creates_each_member_once(tmp_path: Path) -> None:
    async with roles_env(tmp_path, pool_poll_seconds=0.2) as roles:
        env = roles.env
        now = datetime.now(UTC)
        body = templates.TemplateBody(spec=SandboxSpec(image="registry.example/agent:1"))
        async with env.pool.acquire() as conn:
            await templates.create_template(conn, "agent", body, "test", now)
            await pools.create_pool(conn, "warm", "agent", SIZE, "Recreate", "test", now)

        async def requested() -> int:
            return int(await env.fetchval("SELECT count(*) FROM pool_requests"))

        # No processor yet: every create the controller sends stays undecided.
        first = roles.start("scheduler")
        at_kill = await eventually(requested, lambda n: n >= 1, what="the first create asked")
        first.kill()
        second = roles.start("scheduler")
        await eventually(requested, lambda n: n == SIZE, what=f"{SIZE} creates asked")
        second.kill()  # again, with every create asked and none decided
        third = roles.start("scheduler")
        await third.ready()

        plane = ControlPlane(env.settings, FakeDriver(), env.pool, reconcile_interval=3600)
        await plane.start()
        try:
            await eventually(
                lambda: env.fetchval(
                    "SELECT count(*) FROM sandboxes WHERE pool = 'warm' AND phase = 'Ready'"
                ),
                lambda n: n == SIZE,
                timeout=90,
                what=f"{SIZE} Ready members",
            )
            await eventually(requested, lambda n: n == 0, what="every request folded")
            status = await third.readiness()
            rounds = status.get("pool_rounds", 0)
            await eventually(
                third.readiness,
                lambda b: b.get("pool_rounds", 0) >= rounds + 3,
                what="three more controller rounds",
            )
        finally:
            await plane.stop()
        ever = await env.fetchval("SELECT count(*) FROM sandboxes WHERE pool = 'warm'")
        creates = {
            json.loads(r.value)["key"]
            for r in await env.read_topic(env.settings.topic_commands)
            if r.value and json.loads(r.value).get("type") == "CreateSandbox"
        }
        assert (ever, len(creates)) == (SIZE, SIZE), f"killed at {at_kill} of {SIZE} asked"


async def test_sandstream_ups_supervised_control_plane_runs_the_pool_controller() -> None:
    """`sandstream up` runs the parts supervised (started again after a crash): the pool
    controller is one of them, beside the scheduler."""
    async with isolated_env(pool_poll_seconds=0.2) as env:
        now = datetime.now(UTC)
        body = templates.TemplateBody(spec=SandboxSpec(image="registry.example/agent:1"))
        async with env.pool.acquire() as conn:
            await templates.create_template(conn, "agent", body, "test", now)
            await pools.create_pool(conn, "warm", "agent", 2, "OnReplenish", "test", now)
        plane = ControlPlane(env.settings, FakeDriver(), env.pool, reconcile_interval=3600,
                             with_scheduler=True, supervised=True)  # fmt: skip
        await plane.start()
        try:
            await eventually(
                lambda: env.fetchval(
                    "SELECT count(*) FROM sandboxes WHERE pool = 'warm' AND phase = 'Ready'"
                ),
                lambda n: n == 2,
                timeout=60,
                what="2 Ready members",
            )
            assert plane.down() == {}
        finally:
            await plane.stop()
