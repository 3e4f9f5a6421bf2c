"""`sandstream scheduler`: the deadline scheduler and the pool controller, single-active under
the ``scheduler`` lease (two schedulers would only publish every DeadlineDue twice, which the
fold ignores; two pool controllers could both fill the same gap, so the lease is what keeps a
pool from growing past its size while a standby waits)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from services.common.database import connect_pool
from services.roles.leased import LeasedRole
from services.scheduler.pool_controller import PoolController
from services.scheduler.scheduler import Scheduler


@dataclass
class SchedulerRole(LeasedRole):
    name: str = "scheduler"
    scheduler: Scheduler | None = None
    pools: PoolController | None = None

    async def work(self, lost: asyncio.Event) -> None:
        pool = await connect_pool(self.settings)
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
            await pool.close()

    def active_detail(self) -> dict[str, Any]:
        if self.scheduler is None or self.pools is None:
            return {}
        return {"rounds": self.scheduler.rounds, "pool_rounds": self.pools.rounds}


async def run_both(scheduler: Scheduler, controller: PoolController, stop: asyncio.Event) -> None:
    """Both until ``stop``; one failing ends the other (the role's lease loop starts again)."""
    tasks = [asyncio.create_task(scheduler.run(stop)), asyncio.create_task(controller.run(stop))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
