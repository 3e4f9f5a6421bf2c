"""The control plane's own services in one process: processor, executor, watcher, reconciler.

``DriverSide`` is the part that touches a container backend (executor + watcher + reconciler):
``python -m services.executor`` runs it alone with the Podman driver. ``ControlPlane`` is a
processor plus a ``DriverSide``: ``sandstream up`` runs it next to the HTTP API; tests run it
against isolated topics and schemas with the fake or the Podman driver.

A component that dies takes the whole set down (``stopping`` is set): a half-running control
plane would look healthy while it no longer applies or executes anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer

from drivers.protocol import Driver
from services.executor import Executor, RetryPolicy
from services.processor import Processor, connect_pool
from services.settings import Settings
from services.watcher import Reconciler, Watcher

log = logging.getLogger("sandstream.runtime")

# How long stop() waits for a component's task before cancelling it. The executor's own
# shutdown grace (for driver calls in flight) is shorter, so it drains within this.
STOP_TIMEOUT = 30.0


@dataclass
class _Tasks:
    """Named tasks sharing one stop event; a crash of one sets it."""

    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._ended)
        self.tasks.append(task)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s crashed: %r; stopping", task.get_name(), task.exception())
            self.stop_event.set()

    async def finish(self, cancel_first: tuple[str, ...] = ()) -> None:
        """Set the stop event and wait for every task (cancelling ``cancel_first`` ones,
        which wait on something other than the event, and any that overstay)."""
        self.stop_event.set()
        for task in self.tasks:
            if task.get_name() in cancel_first:
                task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=STOP_TIMEOUT)
        failed = [t for t in self.tasks if not t.cancelled() and t.exception() is not None]
        self.tasks.clear()
        for task in failed:
            log.error("%s ended with %r", task.get_name(), task.exception())


@dataclass
class DriverSide:
    """Executor + watcher + reconciler around one driver.

    ``None`` settings-backed knobs default to the ``Settings`` values
    (``executor_concurrency``, ``executor_retry_seconds``, ``reconcile_interval_seconds``).
    """

    settings: Settings
    driver: Driver
    pool: asyncpg.Pool[asyncpg.Record]
    reconcile_interval: float | None = None
    executor_concurrency: int | None = None
    retry: RetryPolicy | None = None
    executor: Executor | None = None
    watcher: Watcher | None = None
    reconciler: Reconciler | None = None
    _producer: AIOKafkaProducer | None = None
    _tasks: _Tasks = field(default_factory=_Tasks)

    @property
    def stopping(self) -> asyncio.Event:
        return self._tasks.stop_event

    async def start(self, tasks: _Tasks | None = None) -> None:
        if tasks is not None:
            self._tasks = tasks
        interval = self.reconcile_interval or self.settings.reconcile_interval_seconds
        self.executor = Executor(
            self.settings, self.driver, max_concurrency=self.executor_concurrency, retry=self.retry
        )
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka_bootstrap, enable_idempotence=True, acks="all"
        )
        await self._producer.start()
        await self.executor.start()
        self.watcher = Watcher(self.driver, self._producer, self.settings)
        self.reconciler = Reconciler(
            self.driver, self.pool, self._producer, self.settings, interval
        )
        stop = self._tasks.stop_event
        self._tasks.spawn("executor", self.executor.run(stop))
        self._tasks.spawn("watcher", self.watcher.run(stop))
        self._tasks.spawn("reconciler", self.reconciler.run(stop))

    async def close(self) -> None:
        """Release what ``start`` opened (after the tasks have ended)."""
        if self.executor is not None:
            await self.executor.stop()
        if self._producer is not None:
            await self._producer.stop()

    async def stop(self) -> None:
        # The watcher waits on the driver's stream, not on the stop event: cancel it.
        await self._tasks.finish(cancel_first=("watcher",))
        await self.close()


@dataclass
class ControlPlane:
    """Processor + DriverSide in one process."""

    settings: Settings
    driver: Driver
    pool: asyncpg.Pool[asyncpg.Record]
    reconcile_interval: float | None = None
    executor_concurrency: int | None = None
    retry: RetryPolicy | None = None
    owns_pool: bool = False
    processor: Processor | None = None
    driver_side: DriverSide | None = None
    _tasks: _Tasks = field(default_factory=_Tasks)

    @property
    def executor(self) -> Executor | None:
        return self.driver_side.executor if self.driver_side else None

    @property
    def reconciler(self) -> Reconciler | None:
        return self.driver_side.reconciler if self.driver_side else None

    async def start(self) -> None:
        self.processor = Processor(self.settings, self.pool)
        await self.processor.start()
        self._tasks.spawn("processor", self.processor.run(self._tasks.stop_event))
        self.driver_side = DriverSide(
            self.settings,
            self.driver,
            self.pool,
            reconcile_interval=self.reconcile_interval,
            executor_concurrency=self.executor_concurrency,
            retry=self.retry,
        )
        await self.driver_side.start(self._tasks)

    @property
    def stopping(self) -> asyncio.Event:
        return self._tasks.stop_event

    async def wait(self) -> None:
        await self._tasks.stop_event.wait()

    async def stop(self) -> None:
        await self._tasks.finish(cancel_first=("watcher",))
        if self.driver_side is not None:
            await self.driver_side.close()
        if self.processor is not None:
            await self.processor.stop()
        if self.owns_pool:
            await self.pool.close()


async def open_control_plane(settings: Settings, driver: Driver, **kwargs: Any) -> ControlPlane:
    pool = await connect_pool(settings)
    plane = ControlPlane(settings, driver, pool, owns_pool=True, **kwargs)
    await plane.start()
    return plane


async def serve_driver_side(settings: Settings, stop: asyncio.Event) -> None:
    """Executor + watcher + reconciler with the Podman driver until ``stop`` (or a crash)."""
    from drivers.podman import PodmanDriver

    pool = await connect_pool(settings)
    driver = PodmanDriver(settings=settings)
    side = DriverSide(settings, driver, pool)
    try:
        await side.start()
        waiter = asyncio.ensure_future(stop.wait())
        crashed = asyncio.ensure_future(side.stopping.wait())
        await asyncio.wait([waiter, crashed], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        crashed.cancel()
    finally:
        await side.stop()
        await driver.close()
        await pool.close()
