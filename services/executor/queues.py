"""One queue and one worker per sandbox: its intents run one at a time in log order, an intent
a later one makes pointless is skipped, each reported result is published until sent, and an
event delivered again (after a rebalance) whose result this executor already published is not
run again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition

from events.observations import DriverOperationResult
from events.recent import RecentIds
from services.executor.calls import DriverCalls
from services.executor.intents import Dropped, Intent, supersedes
from services.executor.progress import Ownership, WorkItem

log = logging.getLogger("sandstream.executor")

Publish = Callable[[DriverOperationResult], Awaitable[None]]

# How many published results' ids are kept to recognise an event delivered again. A rebalance
# delivers again what lies above the partition's committed offset, which is below the oldest
# unfinished intent; an id pushed out by newer ones only loses the skip (the call is made again,
# as before this was kept).
REPORTED_KEPT = 10_000


class SandboxQueues:
    """The sandboxes' queues and workers; a worker ends when its queue is empty."""

    def __init__(self, ownership: Ownership, calls: DriverCalls, publish: Publish) -> None:
        self.ownership = ownership
        self.calls = calls
        self.publish = publish
        self.skipped = 0  # intents skipped because a later one in the queue supersedes them
        self.repeated = 0  # events delivered again whose result was already published here
        self.crashed: BaseException | None = None  # a worker's unexpected error
        self._queues: dict[str, deque[WorkItem]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._news: dict[str, asyncio.Event] = {}  # set when a key gets work
        self._active: dict[str, WorkItem] = {}  # the intent each worker runs
        # Result ids of the log's intents whose result this executor published.
        self._reported = RecentIds(REPORTED_KEPT)

    def add(self, item: WorkItem) -> None:
        key = item.intent.key
        self._queues.setdefault(key, deque()).append(item)
        news = self._news.get(key)
        if news is not None:
            news.set()
        if key not in self._workers:
            worker = asyncio.create_task(self._work(key), name=f"executor:{key}")
            worker.add_done_callback(self._worker_ended)
            self._workers[key] = worker

    def pending(self, key: str) -> int:
        """Intents of ``key`` queued or being executed (retries included) here."""
        return len(self._queues.get(key, ())) + (1 if key in self._active else 0)

    def doing(self, intent: Intent) -> bool:
        """Whether ``intent``'s operation is queued or running here: a delete of its
        incarnation, a stop of its generation (a retry of either would be redundant)."""
        key = intent.key
        items = [*self._queues.get(key, ()), *([self._active[key]] if key in self._active else [])]
        return any(
            i.intent.operation == intent.operation
            and i.intent.sandbox_id == intent.sandbox_id
            and (intent.operation == "delete" or i.intent.generation == intent.generation)
            and self.ownership.current(i)
            for i in items
        )

    def wake(self, revoked: set[TopicPartition] | None = None) -> None:
        """Cut short the retry back-off of the running intents (of ``revoked`` partitions;
        None: all): they give up without reporting."""
        for key, news in self._news.items():
            item = self._active.get(key)
            if revoked is None or (item is not None and item.tp in revoked):
                news.set()

    async def cancel(self) -> None:
        """Cancel every worker (after a drain) and wait for them to end."""
        workers = list(self._workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    async def _work(self, key: str) -> None:
        """Run one key's intents strictly in order; ends when its queue is empty."""
        queue = self._queues[key]
        self._news[key] = asyncio.Event()
        current = self.ownership.current
        try:
            while queue:
                item = queue.popleft()
                if not current(item):
                    continue  # left unfinished: redelivered to the partition's owner
                if self._reported_before(item):
                    continue
                later = next(
                    (i for i in queue if current(i) and supersedes(i.intent, item.intent)), None
                )
                if later is not None:
                    log.info("%s of %s generation %d skipped: superseded by a later %s",
                             item.intent.operation, key, item.intent.generation,
                             later.intent.operation)  # fmt: skip
                    self.skipped += 1
                    item.finish()
                    continue
                await self._run(key, item, queue)
        finally:
            if self._workers.get(key) is asyncio.current_task():
                del self._workers[key]
                self._news.pop(key, None)
                if not queue:
                    self._queues.pop(key, None)

    async def _run(self, key: str, item: WorkItem, queue: deque[WorkItem]) -> None:
        if item.progress is not None:
            item.progress.running.add(item.offset)
        self._active[key] = item
        try:
            result = await self.calls.execute(item, queue, self._news[key])
            if isinstance(result, Dropped):
                item.finish()
            elif result is not None:
                # The driver call happened: losing its result would leave the row waiting
                # forever, so it is retried until sent.
                await self.publish(result)
                self._note_reported(item)
                item.finish()
        finally:
            del self._active[key]
            if item.progress is not None:
                item.progress.running.discard(item.offset)
                item.progress.changed.set()

    def _reported_before(self, item: WorkItem) -> bool:
        """An event delivered again after a rebalance while its first delivery ran here: that
        run's result is on the log, so the call is not made twice (on the same decision: a
        second result would only repeat it). Only the log's intents: a row's pick-up is asked
        for again when the row still wants the operation after its result."""
        if item.tp is None or item.intent.result_id not in self._reported:
            return False
        log.info("%s of %s generation %d delivered again: already done and reported here",
                 item.intent.operation, item.intent.key, item.intent.generation)  # fmt: skip
        self.repeated += 1
        item.finish()
        return True

    def _note_reported(self, item: WorkItem) -> None:
        if item.tp is None:
            return
        self._reported.add(item.intent.result_id)

    def _worker_ended(self, worker: asyncio.Task[None]) -> None:
        if not worker.cancelled() and (exc := worker.exception()) is not None:
            log.error("%s failed: %r", worker.get_name(), exc, exc_info=exc)
            self.crashed = self.crashed or exc
