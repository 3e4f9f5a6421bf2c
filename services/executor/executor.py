"""The executor: turns decided intents into driver calls and reports what happened.

It consumes the events topic, and for each intent (launch, stop, delete) calls the driver and
appends the result to the observations topic, where the processor decides what it means.

- **Serial per sandbox, concurrent across sandboxes, bounded.** Each key has its own queue and
  worker task, so a 30-second delete of A never delays B; at most ``max_concurrency`` driver
  calls run at once (a call waiting for a slot holds nothing else up; a retry waiting out its
  back-off holds no slot).
- **The poll loop never waits for the driver.** It only decodes and enqueues; driver calls run
  in the workers, so a slow call cannot get the consumer evicted from its group.
- **Offsets.** Per partition the committed offset is the oldest intent not yet finished (its
  result reported), so a crash redelivers exactly the unfinished intents and what follows them.
  Drivers are idempotent (a launch of a generation that already runs does not start it again,
  stop and delete are safe on absence), so a redelivered intent converges instead of
  duplicating a runtime.
- **Retries.** A failure the driver calls retryable is retried with exponential back-off for
  up to ``RetryPolicy.give_up_after`` seconds; a later intent of the same sandbox ends the
  retries at once (the failure is reported, and the later intent runs). A non-retryable
  failure is reported at once. Every intent gets exactly one reported result.
- **Superseded intents are skipped.** A queued launch or stop followed in the same sandbox's
  queue by a delete of that incarnation, or by a launch of a newer generation, is not run: its
  result would be stale for the processor anyway (this keeps a replayed backlog cheap).
- **Rebalances.** When partitions are revoked, their queued intents are dropped (the new owner
  gets them from the committed offset), running ones get ``revoke_grace`` seconds to finish,
  and the offsets are committed before the partitions go. A call still running after that
  finishes and reports anyway (results are observations: the processor sorts them out).
- **Forced kills jump the queue.** A stop that outlived its grace period plus a margin is
  escalated (SandboxStopEscalated): the kill runs at once, beside the key's queue, since the
  stop it forces may be the call the queue is waiting for. It reports no result of its own:
  the stop under way (or the watcher) reports the runtime's end.
- **A retried delete is not run twice.** SandboxDeleteRetried asks for the delete again; while
  a delete of that incarnation is queued or running here (retrying, or hung in the driver) it
  is redundant and skipped, so it can never cut the running one's retries short.
- **Shutdown.** ``run`` returns after draining: queued intents are left for the next executor,
  running calls get ``shutdown_grace`` seconds to finish and report, and offsets are committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from uuid import UUID

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from drivers.protocol import (
    Driver,
    DriverError,
    LaunchResult,
    LaunchSpec,
    OpResult,
    operation_result,
)
from events.codec import EVENTS, DecodeError, decode
from events.decided import (
    AgentRestarted,
    DecidedEvent,
    SandboxCreated,
    SandboxDeleteRetried,
    SandboxDeleting,
    SandboxStarting,
    SandboxStopEscalated,
    SandboxStopping,
    SandboxTimedOut,
)
from events.observations import DriverOperationResult, Operation
from events.publisher import publish_until_sent
from services.common import metrics
from services.common.settings import Settings
from services.executor.clock import Clock, utcnow
from services.executor.credentials import CredentialSource

log = logging.getLogger("sandstream.executor")

CallResult = LaunchResult | OpResult | bool | DriverError


@dataclass(frozen=True, slots=True)
class Intent:
    operation: Operation
    event: DecidedEvent

    @property
    def key(self) -> str:
        return self.event.key

    @property
    def sandbox_id(self) -> UUID:
        return self.event.sandbox_id

    @property
    def generation(self) -> int:
        return self.event.generation


def intent_of(event: DecidedEvent) -> Intent | None:
    """The driver operation a decided event asks for, if any."""
    match event:
        case SandboxCreated() | SandboxStarting() | AgentRestarted():
            return Intent("launch", event)
        case SandboxStopping() | SandboxTimedOut():  # a timed-out launch: clean up its runtime
            return Intent("stop", event)
        case SandboxDeleting() | SandboxDeleteRetried():
            return Intent("delete", event)
    return None


def supersedes(later: Intent, earlier: Intent) -> bool:
    """Whether ``later`` (of the same key, later in its partition) makes ``earlier`` pointless.

    A delete removes every runtime of its incarnation, and a launch removes every older
    generation's runtime (stopping it first): a launch or stop before them in the same
    incarnation would only produce a result the processor ignores as stale.
    """
    if later.key != earlier.key or later.sandbox_id != earlier.sandbox_id:
        return False
    if earlier.operation not in ("launch", "stop"):
        return False
    if later.operation == "delete":
        return True
    return later.operation == "launch" and later.generation > earlier.generation


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off for retryable driver failures.

    Attempts continue while the next one would start within ``give_up_after`` seconds of the
    first (0: never retry).
    """

    first_delay: float = 0.5
    max_delay: float = 10.0
    give_up_after: float = 600.0

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number ``attempt`` (1-based)."""
        return float(min(self.first_delay * 2 ** (attempt - 1), self.max_delay))

    def next_delay(self, attempt: int, elapsed: float) -> float | None:
        """The pause before another attempt, or None when it is time to give up."""
        delay = self.delay(attempt)
        return delay if elapsed + delay <= self.give_up_after else None


@dataclass(eq=False)
class PartitionProgress:
    """One assigned partition: the committable offset is the oldest unfinished intent."""

    pending: set[int] = field(default_factory=set)  # enqueued intents not finished yet
    running: set[int] = field(default_factory=set)  # those a worker is executing
    highest_seen: int = -1
    committed: int = -1
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def committable(self) -> int:
        return min(self.pending) if self.pending else self.highest_seen + 1

    def finish(self, offset: int) -> None:
        self.pending.discard(offset)
        self.changed.set()


@dataclass(eq=False)
class _Item:
    tp: TopicPartition
    offset: int
    intent: Intent
    progress: PartitionProgress


@dataclass
class Executor:
    settings: Settings
    driver: Driver
    max_concurrency: int | None = None  # default: settings.executor_concurrency
    retry: RetryPolicy | None = None  # default: give up after settings.executor_retry_seconds
    commit_interval: float = 0.5
    revoke_grace: float = 5.0
    shutdown_grace: float = 10.0
    clock: Clock = utcnow
    # The attached providers' values for a launch (services/executor/credentials.py); None:
    # launches get no provider values (tests of the executor alone).
    credentials: CredentialSource | None = None
    consumer: AIOKafkaConsumer | None = None
    producer: AIOKafkaProducer | None = None
    running: int = 0  # driver calls in progress (each holds a concurrency slot)
    waiting: int = 0  # driver calls waiting for a slot
    _queues: dict[str, deque[_Item]] = field(default_factory=dict)
    _workers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _news: dict[str, asyncio.Event] = field(default_factory=dict)  # set when a key gets work
    _owned: dict[TopicPartition, PartitionProgress] = field(default_factory=dict)
    _active: dict[str, _Item] = field(default_factory=dict)  # the intent each worker runs
    _slots: asyncio.Semaphore | None = None
    _closing: bool = False
    _drained: bool = False
    _crashed: BaseException | None = None  # a worker's unexpected error: run() raises it
    _kills: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.max_concurrency is None:
            self.max_concurrency = self.settings.executor_concurrency
        if self.retry is None:
            self.retry = RetryPolicy(give_up_after=self.settings.executor_retry_seconds)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        assert self.max_concurrency is not None
        self._slots = asyncio.Semaphore(self.max_concurrency)
        self.producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka_bootstrap, enable_idempotence=True, acks="all"
        )
        await self.producer.start()
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            group_id=self.settings.executor_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=self.settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=max(300, self.settings.kafka_session_timeout_ms // 4),
            client_id="executor",
        )
        self.consumer.subscribe([self.settings.topic_events], listener=_Rebalance(self))
        await self.consumer.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Poll and dispatch until ``stop``, then drain (see the module docstring)."""
        assert self.consumer is not None
        loop = asyncio.get_running_loop()
        next_commit = loop.time() + self.commit_interval
        try:
            while not stop.is_set():
                if self._crashed is not None:
                    # Its intent stays uncommitted (the partition could not move on): stop
                    # loudly, a restart redelivers it.
                    raise RuntimeError("an executor worker failed") from self._crashed
                batch = await self.consumer.getmany(timeout_ms=100, max_records=1000)
                for tp, records in batch.items():
                    for record in records:
                        self._enqueue(tp, record)
                if loop.time() >= next_commit:
                    await self.commit()
                    next_commit = loop.time() + self.commit_interval
        finally:
            await self.drain()

    async def drain(self, grace: float | None = None) -> None:
        """Stop taking work, give running calls ``grace`` seconds to report, commit."""
        if self._drained:
            return
        self._drained = self._closing = True
        for news in self._news.values():
            news.set()  # wake retry back-offs: they give up without reporting
        grace = self.shutdown_grace if grace is None else grace
        progress = list(self._owned.values())
        if not await _until_idle(progress, grace):
            log.warning("shutdown: %d driver calls still running after %.1fs", self.running, grace)
        with contextlib.suppress(Exception):
            await self.commit()

    async def stop(self) -> None:
        """Release everything; call after ``run`` returned (or instead of it)."""
        if not self._drained and self.consumer is not None:
            await self.drain(grace=0)
        for task in [*self._workers.values(), *self._kills]:
            task.cancel()
        await asyncio.gather(*self._workers.values(), *self._kills, return_exceptions=True)
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()

    # -- introspection (tests, health) -------------------------------------------------------

    def pending(self, key: str) -> int:
        """Intents of ``key`` queued or being executed (retries included) here."""
        return len(self._queues.get(key, ())) + (1 if key in self._active else 0)

    # -- intake ------------------------------------------------------------------------------

    def _enqueue(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        progress = self._owned.get(tp)
        if progress is None or self._closing:
            return  # not (or no longer) ours: whoever owns the partition gets it
        progress.highest_seen = max(progress.highest_seen, record.offset)
        try:
            event = decode(EVENTS, record.value)
        except (DecodeError, ValidationError) as exc:
            log.error("skipping undecodable event at %s:%d: %s", tp, record.offset, exc)
            return
        if isinstance(event, SandboxStopEscalated):
            progress.pending.add(record.offset)
            kill = asyncio.create_task(self._kill(event, record.offset, progress))
            self._kills.add(kill)
            kill.add_done_callback(self._kills.discard)
            return
        intent = intent_of(event)
        if intent is None:
            return
        if isinstance(event, SandboxDeleteRetried) and self._deleting(event.key, event.sandbox_id):
            log.info("delete retry %d of %s skipped: its delete is still queued or running",
                     event.deadline.attempt, event.key)  # fmt: skip
            return
        progress.pending.add(record.offset)
        key = intent.key
        self._queues.setdefault(key, deque()).append(_Item(tp, record.offset, intent, progress))
        news = self._news.get(key)
        if news is not None:
            news.set()
        if key not in self._workers:
            worker = asyncio.create_task(self._work(key), name=f"executor:{key}")
            worker.add_done_callback(self._worker_ended)
            self._workers[key] = worker

    def _deleting(self, key: str, sandbox_id: UUID) -> bool:
        """Whether a delete of this incarnation is queued or running here."""
        items = [*self._queues.get(key, ()), *([self._active[key]] if key in self._active else [])]
        return any(
            i.intent.operation == "delete"
            and i.intent.sandbox_id == sandbox_id
            and self._current(i)
            for i in items
        )

    def _worker_ended(self, worker: asyncio.Task[None]) -> None:
        if not worker.cancelled() and (exc := worker.exception()) is not None:
            log.error("%s failed: %r", worker.get_name(), exc, exc_info=exc)
            self._crashed = self._crashed or exc

    def _current(self, item: _Item) -> bool:
        """Whether ``item`` is still this executor's to run (not revoked, not shutting down)."""
        return not self._closing and self._owned.get(item.tp) is item.progress

    async def _kill(self, event: DecidedEvent, offset: int, progress: PartitionProgress) -> None:
        """Kill the runtime of the event's generation now, outside the key's queue."""
        progress.running.add(offset)
        try:
            result = await self.driver.kill(event.key, event.generation)
            metrics.DRIVER_CALLS.labels("kill", "ok").inc()
            log.warning("killed %s generation %d: its stop outlived the grace period (%s)",
                        event.key, event.generation, result.outcome)  # fmt: skip
        except Exception as exc:
            metrics.DRIVER_CALLS.labels("kill", "failed").inc()
            log.error("kill of %s generation %d failed: %r", event.key, event.generation, exc)
        finally:
            progress.running.discard(offset)
            progress.finish(offset)

    # -- one sandbox's worker ----------------------------------------------------------------

    async def _work(self, key: str) -> None:
        """Run one key's intents strictly in order; ends when its queue is empty."""
        queue = self._queues[key]
        self._news[key] = asyncio.Event()
        try:
            while queue:
                item = queue.popleft()
                if not self._current(item):
                    continue  # left unfinished: redelivered to the partition's owner
                later = next(
                    (i for i in queue if self._current(i) and supersedes(i.intent, item.intent)),
                    None,
                )
                if later is not None:
                    log.info("%s of %s generation %d skipped: superseded by %s at offset %d",
                             item.intent.operation, key, item.intent.generation,
                             later.intent.operation, later.offset)  # fmt: skip
                    item.progress.finish(item.offset)
                    continue
                item.progress.running.add(item.offset)
                self._active[key] = item
                try:
                    result = await self._execute(item, queue)
                    if result is not None:
                        # The driver call happened: losing its result would leave the row
                        # waiting forever, so it is retried until sent.
                        await publish_until_sent(
                            self.producer, self.settings.topic_observations, result
                        )
                        item.progress.finish(item.offset)
                finally:
                    del self._active[key]
                    item.progress.running.discard(item.offset)
                    item.progress.changed.set()
        finally:
            if self._workers.get(key) is asyncio.current_task():
                del self._workers[key]
                self._news.pop(key, None)
                if not queue:
                    self._queues.pop(key, None)

    async def _execute(self, item: _Item, queue: deque[_Item]) -> DriverOperationResult | None:
        """Call the driver, retrying transient failures; None when abandoned unreported
        (shutdown or revoke: the intent stays uncommitted and is redelivered)."""
        assert self.retry is not None
        intent = item.intent
        loop = asyncio.get_running_loop()
        began = loop.time()
        attempt = 0
        while True:
            attempt += 1
            result = await self._call(item)
            if result is None:
                return None  # revoked or shutting down while it waited for a slot
            if not isinstance(result, DriverError) or not result.retryable:
                break
            if not self._current(item):
                return None
            if any(self._current(i) for i in queue):
                result.reason += "; not retried: a later intent of the sandbox is queued"
                break
            delay = self.retry.next_delay(attempt, loop.time() - began)
            if delay is None:
                result.reason += f"; gave up after {attempt} attempts"
                break
            log.warning("%s of %s failed (attempt %d), retrying in %.1fs: %s",
                        intent.operation, intent.key, attempt, delay, result.reason)  # fmt: skip
            news = self._news[intent.key]
            news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), delay)  # a later intent cuts it short
            if not self._current(item):
                return None
            if any(self._current(i) for i in queue):
                result.reason += "; not retried: a later intent of the sandbox is queued"
                break
        outcome = "failed" if isinstance(result, DriverError) else "ok"
        metrics.DRIVER_CALLS.labels(intent.operation, outcome).inc()
        return operation_result(
            operation=intent.operation,
            key=intent.key,
            generation=intent.generation,
            observation_id=f"result:{intent.event.event_id}",
            occurred_at=self.clock(),
            actor="executor",
            result=result,
        )

    async def _call(self, item: _Item) -> CallResult | None:
        """One driver call inside a concurrency slot; every failure comes back as a
        DriverError (an unexpected exception is a non-retryable one). None, and no call,
        if the intent stopped being this executor's while it waited for the slot."""
        assert self._slots is not None
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        if not self._current(item):
            self._slots.release()
            return None
        intent = item.intent
        self.running += 1
        try:
            event = intent.event
            match intent.operation:
                case "launch":
                    assert isinstance(event, SandboxCreated | SandboxStarting | AgentRestarted)
                    secrets = await self.credentials(event.key) if self.credentials else {}
                    return await self.driver.launch(LaunchSpec.from_event(event, secrets))
                case "stop":
                    return await self.driver.stop(event.key, event.generation)
                case "delete":
                    return await self.driver.delete(event.key, event.sandbox_id)
            raise AssertionError(intent.operation)
        except DriverError as exc:
            return exc
        except Exception as exc:
            log.exception("%s of %s: unexpected driver error", intent.operation, intent.key)
            return DriverError(f"unexpected driver error: {exc!r}", retryable=False)
        finally:
            self.running -= 1
            self._slots.release()

    # -- offsets and rebalances --------------------------------------------------------------

    async def commit(self, progress: dict[TopicPartition, PartitionProgress] | None = None) -> None:
        assert self.consumer is not None
        chosen = self._owned if progress is None else progress
        offsets = {tp: p.committable() for tp, p in chosen.items()}
        offsets = {tp: o for tp, o in offsets.items() if o > max(0, chosen[tp].committed)}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:
            log.warning("offset commit failed (will retry): %s", exc)
            return
        for tp, offset in offsets.items():
            chosen[tp].committed = offset

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            self._owned.setdefault(tp, PartitionProgress())
        log.info("executor assigned %s", sorted(tp.partition for tp in assigned))

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Drop the queued intents of ``revoked``, let running ones finish, commit."""
        gone = {tp: p for tp in revoked if (p := self._owned.pop(tp, None)) is not None}
        if not gone:
            return
        for key, item in self._active.items():
            if item.tp in gone and (news := self._news.get(key)) is not None:
                news.set()  # the retry back-off of a revoked intent gives up (unreported)
        if not await _until_idle(list(gone.values()), self.revoke_grace):
            log.warning("revoke: driver calls of %s still running; their results will follow",
                        sorted(tp.partition for tp in gone))  # fmt: skip
        await self.commit(gone)


async def _until_idle(progress: list[PartitionProgress], timeout: float) -> bool:
    """Wait until no intent of ``progress`` is running; False if ``timeout`` passed first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(p.running for p in progress):
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        for p in progress:
            p.changed.clear()
        waits = [asyncio.ensure_future(p.changed.wait()) for p in progress if p.running]
        try:
            await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    return True


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.executor.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.executor.on_assigned(assigned)
