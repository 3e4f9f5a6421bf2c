"""The executor reads the rows its intents are checked against together (``RowReader``): the
reads asked for at one moment, or while a statement is in flight, go in one statement; a read
is never answered by a statement sent before it was asked for. On a real PostgreSQL."""

from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import asyncpg
import pytest
from harness import isolated_env

from drivers.fake import FakeDriver
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.executor.calls import DriverCalls, RetryPolicy
from services.executor.clock import utcnow
from services.executor.intents import Dropped, Intent
from services.executor.progress import Ownership, PartitionProgress, WorkItem
from services.executor.rows import RowReader, read_row


@dataclass
class Counted:
    """The pool, counting the statements of the reader and holding the first one's answer
    (after it ran) until ``release`` is set, when ``hold`` is."""

    pool: Any
    hold: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    ran: asyncio.Event = field(default_factory=asyncio.Event)
    keys: list[list[str]] = field(default_factory=list)
    fail: BaseException | None = None
    fail_at: int = 1  # the statement (counted from 1) that ``fail`` fails
    unreadable: bool = False  # answer a record no row can be made from

    async def fetch(self, query: str, keys: list[str]) -> Any:
        self.keys.append(sorted(keys))
        if self.fail is not None and len(self.keys) == self.fail_at:
            failure, self.fail = self.fail, None
            raise failure
        records = await self.pool.fetch(query, keys)
        if self.unreadable:
            return [{"key": k} for k in keys]
        if self.hold and len(self.keys) == 1:
            self.ran.set()
            await self.release.wait()
        return records


async def add_row(pool: Any, key: str, version: int = 1) -> None:
    await pool.execute(
        "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers, "
        "identity, created_at, updated_at, partition, change_seq) "
        "VALUES ($1, $2, 'Ready', 1, $3, $4, '{}', 'rid-1', now(), now(), 0, 1)",
        key,
        uuid4(),
        version,
        '{"image": "busybox"}',
    )


async def test_reads_asked_together_go_in_one_statement_each_with_its_own_row() -> None:
    async with isolated_env() as env:
        keys = [f"r{i}" for i in range(20)]
        for i, key in enumerate(keys):
            await add_row(env.pool, key, version=i + 1)
        counted = Counted(env.pool)
        reader = RowReader(counted)  # type: ignore[arg-type]
        rows = await asyncio.gather(*(reader.read(k) for k in [*keys, "missing", "r3"]))
        assert counted.keys == [sorted({*keys, "missing"})]
        assert [r.version if r else None for r in rows] == [*range(1, 21), None, 4]
        assert rows[0] == await read_row(env.pool, "r0")  # the same row a read of one reads


async def test_a_read_asked_while_a_statement_is_in_flight_gets_a_later_one() -> None:
    async with isolated_env() as env:
        await add_row(env.pool, "a", version=1)
        counted = Counted(env.pool, hold=True)
        reader = RowReader(counted)  # type: ignore[arg-type]
        first = asyncio.ensure_future(reader.read("a"))
        await counted.ran.wait()  # the first statement has read version 1
        await env.pool.execute("UPDATE sandboxes SET version = 5 WHERE key = 'a'")
        later = [asyncio.ensure_future(reader.read(k)) for k in ("a", "a", "b")]
        counted.release.set()
        row = await first
        assert row is not None and row.version == 1
        again = await asyncio.gather(*later)
        assert [r.version if r else None for r in again] == [5, 5, None]
        assert counted.keys == [["a"], ["a", "b"]]


async def test_a_failed_statement_fails_its_reads_and_the_next_read_is_answered() -> None:
    async with isolated_env() as env:
        await add_row(env.pool, "a")
        counted = Counted(env.pool, fail=TimeoutError("no answer"))
        reader = RowReader(counted)  # type: ignore[arg-type]
        results = await asyncio.gather(reader.read("a"), reader.read("b"), return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in results), results
        row = await reader.read("a")
        assert row is not None and row.key == "a"
        assert counted.keys == [["a", "b"], ["a"]]


async def test_each_read_failed_by_one_statement_raises_its_own_copy_caused_by_it() -> None:
    """One exception object raised in many tasks gathers their frames: a caller's logged
    traceback then showed another caller's code. Each read gets a copy of the statement's
    error (same type and message), caused by it, and its traceback names only its own path."""
    async with isolated_env() as env:
        lost = asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed")
        reader = RowReader(Counted(env.pool, fail=lost))  # type: ignore[arg-type]

        async def first_caller() -> Any:
            return await reader.read("a")

        async def second_caller() -> Any:
            return await reader.read("b")

        results = await asyncio.gather(first_caller(), second_caller(), return_exceptions=True)
        assert [type(r) for r in results] == [type(lost)] * 2, results
        one, two = results
        assert one is not two and str(one) == str(two) == "connection was closed"
        assert one.__cause__ is lost and two.__cause__ is lost
        frames = [
            {f.name for f in traceback.extract_tb(r.__traceback__)} for r in (one, two)
        ]  # fmt: skip
        assert "first_caller" in frames[0] and "second_caller" not in frames[0], frames
        assert "second_caller" in frames[1] and "first_caller" not in frames[1], frames


async def test_a_caller_that_leaves_does_not_stop_the_others_reads() -> None:
    async with isolated_env() as env:
        await add_row(env.pool, "a")
        counted = Counted(env.pool, hold=True)
        reader = RowReader(counted)  # type: ignore[arg-type]
        leaving = asyncio.ensure_future(reader.read("a"))
        staying = asyncio.ensure_future(reader.read("a"))
        await counted.ran.wait()
        leaving.cancel()
        counted.release.set()
        row = await staying
        assert row is not None and row.key == "a"
        with pytest.raises(asyncio.CancelledError):
            await leaving


async def test_the_real_pool_reads_through_the_reader_as_read_row_does() -> None:
    async with isolated_env() as env:
        await add_row(env.pool, "a", version=3)
        counted = Counted(env.pool)
        reader = RowReader(counted)  # type: ignore[arg-type]
        row = await reader.read("a")
        assert row == await read_row(env.pool, "a")
        assert counted.keys == [["a"]]
        pool: asyncpg.Pool[asyncpg.Record] = env.pool
        await pool.execute("DELETE FROM sandboxes WHERE key = 'a'")
        assert await reader.read("a") is None


async def test_a_row_that_cannot_be_read_fails_its_reads_instead_of_leaving_them_waiting() -> None:
    """A record the row cannot be made from raised outside the statement's error handling:
    its callers waited forever (read_row raised it to its caller)."""
    async with isolated_env() as env:
        counted = Counted(env.pool, unreadable=True)
        reader = RowReader(counted)  # type: ignore[arg-type]
        reads = asyncio.gather(reader.read("a"), reader.read("b"), return_exceptions=True)
        results = await asyncio.wait_for(reads, 10)
        assert all(isinstance(r, KeyError) for r in results), results
        counted.unreadable = False
        assert await reader.read("a") is None  # the next statement is sent and answered


async def test_a_dropped_restarts_second_row_read_survives_a_lost_connection() -> None:
    """Found by a chaos run: a restart's launch dropped under a Stopping row reads the row once
    more, to see whether it still owes generation 1 its stop. That read lost its PostgreSQL
    connection and, not retried, ended the worker and with it the executor. It is retried
    now, as the check before it is: the launch is dropped and generation 1 stopped."""
    async with isolated_env() as env:
        await add_row(env.pool, "y")
        await env.pool.execute("UPDATE sandboxes SET phase = 'Stopping', generation = 2")
        sandbox_id = (await read_row(env.pool, "y")).sandbox_id  # type: ignore[union-attr]
        spec = SandboxSpec(image="busybox")
        driver = FakeDriver()
        await driver.launch(LaunchSpec("y", sandbox_id, 1, "rid-1", spec))
        lost = asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed")
        counted = Counted(env.pool, fail=lost, fail_at=2)  # the read after the check
        ownership = Ownership(env.settings)
        ownership.owned = {ownership.partition_of("y"): PartitionProgress()}

        async def no_values(key: str, row: object) -> None:
            raise AssertionError("a dropped launch reads no provider values")

        calls = DriverCalls(
            env.settings, driver, counted, ownership,  # type: ignore[arg-type]
            retry=RetryPolicy(), max_concurrency=1, slow_per_caller=1, clock=utcnow,
            values=no_values,
        )  # fmt: skip
        restart = Intent("launch", "y", sandbox_id, 2, "result:y:2", "alice",
                         launch=LaunchSpec("y", sandbox_id, 2, "rid-1", spec),
                         previous_generation=1)  # fmt: skip
        result = await calls.execute(WorkItem(restart), [], asyncio.Event())
        assert isinstance(result, Dropped), result
        assert counted.keys == [["y"], ["y"], ["y"]]  # the check, the lost read, its retry
        assert [(r.generation, r.state) for r in await driver.get("y")] == [(1, "exited")]
