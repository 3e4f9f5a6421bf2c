"""`sandstream scheduler`: the deadline scheduler, single-active under the ``scheduler`` lease
(two would only publish every DeadlineDue twice, which the fold ignores: the lease saves
the work, it does not guard correctness)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from services.common.database import connect_pool
from services.roles.leased import LeasedRole
from services.scheduler.scheduler import Scheduler


@dataclass
class SchedulerRole(LeasedRole):
    name: str = "scheduler"
    scheduler: Scheduler | None = None

    async def work(self, lost: asyncio.Event) -> None:
        pool = await connect_pool(self.settings)
        scheduler = self.scheduler = Scheduler(self.settings, pool)
        try:
            await scheduler.start()
            await scheduler.run(lost)
        finally:
            self.scheduler = None
            await scheduler.stop()
            await pool.close()

    def active_detail(self) -> dict[str, Any]:
        return {"rounds": self.scheduler.rounds} if self.scheduler else {}
