"""A shadow read model rebuilt from the log beside the live one, compared, and promoted while
commands keep arriving: no input lost or decided twice, and a shadow that differs is refused
while a processor runs."""

from __future__ import annotations

import asyncio

import pytest
import workload
from harness import Env, isolated_env
from test_exactly_once import assert_applied_exactly_once, publish

from events.common import Cause
from projections.lifecycle import DEFAULT_LIMITS, Decision, Limits, Message, Sandbox, decide
from services.audit import shadow
from services.audit.verify import verify


def no_stops(
    state: Sandbox | None, message: Message, cause: Cause, limits: Limits = DEFAULT_LIMITS
) -> Decision:
    """Changed rules: every stop of an existing sandbox is refused."""
    if message.type == "StopSandbox" and state is not None and not state.tombstoned:
        return Decision(state, (), "rejected", "stops are not allowed under these rules", None)
    return decide(state, message, cause, limits)


async def drop(env: Env, *schemas: str) -> None:
    for schema in schemas:
        await env.fetch(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_a_shadow_is_promoted_under_load_without_a_lost_or_duplicated_input() -> None:
    inputs = workload.commands(600, keys=20, seed=5)
    async with isolated_env() as env:
        side = f"{env.settings.pg_schema}_shadow"
        try:
            await env.start_processor()
            await publish(env, inputs[:300])
            await env.wait_applied(300)
            assert await shadow.build(env.settings, side) == 300
            async with env.pool.acquire() as conn:
                before = await shadow.diff(conn, env.settings.pg_schema, side)
            assert before.equal, shadow.describe(before)

            async def load() -> None:  # arriving while the switch happens
                for start in range(300, 480, 20):
                    await publish(env, inputs[start : start + 20])

            arriving = asyncio.create_task(load())
            await env.wait_applied(320)  # the load is being decided
            async with env.pool.acquire() as conn:
                behind = await shadow.diff(conn, env.settings.pg_schema, side)
            assert behind.equal and behind.ahead >= 20, shadow.describe(behind)
            found = await shadow.promote(env.settings, side)
            await arriving
            await publish(env, inputs[480:])  # and after it
            assert found.equal
            decided_before = await env.fetchval(f'SELECT count(*) FROM "{side}_previous".history')
            assert 320 <= decided_before <= 480
            await env.wait_applied(600)
            await assert_applied_exactly_once(env, inputs)
            report = await verify(env.settings)
            assert report.ok and report.inputs == 600, [d.describe() for d in report.divergences]
        finally:
            await drop(env, side, f"{side}_previous")


async def test_a_shadow_that_differs_is_shown_and_refused_while_a_processor_runs() -> None:
    inputs = workload.commands(120, keys=6, seed=9)
    async with isolated_env() as env:
        side = f"{env.settings.pg_schema}_shadow"
        try:
            await env.start_processor()
            await publish(env, inputs)
            await env.wait_applied(120)
            await shadow.build(env.settings, side, rules=no_stops)
            async with env.pool.acquire() as conn:
                found = await shadow.diff(conn, env.settings.pg_schema, side)
            assert found.decisions and found.rows and not found.equal
            assert any("StopSandbox accepted" in d for d in found.decisions)
            with pytest.raises(shadow.ShadowError, match="processors are running"):
                await shadow.promote(env.settings, side, rules=no_stops)
            # Nothing moved: the live tables are still the live ones.
            assert await env.fetchval("SELECT count(*) FROM history") == 120
            assert not await env.fetchval(
                "SELECT count(*) FROM pg_namespace WHERE nspname = $1", f"{side}_previous"
            )
        finally:
            await drop(env, side, f"{side}_previous")
