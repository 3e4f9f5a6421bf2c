"""A driver that runs some sandboxes on one backend and the rest on another, by name.

Sandboxes whose name starts with ``prefix`` go to ``routed``, every other one to ``default``.
The name is the one thing every call of the protocol carries (a stop or a delete has no
spec), so it is what decides; a sandbox never moves between backends, as its name never
changes.

Each backend answers only for its own names: listings and watch streams are filtered by the
same rule, so a backend shared with others (a Podman service other control planes or tests
use too) shows only this driver's sandboxes, and one backend can never report a runtime as
the other's. The fault-injection checker (services/chaos) runs a few sandboxes on real Podman
this way beside hundreds on the shared fake.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator
from dataclasses import dataclass
from uuid import UUID

from drivers.protocol import (
    Driver,
    HoldingsDriver,
    Incarnation,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
)


@dataclass
class RoutingDriver:
    default: Driver
    routed: Driver
    prefix: str

    def __post_init__(self) -> None:
        if not self.prefix:
            raise ValueError("a routing driver needs a non-empty name prefix")

    def routes(self, key: str) -> bool:
        """True when the sandbox ``key`` runs on the routed backend."""
        return key.startswith(self.prefix)

    def _for(self, key: str) -> Driver:
        return self.routed if self.routes(key) else self.default

    def _owns(self, driver: Driver, key: str) -> bool:
        return self._for(key) is driver

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        return await self._for(spec.key).launch(spec)

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self._for(key).stop(key, generation, timeout)

    async def kill(self, key: str, generation: int) -> OpResult:
        return await self._for(key).kill(key, generation)

    async def delete(self, key: str, sandbox_id: UUID | None = None) -> bool:
        return await self._for(key).delete(key, sandbox_id)

    async def get(self, key: str) -> builtins.list[RuntimeInfo]:
        return await self._for(key).get(key)

    async def list(self) -> builtins.list[RuntimeInfo]:
        default, routed = await asyncio.gather(self.default.list(), self.routed.list())
        mine = [rt for rt in default if not self.routes(rt.key)]
        mine += [rt for rt in routed if self.routes(rt.key)]
        return sorted(mine, key=lambda rt: (rt.key, rt.generation))

    async def incarnations(self) -> builtins.set[Incarnation]:
        """Each backend's incarnations of its own names (HoldingsDriver, where a backend has
        it)."""
        found: builtins.set[Incarnation] = set()
        for driver in (self.default, self.routed):
            if isinstance(driver, HoldingsDriver):
                found |= {i for i in await driver.incarnations() if self._owns(driver, i[0])}
        return found

    async def watch(self) -> AsyncIterator[WatchObservation]:
        """Both backends' streams, interleaved as they come, each filtered to its own names.
        Either stream failing or ending ends this one (the watcher reopens it, and both start
        with a listing again)."""
        queue: asyncio.Queue[WatchObservation | BaseException | None] = asyncio.Queue()
        streams = [(d, d.watch()) for d in (self.default, self.routed)]

        async def pump(driver: Driver, stream: AsyncIterator[WatchObservation]) -> None:
            try:
                async for observation in stream:
                    if self._owns(driver, observation.key):
                        await queue.put(observation)
                await queue.put(None)
            except Exception as exc:
                await queue.put(exc)

        pumps = [asyncio.create_task(pump(d, s)) for d, s in streams]
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for _, stream in streams:  # the drivers' streams are generators: end their watches
                close = getattr(stream, "aclose", None)
                if close is not None:
                    await close()

    async def close(self) -> None:
        await asyncio.gather(self.default.close(), self.routed.close())
