"""The scheduler on real PostgreSQL and Kafka, with due rows nothing consumes.

No processor runs here: every DeadlineDue the scheduler publishes stays unconsumed and its row
stays due, as when the row's partition is stopped at a poison record (projections/stopped.py)
or the processor is down. A thousand such rows (the scheduler's page size, at its real value)
must not hide a deadline or a time to live that falls due after them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta

from harness import Env, eventually, isolated_env

from events.codec import OBSERVATIONS, decode
from events.common import Deadline
from events.publisher import now
from services.scheduler.scheduler import Scheduler

STUCK = 1000  # Scheduler.batch, the page size of a round's query: the old LIMIT

_ROWS = """
INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers, identity,
                       created_at, updated_at, partition, change_seq, deadline, deadline_at,
                       expires_at)
SELECT $1 || n, gen_random_uuid(), $2, 1, 1, '{}', '{}', 'rid', $3, $3, 0,
       nextval('sandbox_changes'), $4::jsonb, ($4::jsonb ->> 'due_at')::timestamptz, $5
FROM generate_series(1, $6) AS n
"""


async def due_rows(
    env: Env, prefix: str, count: int, *, phase: str = "Ready",
    deadline: Deadline | None = None, expires_at: datetime | None = None,
) -> None:  # fmt: skip
    spec = deadline.model_dump_json() if deadline else None
    await env.fetchval(_ROWS, prefix, phase, now(), spec, expires_at, count)


@asynccontextmanager
async def scheduler_in(env: Env) -> AsyncIterator[Scheduler]:
    scheduler = Scheduler(env.settings, env.pool)
    assert scheduler.batch == STUCK
    await scheduler.start()
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler.run(stop))
    try:
        yield scheduler
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await scheduler.stop()


async def published_for(env: Env, key: str) -> list[str]:
    records = await env.read_topic(env.settings.topic_observations)
    return [o.deadline for r in records if r.key == key.encode()
            for o in [decode(OBSERVATIONS, r.value)] if o.type == "DeadlineDue"]  # fmt: skip


async def test_a_thousand_due_rows_nothing_consumes_hide_no_later_deadline() -> None:
    async with isolated_env() as env:
        long_ago = now() - timedelta(hours=1)
        await due_rows(env, "stuck-", STUCK, expires_at=long_ago)
        async with scheduler_in(env) as scheduler:
            await eventually(lambda: asyncio.sleep(0, scheduler.published), lambda n: n == STUCK,
                             what="every stuck row's expiry published once")  # fmt: skip
            # Due after all of them, and named before and after them.
            due = now() - timedelta(seconds=1)
            launch = Deadline(kind="launch", due_at=due)
            await due_rows(env, "a-launch-", 1, phase="Provisioning", deadline=launch)
            await due_rows(env, "z-ttl-", 1, expires_at=due)
            await eventually(lambda: published_for(env, "a-launch-1"), lambda d: d == ["launch"],
                             what="the later launch deadline published")  # fmt: skip
            await eventually(lambda: published_for(env, "z-ttl-1"), lambda d: d == ["ttl"],
                             what="the later time to live published")  # fmt: skip
            assert scheduler.published == STUCK + 2  # the stuck ones were not published again
