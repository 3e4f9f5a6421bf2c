"""The driver watcher: what the runtime really did, as observations.

It only reports; the processor decides. It forwards the driver's watch stream (a full listing,
then changes; after a reconnect a listing again) to the observations topic. It reads the stream
ahead while a publish is in flight: what arrived meanwhile goes out in one Kafka request (a
burst of Pods' changes costs the broker a request per round trip, not one per observation),
except that two observations of one sandbox never share a request, so each is acknowledged
before the next of its sandbox is sent, as one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

from drivers.protocol import Driver
from events.backoff import Backoff, pause
from events.observations import Observation
from events.publisher import RenewingProducer, publish_all_until_sent
from services.common.settings import Settings

log = logging.getLogger("sandstream.watcher")

READ_AHEAD: Final = 1000  # observations read from the stream and not yet published, at most


class _End:
    """The stream ended (or failed: ``error``) after the observations queued before it."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error


Queued = Observation | _End


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
                if not await self._forward(stream, stop, backoff):
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

    async def _forward(
        self, stream: AsyncIterator[Observation], stop: asyncio.Event, backoff: Backoff
    ) -> bool:
        """Publish what ``stream`` yields until it ends (True; raises its error once what it
        yielded before is published) or ``stop`` (False)."""
        queue: asyncio.Queue[Queued] = asyncio.Queue(READ_AHEAD)
        reader = asyncio.create_task(_read(stream, queue))
        held: Queued | None = None  # taken from the queue, for the next batch
        try:
            while True:
                batch, held = _batch(held if held is not None else await queue.get(), queue)
                if batch:
                    topic = self.settings.topic_observations
                    if not await publish_all_until_sent(self.producer, topic, batch, stop):
                        return False
                    backoff.succeeded()
                    if stop.is_set():
                        return False
                if isinstance(held, _End):
                    if held.error is not None:
                        raise held.error
                    return True
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def _read(stream: AsyncIterator[Observation], queue: asyncio.Queue[Queued]) -> None:
    try:
        async for observation in stream:
            await queue.put(observation)
    except Exception as exc:
        await queue.put(_End(exc))
        return
    await queue.put(_End())


def _batch(first: Queued, queue: asyncio.Queue[Queued]) -> tuple[list[Observation], Queued | None]:
    """``first`` and what else is queued, up to the stream's end or a second observation of
    a sandbox already in the batch; and that item, held for the next round."""
    batch: list[Observation] = []
    keys: set[str] = set()
    item: Queued | None = first
    while item is not None:
        if isinstance(item, _End) or item.key in keys:
            return batch, item
        batch.append(item)
        keys.add(item.key)
        item = None if queue.empty() else queue.get_nowait()
    return batch, None
