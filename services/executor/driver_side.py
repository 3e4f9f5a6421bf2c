"""The part of the control plane that touches a container backend: executor + watcher +
reconciler around one driver, sharing one stop event (a crash of one stops all three).

``python -m services.executor`` runs it alone with the driver the settings name
(``serve_driver_side``). Run as separate roles, ``parts`` splits it in two: the executor
(scalable; the reconcile loop there only hands it stuck rows of its own partitions) and the
watcher (the driver watcher and the reconcile loop's reports; single-active under a lease).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Final, Literal

import asyncpg

from drivers.protocol import Driver
from events.publisher import RenewingProducer
from services.common.database import connect_pool
from services.common.kafka_clients import Role, kafka_client_args
from services.common.settings import Settings
from services.common.tasks import Tasks
from services.executor.backends import driver_from_settings
from services.executor.credentials import LaunchCredentials
from services.executor.executor import Executor, RetryPolicy
from services.executor.reconcile import Reconciler
from services.executor.watcher import Watcher

Part = Literal["executor", "watcher"]
BOTH: Final[frozenset[Part]] = frozenset(("executor", "watcher"))


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
    # executor: the executor and the pick-up of stuck rows; watcher: the driver watcher and
    # the reconcile loop's reports of differences.
    parts: frozenset[Part] = BOTH
    executor: Executor | None = None
    watcher: Watcher | None = None
    reconciler: Reconciler | None = None
    _producer: RenewingProducer | None = None
    _tasks: Tasks = field(default_factory=Tasks)

    @property
    def stopping(self) -> asyncio.Event:
        return self._tasks.stop_event

    async def start(self, tasks: Tasks | None = None) -> None:
        if tasks is not None:
            self._tasks = tasks
        interval = self.reconcile_interval or self.settings.reconcile_interval_seconds
        # The watcher's and the reconcile loop's reports; an executor alone reports nothing.
        role: Role = "watcher" if "watcher" in self.parts else "executor"
        self._producer = RenewingProducer(kafka_client_args(self.settings, role))
        await self._producer.start()
        stop = self._tasks.stop_event
        if "executor" in self.parts:
            self.executor = Executor(
                self.settings,
                self.driver,
                self.pool,
                max_concurrency=self.executor_concurrency,
                retry=self.retry,
                credentials=LaunchCredentials(self.settings, self.pool),
            )
            await self.executor.start()
        if "watcher" in self.parts:
            self.watcher = Watcher(self.driver, self._producer, self.settings)
        self.reconciler = Reconciler(
            self.driver,
            self.pool,
            self._producer,
            self.settings,
            interval,
            pickup=self.executor.pick_up if self.executor else None,
            stop_stale=self.executor.stop_stale if self.executor else None,
            stop_stray=self.executor.stop_stray if self.executor else None,
            collect=self.executor.collect if self.executor else None,
            report="watcher" in self.parts,
        )
        if self.executor is not None:
            self._tasks.spawn("executor", self.executor.run(stop))
        if self.watcher is not None:
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


async def serve_driver_side(settings: Settings, stop: asyncio.Event) -> None:
    """Executor + watcher + reconciler with the settings' driver until ``stop`` (or a crash)."""
    pool = await connect_pool(settings)
    driver = driver_from_settings(settings)
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
