"""Isolated environments on the real stack: fresh topics, a fresh schema, running processors.

Each environment gets its own topic names, consumer groups and PostgreSQL schema, so tests can
run against the one local Kafka and PostgreSQL without seeing each other's data.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg
from aiokafka import AIOKafkaProducer, ConsumerRecord

from events.codec import encode
from events.log_reader import read_to_end
from events.publisher import CommandPublisher
from services.common.kafka_clients import Role, kafka_client_args
from services.common.settings import PROJECT_ROOT, Settings
from services.localstack.isolation import isolated
from services.processor.consumer import Processor

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T] | T],
    check: Callable[[T], bool],
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``probe`` (sync or async) until ``check`` holds, then return its value; fail at
    the deadline with the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if check(value):
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {value!r}")
        await asyncio.sleep(interval)


@dataclass
class Env:
    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    processors: list[tuple[Processor, asyncio.Event, asyncio.Task[None]]] = field(
        default_factory=list
    )

    def env_vars(self) -> dict[str, str]:
        """Environment for a subprocess that should use this environment's settings."""
        return {**os.environ, **self.settings.as_env()}

    async def start_processor(self, name: str = "p1", **kwargs: Any) -> Processor:
        processor = Processor(self.settings, self.pool, name=name, **kwargs)
        await processor.start()
        stop = asyncio.Event()
        task = asyncio.create_task(processor.run(stop))
        self.processors.append((processor, stop, task))
        return processor

    async def stop_processor(self, processor: Processor) -> None:
        for entry in list(self.processors):
            if entry[0] is processor:
                _, stop, task = entry
                stop.set()
                await task
                await processor.stop()
                self.processors.remove(entry)

    def spawn_processor(self, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "services.processor"],
            cwd=PROJECT_ROOT,
            env=env or self.env_vars(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    async def publisher(self) -> CommandPublisher:
        return CommandPublisher(
            kafka_client_args(self.settings, "api"), topic=self.settings.topic_commands
        )

    async def produce(
        self, topic: str, records: list[tuple[bytes | None, bytes | None]], role: Role = "admin"
    ) -> None:
        producer = AIOKafkaProducer(
            **kafka_client_args(self.settings, role), enable_idempotence=True, acks="all"
        )
        await producer.start()
        try:
            futures = [await producer.send(topic, value=v, key=k) for k, v in records]
            await asyncio.gather(*futures)
        finally:
            await producer.stop()

    async def produce_to(
        self, topic: str, partition: int, key: bytes | None, value: bytes | None
    ) -> None:
        """One record to one partition (a golden log's record where it was recorded)."""
        producer = AIOKafkaProducer(**kafka_client_args(self.settings, "admin"), acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topic, value=value, key=key, partition=partition)
        finally:
            await producer.stop()

    async def observe(self, *observations: Any) -> None:
        await self.produce(
            self.settings.topic_observations,
            [(o.key.encode(), encode(o)) for o in observations],
            role="watcher",
        )

    async def read_topic(self, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
        """Every record currently in ``topic``, in partition then offset order."""
        s = self.settings
        records = [
            r async for r in read_to_end(kafka_client_args(s, "audit"), topic, s.kafka_partitions)
        ]
        return sorted(records, key=lambda r: (r.partition, r.offset))

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            return list(await conn.fetch(query, *args))

    async def fetchval(self, query: str, *args: Any) -> Any:
        async with self.pool.acquire() as conn:
            return await conn.fetchval(query, *args)

    async def wait_applied(self, count: int, timeout: float = 60.0) -> int:
        """Wait until ``count`` input records are in the history."""
        return int(
            await eventually(
                lambda: self.fetchval("SELECT count(*) FROM history"),
                lambda n: n >= count,
                timeout=timeout,
                what=f"{count} history rows",
            )
        )


@asynccontextmanager
async def isolated_env(
    partitions: int = 4, base: Settings | None = None, **more: Any
) -> AsyncIterator[Env]:
    """A test environment of its own on the local stack (short session timeouts for crashes);
    ``base`` to use another broker, ``more`` to override more settings."""
    overrides = {"kafka_partitions": partitions, "kafka_session_timeout_ms": 2000, **more}
    async with isolated(base or Settings(), "t", **overrides) as (settings, pool):
        env = Env(settings, pool)
        try:
            yield env
        finally:
            for processor, stop, task in list(env.processors):
                stop.set()
                await asyncio.wait_for(task, 30)
                await processor.stop()


@dataclass
class OneConnection:
    """A stand-in for the pool that hands out one connection, so that the scans of what runs
    on it are counted in its transaction."""

    conn: Any

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        yield self.conn

    async def fetchrow(self, query: str, *args: Any) -> Any:
        return await self.conn.fetchrow(query, *args)

    async def fetch(self, query: str, *args: Any) -> Any:
        return await self.conn.fetch(query, *args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self.conn.fetchval(query, *args)
