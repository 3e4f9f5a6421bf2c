"""Named long-running tasks of one process sharing a stop event.

A plain task that crashes stops them all (a half-running set would look healthy while doing
nothing). A supervised one (``supervise``) is started again instead, with a bounded back-off,
and reported meanwhile: logged, counted (``sandstream_task_restarts_total``), shown as down
(``sandstream_task_up``) and listed by ``down()`` (which ``/readyz`` shows under ``sandstream up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from events.backoff import Backoff, pause
from services.common import metrics

log = logging.getLogger("sandstream.tasks")

# How long stop() waits for a component's task before cancelling it. The executor's own
# shutdown grace (for driver calls in flight) is shorter, so it drains within this.
STOP_TIMEOUT = 30.0
# Back-off of a supervised task between a crash and its next start; back to the first value
# once a start ran this long.
RESTART_FIRST, RESTART_MAX, RESTART_RESET = 1.0, 30.0, 60.0

Run = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


@dataclass
class Tasks:
    """Named tasks sharing one stop event; a crash of one sets it."""

    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Supervised tasks that are not running now, with the error that ended their last run.
    failures: dict[str, str] = field(default_factory=dict)

    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._ended)
        self.tasks.append(task)

    def supervise(self, name: str, run: Run, *, first_delay: float = RESTART_FIRST) -> None:
        """Run ``run(stop_event)`` until the stop event; start it again after a crash.

        ``run`` builds what it needs afresh each time (a new processor, new clients), runs
        until the event is set, and releases everything before it returns or raises."""
        self.spawn(name, self._supervised(name, run, first_delay))

    async def _supervised(self, name: str, run: Run, first_delay: float) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(first_delay, RESTART_MAX)
        while not self.stop_event.is_set():
            started = loop.time()
            metrics.TASK_UP.labels(name).set(1)
            self.failures.pop(name, None)
            try:
                await run(self.stop_event)
            except Exception as exc:
                if loop.time() - started > RESTART_RESET:
                    backoff.succeeded()
                delay = backoff.next()
                metrics.TASK_UP.labels(name).set(0)
                metrics.TASK_RESTARTS.labels(name).inc()
                self.failures[name] = repr(exc)
                log.error("%s crashed: %r; starting it again in %.1fs", name, exc, delay,
                          exc_info=exc)  # fmt: skip
                if await pause(self.stop_event, delay):
                    return
                continue
            return

    def down(self) -> dict[str, str]:
        """Supervised tasks waiting to be started again, with the error that ended them."""
        return dict(self.failures)

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


async def first_of(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
