"""`sandstream provider-sync --dir DIR | --kube-selector SEL`: the provider-sync controller,
single-active under the ``provider-sync`` lease (two would each send the same update when the
source changes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from services.provider_sync.controller import ProviderSync, sync_source
from services.provider_sync.service import open_service
from services.roles.leased import LeasedRole


@dataclass
class ProviderSyncRole(LeasedRole):
    name: str = "provider-sync"
    directory: Path | None = None
    kube_selector: str | None = None
    kube_namespace: str | None = None
    restart: bool = True
    interval: float = 1.0

    async def work(self, lost: asyncio.Event) -> None:
        # A source of its own for each time this instance holds the lease (run closes it).
        source = sync_source(self.settings, self.directory, self.kube_selector, self.kube_namespace)
        if source is None:
            raise ValueError("provider sync: give a directory or a Kubernetes label selector")
        async with open_service(self.settings) as service:
            sync = ProviderSync(service, source, restart=self.restart, interval=self.interval)
            # It relays the provider outbox too (the API processes do as well: docs/adr/0005).
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(sync.run(lost))
                tasks.create_task(service.relay(lost))
