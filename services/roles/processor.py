"""`sandstream processor`: one lifecycle processor of the group; N of them share the input
partitions through the consumer group (``processor_group``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.common.database import connect_pool
from services.common.health import Readiness
from services.common.settings import Settings
from services.processor.collector import tune_collector
from services.processor.consumer import Processor


@dataclass
class ProcessorRole:
    settings: Settings
    name: str = "processor"
    started: bool = False
    processor: Processor | None = None

    async def run(self, stop: asyncio.Event) -> None:
        tune_collector()  # this role is a process of its own
        pool = await connect_pool(self.settings)
        processor = self.processor = Processor(
            self.settings, pool, name=self.name, max_records=self.settings.processor_max_records
        )
        try:
            await processor.start()
            self.started = True
            await processor.run(stop)
        finally:
            # Drains the outbox, then leaves the group: the others take the partitions at once.
            await processor.stop()
            await pool.close()

    async def readiness(self) -> Readiness:
        if self.processor is None or not self.started:
            return Readiness(False, "starting")
        why, detail = self.processor.health()
        return Readiness(why is None, why or "", detail)
