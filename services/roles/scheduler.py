"""`sandstream scheduler`: the deadline scheduler and the pool controller, single-active under
the ``scheduler`` lease (services/scheduler/scheduling.py says why)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from services.roles.leased import LeasedRole
from services.scheduler.scheduling import LEASE, Scheduling


@dataclass
class SchedulerRole(LeasedRole):
    name: str = LEASE
    scheduling: Scheduling = field(init=False)

    def __post_init__(self) -> None:
        self.scheduling = Scheduling(self.settings)

    async def work(self, lost: asyncio.Event) -> None:
        await self.scheduling.work(lost)

    def active_detail(self) -> dict[str, Any]:
        scheduler, pools = self.scheduling.scheduler, self.scheduling.pools
        if scheduler is None or pools is None:
            return {}
        return {"rounds": scheduler.rounds, "pool_rounds": pools.rounds}
