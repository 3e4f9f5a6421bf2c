"""The driver watcher: what the runtime really did, as observations.

It only reports; the processor decides. It forwards the driver's watch stream (a full listing,
then changes; after a reconnect a listing again) to the observations topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from drivers.protocol import Driver
from events.backoff import Backoff, pause
from events.publisher import RenewingProducer, publish_until_sent
from services.common.settings import Settings

log = logging.getLogger("sandstream.watcher")


@dataclass
class Watcher:
    """Forwards the driver's watch stream to the observations topic until ``stop``.

    If the stream ends or fails (it should not: drivers reconnect on their own), a new one is
    opened after a back-off; it starts with a full listing, so nothing is lost.
    """

    driver: Driver
    producer: RenewingProducer
    settings: Settings

    async def run(self, stop: asyncio.Event) -> None:
        backoff = Backoff(0.2, 5.0)
        while not stop.is_set():
            stream = self.driver.watch()
            failure: Exception | None = None
            try:
                async for observation in stream:
                    if not await publish_until_sent(
                        self.producer, self.settings.topic_observations, observation, stop
                    ):
                        return
                    backoff.succeeded()
                    if stop.is_set():
                        return
            except Exception as exc:
                failure = exc
            finally:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
            delay = backoff.next()
            if failure is None:
                log.warning("driver watch stream ended; reopening in %.1fs", delay)
            else:
                log.error("driver watch stream failed; reopening in %.1fs", delay, exc_info=failure)
            if await pause(stop, delay):
                return
