"""One intent's driver call: its shared slot or its caller's lane, the row check right before
it, the provider values a launch reads, retries of transient failures, and the result as the
``DriverOperationResult`` the executor reports.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

from drivers.protocol import Driver, DriverError, LaunchResult, OpResult, operation_result
from events.backoff import Backoff, delay_after, pause, retry
from events.common import Phase
from events.decided import DecidedEvent
from events.observations import DriverOperationResult
from projections.lifecycle import Sandbox
from projections.store import CONNECTION_ERRORS
from services.common import metrics
from services.common.providers import LaunchValues
from services.common.settings import Settings
from services.executor.clock import Clock
from services.executor.intents import Dropped, Intent, is_slow, takes_lane, unwanted
from services.executor.progress import Ownership, WorkItem
from services.executor.rows import Pool, RowReader

log = logging.getLogger("sandstream.executor")

T = TypeVar("T")

CallResult = LaunchResult | OpResult | bool | DriverError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off for retryable driver failures.

    Attempts continue while the next one would start within ``give_up_after`` seconds of the
    first (0: never retry).
    """

    first_delay: float = 0.5
    max_delay: float = 10.0
    give_up_after: float = 600.0

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number ``attempt`` (1-based)."""
        return delay_after(attempt, self.first_delay, self.max_delay)

    def next_delay(self, attempt: int, elapsed: float) -> float | None:
        """The pause before another attempt, or None when it is time to give up."""
        delay = self.delay(attempt)
        return delay if elapsed + delay <= self.give_up_after else None


class DriverCalls:
    """Runs intents against the driver, bounded: fast calls share ``max_concurrency`` slots,
    slow ones (that may wait out a grace period) take their caller's lane."""

    def __init__(
        self,
        settings: Settings,
        driver: Driver,
        pool: Pool,
        ownership: Ownership,
        *,
        retry: RetryPolicy,
        max_concurrency: int,
        slow_per_caller: int,
        clock: Clock,
        values: Callable[[str, Sandbox | None], Awaitable[LaunchValues | None]],
    ) -> None:
        self.settings = settings
        self.driver = driver
        self.pool = pool
        self.rows = RowReader(pool)  # the rows intents are checked against, read together
        self.ownership = ownership
        self.retry = retry
        self.slow_per_caller = slow_per_caller
        self.clock = clock
        # The attached providers' values of a sandbox, read right before its launch (None:
        # launches get none); given the row the call was just checked against.
        self.values = values
        self.running = 0  # driver calls in progress (in a shared slot or a caller's lane)
        self.waiting = 0  # driver calls waiting for a slot or a lane
        self.dropped = 0  # intents dropped because their row no longer wants them
        self._slots = asyncio.Semaphore(max_concurrency)
        self._lanes: dict[str, asyncio.Semaphore] = {}  # per caller (actor)

    async def execute(
        self, item: WorkItem, later: Iterable[WorkItem], news: asyncio.Event
    ) -> DriverOperationResult | Dropped | None:
        """Call the driver, retrying transient failures; None when abandoned unreported
        (shutdown or revoke: the intent stays uncommitted and is redelivered), ``Dropped``
        when the row no longer wants it. ``later`` are the sandbox's queued intents after it
        (one that is still ours ends the retries), ``news`` is set when one arrives."""
        intent = item.intent
        current = self.ownership.current
        loop = asyncio.get_running_loop()
        began = loop.time()
        attempt = 0
        while True:
            attempt += 1
            result = await self._call(item)
            if result is None or isinstance(result, Dropped):
                return result
            if not isinstance(result, DriverError) or not result.retryable:
                break
            if not current(item):
                return None
            if any(current(i) for i in later):
                result.reason += "; not retried: a later intent of the sandbox is queued"
                break
            delay = self.retry.next_delay(attempt, loop.time() - began)
            if delay is None:
                result.reason += f"; gave up after {attempt} attempts"
                break
            log.warning("%s of %s failed (attempt %d), retrying in %.1fs: %s",
                        intent.operation, intent.key, attempt, delay, result.reason)  # fmt: skip
            news.clear()
            await pause(news, delay)  # a later intent cuts it short
            if not current(item):
                return None
            if any(current(i) for i in later):
                result.reason += "; not retried: a later intent of the sandbox is queued"
                break
        outcome = "failed" if isinstance(result, DriverError) else "ok"
        metrics.DRIVER_CALLS.labels(intent.operation, outcome).inc()
        return operation_result(
            operation=intent.operation,
            key=intent.key,
            generation=intent.generation,
            observation_id=intent.result_id,
            occurred_at=self.clock(),
            actor="executor",
            result=result,
        )

    async def kill(self, event: DecidedEvent) -> None:
        """Kill the runtime of the event's generation now (no slot, no lane, no result)."""
        try:
            result = await self.driver.kill(event.key, event.generation)
            metrics.DRIVER_CALLS.labels("kill", "ok").inc()
            log.warning("killed %s generation %d: its stop outlived the grace period (%s)",
                        event.key, event.generation, result.outcome)  # fmt: skip
        except Exception as exc:
            metrics.DRIVER_CALLS.labels("kill", "failed").inc()
            log.error("kill of %s generation %d failed: %r", event.key, event.generation, exc)

    def _lane(self, intent: Intent) -> asyncio.Semaphore | None:
        """Where the call waits its turn: a shared slot, or its caller's own lane when it may
        wait out a grace period (so slow sandboxes of one caller never hold the others up);
        None for a stop or a rotation or detach restart, which wait for nothing (``takes_lane``)."""
        if not is_slow(intent):
            return self._slots
        if not takes_lane(intent):
            return None
        lane = self._lanes.get(intent.actor)
        if lane is None:
            width = self.settings.executor_slow_callers.get(intent.actor, self.slow_per_caller)
            lane = self._lanes[intent.actor] = asyncio.Semaphore(max(1, width))
        return lane

    async def _call(self, item: WorkItem) -> CallResult | Dropped | None:
        """One driver call in its slot or lane, if the row still wants it; every failure comes
        back as a DriverError (an unexpected exception is a non-retryable one). None, and no
        call, if the intent stopped being this executor's while it waited for the slot."""
        lane = self._lane(item.intent)
        self.waiting += 1
        try:
            if lane is not None:
                await lane.acquire()
        finally:
            self.waiting -= 1
        try:
            if not self.ownership.current(item):
                return None
            why, row = await self._unwanted(item)
            if not self.ownership.current(item):
                return None  # revoked or shutting down meanwhile: left for the next owner
            if why is not None:
                await self._dropped(item, why)
                self.dropped += 1
                return Dropped(why)
            self.running += 1
            try:
                return await self._driver_call(item.intent, row)
            finally:
                self.running -= 1
        finally:
            if lane is not None:
                lane.release()

    async def _driver_call(self, intent: Intent, row: Sandbox | None = None) -> CallResult:
        try:
            match intent.operation:
                case "launch":
                    assert intent.launch is not None
                    # The values are read now, from PostgreSQL: they never travel in the log.
                    values = await self.values(intent.key, row)
                    secrets = values.env if values is not None else {}
                    launched = await self.driver.launch(replace(intent.launch, secrets=secrets))
                    if values is None or launched.adopted or not launched.started:
                        return launched  # what an earlier launch's runtime read is unknown
                    return replace(launched, credentials=values.revisions)
                case "stop":
                    return await self.driver.stop(intent.key, intent.generation)
                case "suspend":
                    return await self.driver.suspend(intent.key, intent.generation)
                case "delete":
                    return await self.driver.delete(intent.key, intent.sandbox_id)
            raise AssertionError(intent.operation)
        except DriverError as exc:
            return exc
        except Exception as exc:
            log.exception("%s of %s: unexpected driver error", intent.operation, intent.key)
            return DriverError(f"unexpected driver error: {exc!r}", retryable=False)

    async def _unwanted(self, item: WorkItem) -> tuple[str | None, Sandbox | None]:
        """Read the row and judge the intent: why it is not wanted (None: it is) and the row
        read."""

        async def judge() -> tuple[str | None, Sandbox | None]:
            row = await self.rows.read(item.intent.key)
            return unwanted(item.intent, row), row

        return await self._reading(item, judge, gone=("no longer this executor's", None))

    async def _reading(self, item: WorkItem, read: Callable[[], Awaitable[T]], gone: T) -> T:
        """``read()`` from PostgreSQL, retried while it is unreachable (a worker must not end
        on an outage); ``gone`` once the intent stopped being this executor's meanwhile."""

        async def attempt() -> T:
            try:
                return await read()
            except CONNECTION_ERRORS:
                if not self.ownership.current(item):
                    return gone
                raise

        backoff = Backoff(0.2, 5.0, log, f"reading the row of {item.intent.key}")
        return await retry(attempt, backoff=backoff, retry_on=CONNECTION_ERRORS)

    async def _dropped(self, item: WorkItem, why: str) -> None:
        intent = item.intent
        log.debug("%s of %s generation %d dropped: %s",
                  intent.operation, intent.key, intent.generation, why)  # fmt: skip
        # A start or restart overtaken by a stop of its own generation may never have run:
        # it still owes the older generations their stop, which would otherwise keep running.
        if intent.operation == "launch" and intent.previous_generation is not None:
            row = await self._reading(item, lambda: self.rows.read(intent.key), gone=None)
            if (
                row is not None
                and (row.sandbox_id, row.generation) == (intent.sandbox_id, intent.generation)
                and row.phase in (Phase.STOPPING, Phase.STOPPED, Phase.SUSPENDING)
            ):
                await self._stop_older(intent)

    async def _stop_older(self, intent: Intent) -> None:
        """Stop every runtime of the intent's incarnation older than its generation that still
        runs. Not only the previous generation: when a chain of starts and stops queued up,
        the launches between were skipped or dropped, and the one running may be older."""
        try:
            runtimes = await self.driver.get(intent.key)
        except Exception as exc:
            log.warning("listing %s to stop its older generations failed: %r", intent.key, exc)
            return
        for runtime in runtimes:
            if (
                runtime.sandbox_id == intent.sandbox_id
                and runtime.generation < intent.generation
                and runtime.state != "exited"
            ):
                older = replace(intent, operation="stop", generation=runtime.generation)
                result = await self._driver_call(older)
                if isinstance(result, DriverError):
                    log.warning("stopping generation %d of %s failed: %s",
                                runtime.generation, intent.key, result.reason)  # fmt: skip
