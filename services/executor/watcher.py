"""The driver watcher: what the runtime really did, as observations.

It only reports; the processor decides. It forwards the driver's watch stream (a full listing,
then changes; after a reconnect a listing again) to the observations topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer

from drivers.protocol import Driver
from events.publisher import publish_until_sent
from services.common.settings import Settings
from services.common.tasks import stopped_within

log = logging.getLogger("sandstream.watcher")


@dataclass
class Watcher:
    """Forwards the driver's watch stream to the observations topic until ``stop``.

    If the stream ends or fails (it should not: drivers reconnect on their own), a new one is
    opened after a back-off; it starts with a full listing, so nothing is lost.
    """

    driver: Driver
    producer: AIOKafkaProducer
    settings: Settings

    async def run(self, stop: asyncio.Event) -> None:
        delay = 0.2
        while not stop.is_set():
            stream = self.driver.watch()
            try:
                async for observation in stream:
                    if not await publish_until_sent(
                        self.producer, self.settings.topic_observations, observation, stop
                    ):
                        return
                    delay = 0.2
                    if stop.is_set():
                        return
                log.warning("driver watch stream ended; reopening in %.1fs", delay)
            except Exception:
                log.exception("driver watch stream failed; reopening in %.1fs", delay)
            finally:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
            if await stopped_within(stop, delay):
                return
            delay = min(delay * 2, 5.0)
