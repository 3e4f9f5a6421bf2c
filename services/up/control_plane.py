"""The control plane's own roles in one process: processor, executor, watcher, reconciler,
scheduler (with the pool controller).

``ControlPlane`` is a processor plus a ``DriverSide`` (services/executor/driver_side.py) plus
the deadline scheduler (services/scheduler/):
``sandstream up`` runs it next to the HTTP API; tests run it against isolated topics and
schemas with the fake or the Podman driver.

By default a component that dies takes the whole set down (``stopping`` is set): a
half-running control plane would look healthy while it no longer applies or executes anything.
``supervised=True`` (``sandstream up``) instead starts a crashed part again with a bounded
back-off (the processor; the driver side as a whole) and reports it (``down()``, metrics,
``/readyz``), so that one crash does not take the API down with it.

The processor hands each decided event it commits to the executor beside it as it sends it
(``up_handoff``): the executor starts on it a Kafka hop sooner, and the log's copy, when it
comes, is finished with it instead of run again (services/executor/intake.py, ``hand``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from drivers.protocol import Driver
from services.common import metrics
from services.common.database import connect_pool
from services.common.lease import Lease
from services.common.settings import Settings
from services.common.tasks import Run, Tasks, first_of
from services.executor.driver_side import DriverSide
from services.executor.executor import Executor, RetryPolicy
from services.executor.intake import FIRST_QUEUED_LOGGED
from services.executor.reconcile import Reconciler
from services.processor.consumer import Processor
from services.scheduler.pool_controller import PoolController
from services.scheduler.scheduler import Scheduler
from services.scheduler.scheduling import LEASE, Scheduling

log = logging.getLogger("sandstream.up")


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
    # The deadline scheduler: on in `sandstream up`; tests that publish messages stamped with
    # a fixed past time leave it off (every deadline of theirs would be long due).
    with_scheduler: bool = False
    supervised: bool = False
    processor: Processor | None = None
    driver_side: DriverSide | None = None
    # The deadline scheduler and the pool controller, run while this plane holds the
    # ``scheduler`` lease (another `up` or `sandstream scheduler` on the database then waits).
    scheduling: Scheduling | None = None
    # Set once an executor has been assigned its partitions (a new group's starting position,
    # the end of the events topic, is then fixed): `sandstream up` takes commands after that.
    executor_assigned: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: Tasks = field(default_factory=Tasks)
    handed: Counter[str] = field(default_factory=Counter)  # the hand-over's, by outcome

    @property
    def executor(self) -> Executor | None:
        return self.driver_side.executor if self.driver_side else None

    @property
    def reconciler(self) -> Reconciler | None:
        return self.driver_side.reconciler if self.driver_side else None

    @property
    def scheduler(self) -> Scheduler | None:
        return self.scheduling.scheduler if self.scheduling else None

    @property
    def pools(self) -> PoolController | None:
        return self.scheduling.pools if self.scheduling else None

    async def start(self) -> None:
        if self.supervised:
            self._tasks.supervise("processor", self._run_processor)
            self._tasks.supervise("driver side", self._run_driver_side)
            if self.with_scheduler:
                self._tasks.supervise("scheduler", self._run_scheduling)
            return
        self.processor = self._new_processor()
        await self.processor.start()
        self._tasks.spawn("processor", self.processor.run(self._tasks.stop_event))
        self.driver_side = self._new_driver_side()
        await self.driver_side.start(self._tasks)
        self._note_assignment(self.driver_side)
        if self.with_scheduler:
            self._tasks.spawn("scheduler", self._run_scheduling(self._tasks.stop_event))

    async def _run_scheduling(self, stop: asyncio.Event) -> None:
        """The scheduler and the pool controller while this plane holds the ``scheduler``
        lease, as `sandstream scheduler` does: two pool controllers on one database would
        both fill the same gap (services/scheduler/scheduling.py)."""
        scheduling = self.scheduling = Scheduling(self.settings, self.pool)
        await Lease(self.settings, LEASE).run(stop, scheduling.work)

    async def _run_processor(self, stop: asyncio.Event) -> None:
        processor = self.processor = self._new_processor()
        try:
            await processor.start()
            await processor.run(stop)
        finally:
            await processor.stop()

    async def _run_driver_side(self, stop: asyncio.Event) -> None:
        side = self.driver_side = self._new_driver_side()
        try:
            await side.start()
            self._note_assignment(side)
            await first_of(stop, side.stopping)
            if not stop.is_set():
                raise RuntimeError("a driver-side task (executor, watcher, reconciler) crashed")
        finally:
            await side.stop()

    def _note_assignment(self, side: DriverSide) -> None:
        """The executor's start returns once assigned or after its assign timeout."""
        if side.executor is not None and side.executor.intake.assigned.is_set():
            self.executor_assigned.set()

    def _new_processor(self) -> Processor:
        processor = Processor(self.settings, self.pool)
        if self.settings.up_handoff:
            processor.handoff = self._hand_over
        return processor

    def _hand_over(self, partition: int, value: bytes) -> None:
        """A decided event the processor committed, to this process's executor at once."""
        executor = self.executor
        outcome = "not_owned" if executor is None else executor.intake.hand(partition, value)
        self.handed[outcome] += 1
        metrics.HANDED.labels(outcome).inc()
        if outcome == "queued" and self.handed[outcome] == 1:  # a killed run logs no summary
            log.info(FIRST_QUEUED_LOGGED)

    def _new_driver_side(self) -> DriverSide:
        return DriverSide(
            self.settings,
            self.driver,
            self.pool,
            reconcile_interval=self.reconcile_interval,
            executor_concurrency=self.executor_concurrency,
            retry=self.retry,
        )

    def supervise(self, name: str, run: Run) -> None:
        """Run one more part of the process (``sandstream up``'s provider sync) under the same
        supervision: started again after a crash, reported by ``down()`` meanwhile."""
        self._tasks.supervise(name, run)

    def down(self) -> dict[str, str]:
        """Supervised parts waiting to be started again after a crash, with their error."""
        return self._tasks.down()

    @property
    def stopping(self) -> asyncio.Event:
        return self._tasks.stop_event

    async def wait(self) -> None:
        await self._tasks.stop_event.wait()

    async def stop(self) -> None:
        await self._tasks.finish(cancel_first=("watcher",))
        if self.handed:  # what the hand-over did in this run (the chaos checker reads it)
            log.info(
                "hand-over counts: %s", " ".join(f"{k}={n}" for k, n in sorted(self.handed.items()))
            )
        if self.supervised:  # each part released what it opened
            if self.owns_pool:
                await self.pool.close()
            return
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
