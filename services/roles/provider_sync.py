"""`sandstream provider-sync --dir DIR`: the provider-sync controller, single-active under the
``provider-sync`` lease (two would each send the same update when the directory changes, and
every attached sandbox would restart twice)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from services.api.provider_sync import ProviderSync
from services.api.providers import open_service
from services.roles.leased import LeasedRole


@dataclass
class ProviderSyncRole(LeasedRole):
    name: str = "provider-sync"
    directory: Path = Path(".")
    restart: bool = True
    interval: float = 1.0

    async def work(self, lost: asyncio.Event) -> None:
        async with open_service(self.settings) as service:
            sync = ProviderSync(service, self.directory, restart=self.restart,
                                interval=self.interval)  # fmt: skip
            await sync.run(lost)
