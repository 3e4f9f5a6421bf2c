"""The pool controller as it runs: killed (SIGKILL) in the middle of a refill it never
over-creates (the scheduler role as its own process on the real stack, Kafka and PostgreSQL;
the processor in this one with the fake driver), and `sandstream up`'s supervised control
plane runs it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from harness import Env, eventually, isolated_env
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
            await ready_members(env, SIZE, timeout=90)
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
            await ready_members(env, 2, timeout=60)
            assert plane.down() == {}
        finally:
            await plane.stop()


async def test_two_control_planes_on_one_database_run_one_pool_controller() -> None:
    """Two `sandstream up` on one database (two hosts, or one replacing another): the
    ``scheduler`` lease lets one of them run the pool controller, as between `sandstream
    scheduler` processes. Both running it could fill the same gap twice."""
    async with isolated_env(pool_poll_seconds=0.2, lease_check_seconds=0.2) as env:
        now = datetime.now(UTC)
        body = templates.TemplateBody(spec=SandboxSpec(image="registry.example/agent:1"))
        async with env.pool.acquire() as conn:
            await templates.create_template(conn, "agent", body, "test", now)
            await pools.create_pool(conn, "warm", "agent", SIZE, "Recreate", "test", now)
        backend = FakeDriver()  # one backend, as two hosts' `up` would share
        planes = [plane_with_scheduler(env, backend) for _ in range(2)]
        for plane in planes:
            await plane.start()
        try:
            await ready_members(env, SIZE, timeout=90)
            running = [p for p in planes if p.pools is not None]
            assert len(running) == 1, f"{len(running)} planes run a pool controller"
            [active] = running
            [standby] = [p for p in planes if p is not active]
            await active.stop()
            planes.remove(active)
            await eventually(lambda: standby.pools, bool, what="the standby taking over")
        finally:
            for plane in planes:
                await plane.stop()
        ever = await env.fetchval("SELECT count(*) FROM sandboxes WHERE pool = 'warm'")
        assert ever == SIZE


def plane_with_scheduler(env: Env, driver: FakeDriver) -> ControlPlane:
    return ControlPlane(env.settings, driver, env.pool, reconcile_interval=3600,
                        with_scheduler=True)  # fmt: skip


async def ready_members(env: Env, count: int, timeout: float) -> None:
    await eventually(
        lambda: env.fetchval(
            "SELECT count(*) FROM sandboxes WHERE pool = 'warm' AND phase = 'Ready'"
        ),
        lambda n: n == count,
        timeout=timeout,
        what=f"{count} Ready members",
    )
