"""Scheduling: the deadline scheduler and the pool controller together, the work of whoever
holds the ``scheduler`` lease (``sandstream scheduler`` and ``sandstream up`` alike). Two
schedulers would only publish every DeadlineDue twice, which the fold ignores; two pool
controllers could both fill the same gap, so the lease is what keeps a pool at its size when
two processes could run it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import asyncpg

from services.common.database import connect_pool
from services.common.settings import Settings
from services.scheduler.pool_controller import PoolController
from services.scheduler.scheduler import Scheduler

LEASE = "scheduler"


@dataclass
class Scheduling:
    """Runs both while the lease is held (``work``); ``scheduler`` and ``pools`` meanwhile."""

    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record] | None = None  # None: one of its own for each term
    scheduler: Scheduler | None = None
    pools: PoolController | None = None

    async def work(self, lost: asyncio.Event) -> None:
        pool = self.pool or await connect_pool(self.settings)
        scheduler = self.scheduler = Scheduler(self.settings, pool)
        controller = self.pools = PoolController(self.settings, pool)
        try:
            await scheduler.start()
            await controller.start()
            await run_both(scheduler, controller, lost)
        finally:
            self.scheduler = self.pools = None
            await controller.stop()
            await scheduler.stop()
            if self.pool is None:
                await pool.close()


async def run_both(scheduler: Scheduler, controller: PoolController, stop: asyncio.Event) -> None:
    """Both until ``stop``; one failing ends the other (the lease loop starts again)."""
    tasks = [asyncio.create_task(scheduler.run(stop)), asyncio.create_task(controller.run(stop))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
