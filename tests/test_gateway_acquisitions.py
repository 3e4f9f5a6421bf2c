"""What a command submitted with ``wait`` costs PostgreSQL before its outcome: every pool
acquisition ends in a reset (a round trip of its own), so the gateway records the command and
looks for a known outcome on one, and marks it published and looks for the outcome on the
next, instead of a pool acquisition per statement."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import factories as f
from harness import isolated_env

from events.publisher import CommandPublisher
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
