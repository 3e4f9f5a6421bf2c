"""Single-active roles: the work runs only in the instance holding the role's lease
(services/common/lease.py); the others are standbys, ready to take over."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from services.common.health import Readiness
from services.common.lease import Lease
from services.common.settings import Settings


@dataclass
class LeasedRole:
    """A role whose ``work`` runs while this instance holds the lease named like the role."""

    settings: Settings
    name: str = "leased"
    started: bool = False
    lease: Lease | None = None

    async def run(self, stop: asyncio.Event) -> None:
        self.lease = Lease(self.settings, self.name)
        self.started = True
        await self.lease.run(stop, self.work)

    async def work(self, lost: asyncio.Event) -> None:
        """The role's work, until ``lost`` is set (the lease lost, or the process stopping)."""
        raise NotImplementedError

    def active_detail(self) -> dict[str, Any]:
        """What the active instance adds to its readiness."""
        return {}

    async def readiness(self) -> Readiness:
        """Ready when active, or a standby that can reach PostgreSQL to take the lease over."""
        lease = self.lease
        if lease is None:
            return Readiness(False, "starting")
        detail: dict[str, Any] = {"lease": lease.name, "active": lease.held,
                                  "acquisitions": lease.acquisitions}  # fmt: skip
        if lease.held:
            return Readiness(True, "", {**detail, **self.active_detail()})
        if lease.last_error is not None:
            return Readiness(False, f"cannot try the lease: {lease.last_error}", detail)
        return Readiness(True, "", detail)
