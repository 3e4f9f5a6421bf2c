"""`sandstream scheduler`: the deadline scheduler, single-active under the ``scheduler`` lease
(two would only publish every DeadlineDue twice, which the fold ignores: the lease saves
the work, it does not guard correctness)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.common.database import connect_pool
from services.common.health import Readiness
from services.common.lease import Lease
from services.common.settings import Settings
from services.roles.leased import lease_readiness
from services.scheduler.scheduler import Scheduler


@dataclass
class SchedulerRole:
    settings: Settings
    name: str = "scheduler"
    started: bool = False
    lease: Lease | None = None
    scheduler: Scheduler | None = None

    async def run(self, stop: asyncio.Event) -> None:
        self.lease = Lease(self.settings, "scheduler")
        self.started = True
        await self.lease.run(stop, self._work)

    async def _work(self, lost: asyncio.Event) -> None:
        pool = await connect_pool(self.settings)
        scheduler = self.scheduler = Scheduler(self.settings, pool)
        try:
            await scheduler.start()
            await scheduler.run(lost)
        finally:
            self.scheduler = None
            await scheduler.stop()
            await pool.close()

    async def readiness(self) -> Readiness:
        rounds = {"rounds": self.scheduler.rounds} if self.scheduler else {}
        return lease_readiness(self.lease, rounds)
