"""What a command submitted with ``wait`` costs PostgreSQL before its outcome: every pool
acquisition ends in a reset (a round trip of its own), so the gateway records the command and
looks for a known outcome on one, and marks it published and looks for the outcome on the
next, instead of a pool acquisition per statement."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import factories as f
from harness import isolated_env

from events.publisher import CommandPublisher
from services.api import idempotency
from services.api.gateway import CommandGateway
from services.api.readmodel import ChangeFeed
from services.common.kafka_clients import kafka_client_args

STATEMENTS = ("fetch", "fetchrow", "fetchval", "execute")  # each acquires a connection


@dataclass
class CountingPool:
    """The pool, counting the connections taken from it (by ``acquire`` or a statement)."""

    pool: asyncpg.Pool[asyncpg.Record]
    acquired: int = 0

    def acquire(self) -> Any:
        self.acquired += 1
        return self.pool.acquire()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.pool, name)
        if name not in STATEMENTS:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            self.acquired += 1
            call: Callable[..., Awaitable[Any]] = attribute
            return call(*args, **kwargs)

        return counted


async def test_a_command_waited_for_takes_a_connection_per_look_up_not_per_statement() -> None:
    async with isolated_env(partitions=2) as env:
        counting = CountingPool(env.pool)
        # No processor: nothing is decided. A feed that never listens: the wait ends at its
        # timeout, never woken by another environment's commit.
        feed = ChangeFeed(env.pool)
        async with CommandPublisher(
            kafka_client_args(env.settings, "api"), topic=env.settings.topic_commands
        ) as publisher:
            gateway = CommandGateway(counting, publisher, feed)  # type: ignore[arg-type]
            submitted = await gateway.submit(f.create("sb-acquired"), wait=0.2)
        assert submitted.outcome is None and not submitted.retry
        # Recorded and looked up; marked published and looked up; looked up at the timeout.
        assert counting.acquired == 3
        published = await env.pool.fetchval("SELECT published FROM api_commands")
        assert published is True


@dataclass
class CountingConnections:
    """The pool, counting the statements sent on its connections (every one a round trip)."""

    pool: asyncpg.Pool[asyncpg.Record]
    statements: list[str] = field(default_factory=list)

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        async with self.pool.acquire() as conn:
            yield _Counted(conn, self.statements)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.pool, name)
        return _counted(attribute, self.statements) if name in STATEMENTS else attribute


@dataclass
class _Counted:
    conn: Any
    statements: list[str]

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.conn, name)
        return _counted(attribute, self.statements) if name in STATEMENTS else attribute


def _counted(call: Callable[..., Awaitable[Any]], statements: list[str]) -> Any:
    def counted(sql: str, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        statements.append(sql)
        return call(sql, *args, **kwargs)

    return counted


@asynccontextmanager
async def counted_gateway() -> AsyncIterator[tuple[Any, CountingConnections, CommandGateway]]:
    """An environment of its own and a gateway whose statements are counted."""
    async with isolated_env(partitions=2) as env:
        counting = CountingConnections(env.pool)
        async with CommandPublisher(
            kafka_client_args(env.settings, "api"), topic=env.settings.topic_commands
        ) as publisher:
            yield env, counting, CommandGateway(counting, publisher, ChangeFeed(env.pool))  # type: ignore[arg-type]


async def test_a_new_command_is_recorded_with_its_outcome_looked_up_in_one_statement() -> None:
    """A create answered 202 costs the API two statements, not three: the record and the
    look-up of an earlier outcome in one, then the mark as published."""
    async with counted_gateway() as (env, counting, gateway):
        command = f.create("sb-one-trip")
        submitted = await gateway.submit(command, wait=None)
        assert submitted.outcome is None and not submitted.retry
        assert len(counting.statements) == 2
        assert await env.pool.fetchval("SELECT published FROM api_commands") is True
        again = await gateway.submit(command, wait=None)  # a retry: nothing published again
        assert again.retry and again.outcome is None
        assert await env.pool.fetchval("SELECT count(*) FROM api_commands") == 1


async def test_a_delete_of_an_unbound_name_is_resolved_in_its_record_statement() -> None:
    """Every command but a create resolves its name (a name bound to a pool member addresses
    the member): that was a statement of its own before the record, 1.0 per sandbox in a
    burst. It is now part of the record's statement; a bound name takes one more (below)."""
    async with counted_gateway() as (env, counting, gateway):
        submitted = await gateway.submit(f.delete("sb-del-one-trip"), wait=None)
        assert submitted.outcome is None and not submitted.retry
        assert len(counting.statements) == 2
        await env.pool.execute(
            "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, "
            "providers, identity, created_at, updated_at, partition, change_seq, bound_to) "
            "SELECT 'sb-bound', gen_random_uuid(), 'Deleted', 0, 1, '{}', '{}', '', now(), "
            "now(), 0, nextval('sandbox_changes'), 'pool-member-1'"
        )
        counting.statements.clear()
        await gateway.submit(f.delete("sb-bound"), wait=None)
        assert len(counting.statements) == 3
        recorded = await env.pool.fetch("SELECT key FROM api_commands ORDER BY key")
        assert [r["key"] for r in recorded] == ["pool-member-1", "sb-del-one-trip"]


async def test_creates_acknowledged_together_share_the_statement_that_marks_them() -> None:
    async with counted_gateway() as (env, counting, gateway):
        commands = [f.create(f"sb-shared-{i}") for i in range(20)]
        await asyncio.gather(*(gateway.submit(c, wait=None) for c in commands))
        marks = [s for s in counting.statements if s.startswith("UPDATE api_commands")]
        assert len(counting.statements) == 20 + len(marks) and len(marks) < 20
        published = await env.pool.fetchval("SELECT count(*) FROM api_commands WHERE published")
        assert published == 20


@dataclass
class _Failing:
    """The pool, its statements failing as a connection left broken does while ``fail``."""

    pool: asyncpg.Pool[asyncpg.Record]
    fail: bool = False

    async def execute(self, *args: Any) -> str:
        if self.fail:
            raise asyncpg.exceptions.InternalClientError("another operation is in progress")
        return await self.pool.execute(*args)


async def test_a_failed_mark_fails_every_request_it_carried_and_the_next_one_is_tried() -> None:
    async with isolated_env(partitions=2) as env:
        failing = _Failing(env.pool)
        marks = idempotency.PublishedMarks(failing)  # type: ignore[arg-type]
        ids = [f"mark-{i}" for i in range(3)]
        for command_id in [*ids, "mark-later"]:
            await idempotency.claim(env.pool, command_id, command_id, "CreateSandbox", "a", "f")
        failing.fail = True
        results = await asyncio.gather(*(marks.mark(i) for i in ids), return_exceptions=True)
        assert all(isinstance(r, asyncpg.exceptions.InternalClientError) for r in results)
        failing.fail = False
        await marks.mark("mark-later")
        rows = await env.pool.fetch("SELECT command_id, published FROM api_commands")
        assert {r["command_id"]: r["published"] for r in rows} == {
            **dict.fromkeys(ids, False), "mark-later": True,
        }  # fmt: skip
