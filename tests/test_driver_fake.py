"""The fake driver's contract: the protocol's semantics plus its hooks (block, fail, inject)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import cast

import pytest

from drivers.fake import FAKE_EPOCH, Call, FakeDriver
from drivers.protocol import (
    Driver,
    DriverError,
    LaunchResult,
    LaunchSpec,
    OpResult,
    WatchObservation,
    operation_result,
)
from events.common import SandboxSpec
from events.observations import (
    DriverOperationResult,
    Operation,
    RuntimeRemoved,
    RuntimeSnapshot,
)

SID = uuid.UUID("00000000-0000-4000-8000-000000000001")


def spec(key: str = "box", generation: int = 1, sandbox_id: uuid.UUID = SID) -> LaunchSpec:
    return LaunchSpec(
        key=key,
        sandbox_id=sandbox_id,
        generation=generation,
        identity=f"rid-{key}-{generation}",
        spec=SandboxSpec(image="localhost/sandstream-base:1", command=["sleep", "3600"]),
    )


async def until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Let other tasks run until ``condition`` holds; fail at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


class Stream:
    """Reads a watch stream item by item, with a deadline on every read.

    Like any async generator, the stream subscribes at its first read.
    """

    def __init__(self, driver: FakeDriver) -> None:
        self._iterator = cast(AsyncGenerator[WatchObservation, None], driver.watch())

    async def next(self) -> WatchObservation:
        return await asyncio.wait_for(anext(self._iterator), 5)

    async def take(self, n: int) -> list[WatchObservation]:
        return [await self.next() for _ in range(n)]

    async def close(self) -> None:
        await self._iterator.aclose()


def states(observations: list[WatchObservation]) -> list[tuple[str, int, str, str]]:
    return [
        (o.key, o.generation, o.state if isinstance(o, RuntimeSnapshot) else "removed", o.source)
        for o in observations
    ]


def test_fake_implements_the_protocol() -> None:
    assert isinstance(FakeDriver(), Driver)


async def test_launch_is_idempotent_and_recorded() -> None:
    driver = FakeDriver()
    first = await driver.launch(spec())
    again = await driver.launch(spec())
    assert first.started and not again.started and again.runtime_id == first.runtime_id
    [info] = await driver.get("box")
    assert (info.generation, info.state, info.identity, info.sandbox_id) == (
        1,
        "running",
        "rid-box-1",
        SID,
    )
    assert driver.calls == [
        Call("launch", "box", 1, spec=spec()),
        Call("launch", "box", 1, spec=spec()),
        Call("get", "box"),
    ]
    assert driver.has_workspace("box", SID)


async def test_launch_replaces_older_generations_and_never_restarts_a_stopped_one() -> None:
    driver = FakeDriver()
    await driver.launch(spec(generation=1))
    stopped = await driver.stop("box", 1)
    assert stopped == OpResult("succeeded", stopped.runtime_id, 143)
    with pytest.raises(DriverError) as again:
        await driver.launch(spec(generation=1))  # a redelivered launch after the stop
    assert not again.value.retryable and again.value.observed == "exited"
    assert [(i.generation, i.state) for i in await driver.get("box")] == [(1, "exited")]
    await driver.launch(spec(generation=2))
    assert [(i.generation, i.state) for i in await driver.get("box")] == [(2, "running")]
    with pytest.raises(DriverError) as failure:
        await driver.launch(spec(generation=1))  # superseded by generation 2
    assert not failure.value.retryable and failure.value.observed == "running"


async def test_the_stop_timeout_of_a_sandbox_is_recorded_and_used() -> None:
    driver = FakeDriver(stop_timeout=10)
    patient = LaunchSpec(
        "slow", SID, 1, "rid-slow-1",
        SandboxSpec(image="localhost/sandstream-base:1", stop_timeout_seconds=30),
    )  # fmt: skip
    await driver.launch(patient)
    await driver.launch(spec("plain"))
    assert driver.stop_timeout_of("slow", 1) == 30
    assert driver.stop_timeout_of("plain", 1) is None
    await driver.stop("slow", 1)  # no timeout given: the sandbox's own
    await driver.stop("plain", 1)  # ... or the driver's default
    await driver.stop("slow", 1, timeout=2)  # an explicit one wins
    await driver.delete("slow")
    await driver.delete("plain")
    await driver.delete("plain")  # nothing left to stop
    assert [(c.op, c.key, c.timeout, c.grace) for c in driver.calls if c.op != "launch"] == [
        ("stop", "slow", None, 30),
        ("stop", "plain", None, 10),
        ("stop", "slow", 2, 2),
        ("delete", "slow", None, 30),
        ("delete", "plain", None, 10),
        ("delete", "plain", None, None),
    ]


async def test_stop_and_delete_when_absent() -> None:
    driver = FakeDriver()
    assert await driver.stop("box", 1) == OpResult("already_absent")
    assert await driver.delete("box") is False
    await driver.launch(spec())
    assert await driver.delete("box") is True
    assert await driver.get("box") == [] and not driver.has_workspace("box")
    assert await driver.delete("box") is False


async def test_delete_of_one_incarnation_keeps_the_other() -> None:
    driver = FakeDriver()
    old, new = uuid.uuid4(), uuid.uuid4()
    await driver.launch(spec(generation=1, sandbox_id=old))
    await driver.launch(spec(generation=2, sandbox_id=new))
    assert await driver.delete("box", sandbox_id=old) is True  # its workspace was left
    assert not driver.has_workspace("box", old) and driver.has_workspace("box", new)
    assert [i.generation for i in await driver.get("box")] == [2]


async def test_block_holds_one_key_until_release() -> None:
    driver = FakeDriver()
    await driver.launch(spec("a"))
    handle = driver.block("delete", "a")
    delete_a = asyncio.create_task(driver.delete("a"))
    await handle.entered()
    assert not delete_a.done() and handle.held == 1
    # Other keys and other operations are not held.
    assert (await driver.launch(spec("b"))).started
    assert (await driver.stop("a", 1)).outcome == "succeeded"
    assert not delete_a.done()
    handle.release()
    assert await asyncio.wait_for(delete_a, 5) is True
    assert await driver.get("a") == []
    # Released for good: later calls pass.
    assert await driver.delete("a") is False


async def test_block_any_key() -> None:
    driver = FakeDriver()
    handle = driver.block("launch")
    tasks = [asyncio.create_task(driver.launch(spec(k))) for k in ("a", "b")]
    await until(lambda: handle.held == 2, "both launches held")
    assert handle.held == 2 and not any(t.done() for t in tasks)
    handle.release()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(r.started for r in results)


async def test_fail_raises_once_with_the_observed_state() -> None:
    driver = FakeDriver()
    await driver.launch(spec())
    driver.fail("stop", "box", "runtime busy", retryable=True)
    with pytest.raises(DriverError) as failure:
        await driver.stop("box", 1)
    assert (failure.value.reason, failure.value.retryable, failure.value.observed) == (
        "runtime busy",
        True,
        "running",
    )
    assert (await driver.stop("box", 1)).outcome == "succeeded"  # only once


async def test_fail_after_block_and_for_several_calls() -> None:
    driver = FakeDriver()
    await driver.launch(spec())
    handle = driver.block("delete", "box")
    driver.fail("delete", "box", "backend timeout", retryable=False, times=2)
    delete = asyncio.create_task(driver.delete("box"))
    await handle.entered()
    handle.release()
    with pytest.raises(DriverError) as failure:
        await asyncio.wait_for(delete, 5)
    assert not failure.value.retryable and failure.value.observed == "running"
    with pytest.raises(DriverError):
        await driver.delete("box")
    assert await driver.delete("box") is True
    with pytest.raises(ValueError):
        driver.fail("stop", "box", "x", retryable=True, times=0)


async def test_watch_lists_first_then_follows() -> None:
    driver = FakeDriver()
    await driver.launch(spec("a"))
    stream = Stream(driver)
    listing = await stream.next()
    assert states([listing]) == [("a", 1, "running", "list")]
    await driver.launch(spec("a", 2))
    changes = await stream.take(4)
    assert states(changes) == [
        ("a", 1, "exited", "watch"),
        ("a", 1, "removed", "watch"),
        ("a", 2, "created", "watch"),
        ("a", 2, "running", "watch"),
    ]
    assert isinstance(changes[0], RuntimeSnapshot) and changes[0].exit_code == 143
    driver.runtime_exited("a", 2, exit_code=0)
    [done] = await stream.take(1)
    assert isinstance(done, RuntimeSnapshot) and (done.state, done.exit_code) == ("exited", 0)
    await stream.close()
    assert driver.watcher_count == 0


async def test_watch_reconnect_lists_again_with_the_same_ids() -> None:
    driver = FakeDriver()
    await driver.launch(spec("a"))
    stream = Stream(driver)
    first = await stream.next()
    driver.reconnect_watchers()
    again = await stream.next()
    assert again.source == "list" and again.observation_id == first.observation_id
    await stream.close()


async def test_inject_reaches_every_watcher() -> None:
    driver = FakeDriver(auto_observe=False)
    late = RuntimeSnapshot(
        type="RuntimeSnapshot",
        observation_id="late-1",
        key="a",
        generation=1,
        occurred_at=FAKE_EPOCH,
        actor="test",
        state="exited",
        exit_code=143,
    )
    driver.inject(late)  # no watcher yet: held for the first one
    one, two = Stream(driver), Stream(driver)
    assert await one.next() == late
    await driver.launch(spec("a"))  # auto_observe=False: nothing on the streams
    gone = RuntimeRemoved(
        type="RuntimeRemoved",
        observation_id="gone-1",
        key="a",
        generation=1,
        occurred_at=FAKE_EPOCH,
        actor="test",
    )
    # The second stream lists at its first read: the runtime launched above.
    assert states([await two.next()]) == [("a", 1, "running", "list")]
    driver.inject(gone)
    assert await one.next() == gone
    assert await two.next() == gone
    await one.close()
    await two.close()


async def test_close_ends_watch_and_releases_blocks() -> None:
    driver = FakeDriver()
    stream = Stream(driver)
    handle = driver.block("stop", "box")
    stop = asyncio.create_task(driver.stop("box", 1))
    await handle.entered()
    reader = asyncio.create_task(stream.next())
    await until(lambda: driver.watcher_count == 1, "the stream subscribed")
    await driver.close()
    assert (await asyncio.wait_for(stop, 5)).outcome == "already_absent"
    with pytest.raises(StopAsyncIteration):
        await reader
    await stream.close()


def test_timestamps_and_ids_are_deterministic() -> None:
    async def run() -> list[tuple[str, str]]:
        driver = FakeDriver()
        stream = Stream(driver)
        reader = asyncio.create_task(stream.take(3))
        await until(lambda: driver.watcher_count == 1, "the stream subscribed")
        await driver.launch(spec())
        await driver.stop("box", 1)
        observations = await asyncio.wait_for(reader, 5)
        await stream.close()
        return [(o.observation_id, o.occurred_at.isoformat()) for o in observations]

    first = asyncio.run(run())
    assert first == asyncio.run(run())
    assert all(stamp.endswith("+00:00") for _, stamp in first)


def test_operation_results_become_observations() -> None:
    def observe(
        operation: Operation, result: LaunchResult | OpResult | bool | DriverError
    ) -> DriverOperationResult:
        return operation_result(
            operation=operation,
            key="box",
            generation=2,
            observation_id=f"ev-1:{operation}",
            occurred_at=FAKE_EPOCH,
            actor="executor",
            result=result,
        )

    launched = observe("launch", LaunchResult("c1", 2, "rid-x", True))
    assert (launched.outcome, launched.identity) == ("succeeded", "rid-x")
    assert observe("stop", OpResult("already_absent")).outcome == "already_absent"
    assert observe("stop", OpResult("succeeded", "c1", 143)).exit_code == 143
    assert observe("delete", True).outcome == "succeeded"
    assert observe("delete", False).outcome == "already_absent"
    failed = observe("delete", DriverError("boom", retryable=True, observed="exited"))
    assert (failed.outcome, failed.retryable, failed.reason, failed.observed) == (
        "failed",
        True,
        "boom",
        "exited",
    )
