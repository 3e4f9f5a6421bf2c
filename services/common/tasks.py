"""Named long-running tasks of one process sharing a stop event: a crash of one stops them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("sandstream.tasks")

# How long stop() waits for a component's task before cancelling it. The executor's own
# shutdown grace (for driver calls in flight) is shorter, so it drains within this.
STOP_TIMEOUT = 30.0


@dataclass
class Tasks:
    """Named tasks sharing one stop event; a crash of one sets it."""

    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._ended)
        self.tasks.append(task)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s crashed: %r; stopping", task.get_name(), task.exception())
            self.stop_event.set()

    async def finish(self, cancel_first: tuple[str, ...] = ()) -> None:
        """Set the stop event and wait for every task (cancelling ``cancel_first`` ones,
        which wait on something other than the event, and any that overstay)."""
        self.stop_event.set()
        for task in self.tasks:
            if task.get_name() in cancel_first:
                task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=STOP_TIMEOUT)
        failed = [t for t in self.tasks if not t.cancelled() and t.exception() is not None]
        self.tasks.clear()
        for task in failed:
            log.error("%s ended with %r", task.get_name(), task.exception())


async def stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless ``stop`` is set first; returns whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()
