"""The executor: turns decided intents into driver calls and reports what happened.

It consumes the events topic, and for each intent (launch, stop, delete) calls the driver and
appends the result to the observations topic, where the processor decides what it means.

- Serial per sandbox, concurrent across sandboxes (bounded): each key has its own queue and
  worker, so a 30-second delete of A never delays B.
- The poll loop only enqueues; driver calls run in worker tasks, so a slow call can never get
  the consumer evicted from its group.
- Offsets are committed per partition up to the oldest intent not yet finished, so a crash
  redelivers unfinished intents; drivers are idempotent, so a redelivered launch of a
  generation that already runs does not start it twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from drivers.protocol import Driver, DriverError, LaunchSpec, operation_result
from events.codec import EVENTS, DecodeError, decode, encode
from events.decided import (
    DecidedEvent,
    SandboxCreated,
    SandboxDeleting,
    SandboxStarting,
    SandboxStopping,
)
from events.observations import DriverOperationResult, Operation
from services import metrics
from services.settings import Settings

log = logging.getLogger("sandstream.executor")

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Intent:
    operation: Operation
    event: DecidedEvent


def intent_of(event: DecidedEvent) -> Intent | None:
    """The driver operation a decided event asks for, if any."""
    match event:
        case SandboxCreated() | SandboxStarting():
            return Intent("launch", event)
        case SandboxStopping():
            return Intent("stop", event)
        case SandboxDeleting():
            return Intent("delete", event)
    return None


@dataclass
class RetryPolicy:
    attempts: int = 3
    first_delay: float = 0.2
    max_delay: float = 5.0

    def delays(self) -> list[float]:
        return [min(self.first_delay * 2**i, self.max_delay) for i in range(self.attempts - 1)]


async def perform(
    driver: Driver, intent: Intent, retry: RetryPolicy, clock: Clock = utcnow
) -> DriverOperationResult:
    """Run one intent against the driver (retrying transient failures) and describe the result."""
    event = intent.event
    delays = iter(retry.delays())
    attempt = 0
    while True:
        attempt += 1
        try:
            result: object
            match intent.operation:
                case "launch":
                    assert isinstance(event, SandboxCreated | SandboxStarting)
                    result = await driver.launch(LaunchSpec.from_event(event))
                case "stop":
                    result = await driver.stop(event.key, event.generation)
                case "delete":
                    result = await driver.delete(event.key, event.sandbox_id)
            break
        except DriverError as exc:
            delay = next(delays, None)
            if not exc.retryable or delay is None:
                result = exc
                break
            log.warning("%s %s failed (attempt %d), retrying: %s", intent.operation,
                        event.key, attempt, exc.reason)  # fmt: skip
            await asyncio.sleep(delay)
    outcome = "failed" if isinstance(result, DriverError) else "ok"
    metrics.DRIVER_CALLS.labels(intent.operation, outcome).inc()
    return operation_result(
        operation=intent.operation,
        key=event.key,
        generation=event.generation,
        observation_id=f"result:{event.event_id}",
        occurred_at=clock(),
        actor="executor",
        result=result,
    )


@dataclass
class PartitionProgress:
    """Offsets of one partition: the committable position is below the oldest unfinished."""

    in_flight: set[int] = field(default_factory=set)
    highest_seen: int = -1

    def committable(self) -> int:
        return min(self.in_flight) if self.in_flight else self.highest_seen + 1


@dataclass
class Executor:
    settings: Settings
    driver: Driver
    max_concurrency: int = 16
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    commit_interval: float = 0.5
    clock: Clock = utcnow
    consumer: AIOKafkaConsumer | None = None
    producer: AIOKafkaProducer | None = None
    _queues: dict[str, asyncio.Queue[tuple[TopicPartition, int, Intent | None]]] = field(
        default_factory=dict
    )
    _workers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _progress: dict[TopicPartition, PartitionProgress] = field(
        default_factory=lambda: defaultdict(PartitionProgress)
    )
    _slots: asyncio.Semaphore | None = None
    on_result: Callable[[DriverOperationResult], Awaitable[None]] | None = None

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.max_concurrency)
        self.producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka_bootstrap, enable_idempotence=True, acks="all"
        )
        await self.producer.start()
        self.consumer = AIOKafkaConsumer(
            self.settings.topic_events,
            bootstrap_servers=self.settings.kafka_bootstrap,
            group_id=self.settings.executor_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=self.settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=max(300, self.settings.kafka_session_timeout_ms // 4),
        )
        await self.consumer.start()

    async def stop(self) -> None:
        for task in self._workers.values():
            task.cancel()
        await asyncio.gather(*self._workers.values(), return_exceptions=True)
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()

    async def run(self, stop: asyncio.Event) -> None:
        assert self.consumer is not None
        loop = asyncio.get_running_loop()
        next_commit = loop.time() + self.commit_interval
        while not stop.is_set():
            batch = await self.consumer.getmany(timeout_ms=100, max_records=1000)
            for tp, records in batch.items():
                for record in records:
                    self._enqueue(tp, record)
            if loop.time() >= next_commit:
                await self.commit()
                next_commit = loop.time() + self.commit_interval
        await self.commit()

    def _enqueue(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        progress = self._progress[tp]
        progress.highest_seen = max(progress.highest_seen, record.offset)
        try:
            event = decode(EVENTS, record.value)
        except (DecodeError, ValidationError) as exc:
            log.error("skipping undecodable event at %s:%d: %s", tp, record.offset, exc)
            return
        intent = intent_of(event)
        if intent is None:
            return
        progress.in_flight.add(record.offset)
        queue = self._queues.get(event.key)
        if queue is None:
            queue = self._queues[event.key] = asyncio.Queue()
            self._workers[event.key] = asyncio.create_task(self._work(event.key, queue))
        queue.put_nowait((tp, record.offset, intent))

    async def _work(
        self, key: str, queue: asyncio.Queue[tuple[TopicPartition, int, Intent | None]]
    ) -> None:
        """One sandbox's intents, strictly in order; exits when its queue runs dry."""
        assert self._slots is not None
        while True:
            tp, offset, intent = await queue.get()
            assert intent is not None
            async with self._slots:
                result = await perform(self.driver, intent, self.retry, self.clock)
            await self._report_until_sent(result)
            self._progress[tp].in_flight.discard(offset)
            if queue.empty():
                del self._queues[key], self._workers[key]
                return

    async def _report_until_sent(self, result: DriverOperationResult) -> None:
        # The driver call happened; losing its result would leave the row waiting forever.
        delay = 0.2
        while True:
            try:
                await self.report(result)
                return
            except KafkaError as exc:
                log.warning("reporting %s failed, retrying: %s", result.observation_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def report(self, result: DriverOperationResult) -> None:
        assert self.producer is not None
        await self.producer.send_and_wait(
            self.settings.topic_observations, value=encode(result), key=result.key.encode()
        )
        if self.on_result is not None:
            await self.on_result(result)

    async def commit(self) -> None:
        assert self.consumer is not None
        assigned = self.consumer.assignment()
        offsets = {tp: p.committable() for tp, p in self._progress.items() if tp in assigned}
        offsets = {tp: o for tp, o in offsets.items() if o > 0}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:
            log.warning("offset commit failed (will retry): %s", exc)

    @property
    def busy_keys(self) -> set[str]:
        return set(self._queues)
