"""`sandstream executor` and `sandstream watcher`: the two halves of the driver side as
processes of their own.

- executor: scalable; N executors share the events topic's partitions through their consumer
  group (``executor_group``) and each acts only on the sandboxes of its partitions (it also
  picks up the stuck rows of those partitions: ``Executor.pick_up``).
- watcher: the driver watcher and the reconcile loop's reports; single-active under the
  ``watcher`` lease (services/common/lease.py): standbys wait, one reports.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from services.common.database import connect_pool
from services.common.health import Readiness
from services.common.settings import Settings
from services.common.tasks import first_of
from services.executor.backends import driver_from_settings
from services.executor.driver_side import DriverSide, Part
from services.roles.leased import LeasedRole


@dataclass
class DriverRole:
    """One driver side with the given parts until ``stop`` (or a crash of one of them)."""

    settings: Settings
    parts: frozenset[Part]
    name: str = "executor"
    started: bool = False
    side: DriverSide | None = None

    async def run(self, stop: asyncio.Event) -> None:
        driver = driver_from_settings(self.settings)
        pool = await connect_pool(self.settings)
        side = self.side = DriverSide(self.settings, driver, pool, parts=self.parts)
        try:
            await side.start()
            self.started = True
            await first_of(stop, side.stopping)
            if not stop.is_set():
                raise RuntimeError(f"a task of the {self.name} crashed (see the log)")
        finally:
            # The executor drains: running calls get their grace, offsets are committed,
            # then its consumer leaves the group.
            await side.stop()
            await driver.close()
            await pool.close()

    async def readiness(self) -> Readiness:
        side = self.side
        if side is None or not self.started or side.executor is None:
            return Readiness(False, "starting")
        why, detail = side.executor.health()
        return Readiness(why is None, why or "", detail)


def executor_role(settings: Settings) -> DriverRole:
    return DriverRole(settings, frozenset({"executor"}), name="executor")


@dataclass
class WatcherRole(LeasedRole):
    """The watcher and reconciler while this instance holds the ``watcher`` lease."""

    name: str = "watcher"
    active: DriverRole | None = None

    async def run(self, stop: asyncio.Event) -> None:
        if self.settings.driver == "fake" and self.settings.fake_state_file is None:
            raise ValueError(
                "the fake driver keeps its runtimes in the executor process's memory: a "
                "watcher process cannot see them (and its reconcile loop would report every "
                "runtime missing). Run no watcher with SANDSTREAM_DRIVER=fake unless "
                "SANDSTREAM_FAKE_STATE_FILE shares them"
            )
        await super().run(stop)

    async def work(self, lost: asyncio.Event) -> None:
        self.active = DriverRole(self.settings, frozenset({"watcher"}), name="watcher")
        try:
            await self.active.run(lost)
        finally:
            self.active = None

    def active_detail(self) -> dict[str, Any]:
        side = self.active.side if self.active else None
        reconciler = side.reconciler if side else None
        return {"reconcile_passes": reconciler.passes} if reconciler else {}
