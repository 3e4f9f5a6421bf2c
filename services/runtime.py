"""The control plane's own services in one process: processor, executor, watcher, reconciler.

``sandstream up`` runs this next to the HTTP API; tests run it against isolated topics and
schemas with the fake or the Podman driver.
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
from services.watcher import run_reconciler, run_watcher

log = logging.getLogger("sandstream.runtime")


@dataclass
class ControlPlane:
    settings: Settings
    driver: Driver
    pool: asyncpg.Pool[asyncpg.Record]
    reconcile_interval: float = 30.0
    executor_concurrency: int = 16
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    owns_pool: bool = False
    processor: Processor | None = None
    executor: Executor | None = None
    _producer: AIOKafkaProducer | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        self.processor = Processor(self.settings, self.pool)
        self.executor = Executor(
            self.settings,
            self.driver,
            max_concurrency=self.executor_concurrency,
            retry=self.retry,
        )
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka_bootstrap, enable_idempotence=True, acks="all"
        )
        await self._producer.start()
        await self.processor.start()
        await self.executor.start()
        self._spawn("processor", self.processor.run(self._stop))
        self._spawn("executor", self.executor.run(self._stop))
        self._spawn("watcher", run_watcher(self.driver, self._producer, self.settings, self._stop))
        self._spawn(
            "reconciler",
            run_reconciler(
                self.driver,
                self.pool,
                self._producer,
                self.settings,
                self._stop,
                self.reconcile_interval,
            ),
        )

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._crashed)
        self._tasks.append(task)

    def _crashed(self, task: asyncio.Task[None]) -> None:
        # A component that dies takes the whole process down: a half-running control plane
        # would look healthy while it no longer applies or executes anything.
        if not task.cancelled() and task.exception() is not None:
            log.error("%s crashed: %r; stopping", task.get_name(), task.exception())
            self._stop.set()

    @property
    def stopping(self) -> asyncio.Event:
        return self._stop

    async def wait(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        self._stop.set()
        # The watcher waits on the driver's stream; cancel what does not notice the flag.
        for task in self._tasks:
            if task.get_name() == "watcher":
                task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=30)
        if self.executor is not None:
            await self.executor.stop()
        if self.processor is not None:
            await self.processor.stop()
        if self._producer is not None:
            await self._producer.stop()
        if self.owns_pool:
            await self.pool.close()
        failed = [t for t in self._tasks if not t.cancelled() and t.exception() is not None]
        self._tasks.clear()
        for task in failed:
            log.error("%s ended with %r", task.get_name(), task.exception())


async def open_control_plane(settings: Settings, driver: Driver, **kwargs: Any) -> ControlPlane:
    pool = await connect_pool(settings)
    plane = ControlPlane(settings, driver, pool, owns_pool=True, **kwargs)
    await plane.start()
    return plane
