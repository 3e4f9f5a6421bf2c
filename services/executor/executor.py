"""The executor: turns decided intents into driver calls and reports what happened.

It consumes the events topic, and for each intent (launch, stop, delete) calls the driver and
appends the result to the observations topic, where the processor decides what it means.

- **Serial per sandbox, concurrent across sandboxes, bounded.** Each key has its own queue and
  worker task, so a 30-second delete of A never delays B. Fast calls (a create's launch) share
  ``max_concurrency`` slots; slow ones (stop, delete, a start's or restart's launch, which may
  wait out a grace period) run in their caller's own lane, ``slow_per_caller`` at once per
  actor, so one caller's stuck sandboxes never hold a slot anyone else needs. Waiting for a
  slot or a lane, or a retry back-off, holds nothing else up.
- **The poll loop never waits for the driver.** It only decodes and enqueues; driver calls run
  in the workers, so a slow call cannot get the consumer evicted from its group.
- **The row is the truth, the intent a hint.** Right before every driver call the sandbox's
  current row is read; an intent the row no longer wants (another incarnation, another
  generation, a phase past it) is dropped (logged at debug, no call, no result). So
  redelivered or replayed intents have no side effects: a stopped runtime is never started
  again, a deleted one never re-created.
- **Offsets.** Per partition the committed offset is the oldest intent not yet finished (its
  result reported, or dropped), so a crash redelivers exactly the unfinished intents and what
  follows them; the row check drops those the rows moved past. A new group starts at the end
  of the topic; the reconcile loop hands it what rows decided earlier still want
  (``pick_up``).
- **Retries.** A failure the driver calls retryable is retried with exponential back-off for
  up to ``RetryPolicy.give_up_after`` seconds; a later intent of the same sandbox ends the
  retries at once (the failure is reported, and the later intent runs). A non-retryable
  failure is reported at once. Every intent that reaches the driver gets exactly one
  reported result.
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
from dataclasses import dataclass, field, replace
from typing import Final
from uuid import UUID

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.partitioner import murmur2
from pydantic import ValidationError

from drivers.protocol import (
    Driver,
    DriverError,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    operation_result,
)
from events.codec import EVENTS, DecodeError, decode
from events.common import Phase
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
from events.topics import record_key
from projections.lifecycle import Sandbox
from projections.store import CONNECTION_ERRORS
from services.common import metrics
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.executor.clock import Clock, utcnow
from services.executor.credentials import CredentialSource
from services.executor.rows import Pool, read_row

log = logging.getLogger("sandstream.executor")

CallResult = LaunchResult | OpResult | bool | DriverError


@dataclass(frozen=True, slots=True)
class Intent:
    """One driver operation for one sandbox: from a decided event, or from a row the reconcile
    loop found still waiting for it (``pickup``)."""

    operation: Operation
    key: str
    sandbox_id: UUID
    generation: int
    result_id: str  # the observation id of its result
    actor: str  # whose command it serves: the lane it runs in when slow
    launch: LaunchSpec | None = None
    previous_generation: int | None = None  # a start's or restart's older generation
    cleanup: bool = False  # a stop after a timed-out launch: wanted while the row is Error
    # A stop of a runtime of an older generation than its row's (the reconcile loop's
    # ``stop_stale``): wanted while the row is at a newer generation and not launching.
    stale: bool = False


def intent_of(event: DecidedEvent) -> Intent | None:
    """The driver operation a decided event asks for, if any."""
    base = Intent(
        "launch", event.key, event.sandbox_id, event.generation, f"result:{event.event_id}",
        event.actor,
    )  # fmt: skip
    match event:
        case SandboxCreated():
            return replace(base, launch=LaunchSpec.from_event(event))
        case SandboxStarting() | AgentRestarted():
            return replace(
                base,
                launch=LaunchSpec.from_event(event),
                previous_generation=event.previous_generation,
            )
        case SandboxStopping():
            return replace(base, operation="stop")
        case SandboxTimedOut():  # a timed-out launch: clean up its runtime if it came up
            return replace(base, operation="stop", cleanup=True)
        case SandboxDeleting() | SandboxDeleteRetried():
            return replace(base, operation="delete")
    return None


def intent_of_row(row: Sandbox, actor: str = "reconciler") -> Intent | None:
    """What a row in a progressing phase still wants done (the reconcile loop's pick-up)."""
    base = Intent(
        "launch", row.key, row.sandbox_id, row.generation,
        f"result:row:{row.sandbox_id}:{row.version}", actor,
    )  # fmt: skip
    match row.phase:
        case Phase.PROVISIONING | Phase.STARTING:
            spec = LaunchSpec(row.key, row.sandbox_id, row.generation, row.identity, row.spec)
            if row.phase is Phase.PROVISIONING:
                return replace(base, launch=spec)
            # A start or restart: generations of one incarnation count up one at a time.
            return replace(base, launch=spec, previous_generation=row.generation - 1)
        case Phase.STOPPING:
            return replace(base, operation="stop")
        case Phase.DELETING:
            return replace(base, operation="delete")
    return None


# What the row must look like for each operation to still be wanted.
WANTED_PHASES: Final[dict[Operation, tuple[Phase, ...]]] = {
    "launch": (Phase.PROVISIONING, Phase.STARTING),
    "stop": (Phase.STOPPING,),
    "delete": (Phase.DELETING,),
}
# The cleanup stop of a timed-out launch (the row went to Error; a runtime that came up late
# moves it to Ready): wanted at that generation until the row moves on.
CLEANUP_PHASES: Final = (Phase.ERROR, Phase.READY, Phase.STOPPING)


def unwanted(intent: Intent, row: Sandbox | None) -> str | None:
    """Why the row no longer wants ``intent`` (None: it does). The row is the truth, the
    intent only a hint: a redelivered or replayed intent the row has moved past is dropped."""
    if row is None:
        return "no row"
    if row.sandbox_id != intent.sandbox_id:
        return f"the name now belongs to incarnation {row.sandbox_id} ({row.phase})"
    if intent.stale:
        if row.generation <= intent.generation:
            return f"the row is at generation {row.generation}"
        if row.phase in WANTED_PHASES["launch"]:
            return f"the row is {row.phase}: its launch removes the older generations"
        return None
    if intent.operation != "delete" and row.generation != intent.generation:
        return f"the row is at generation {row.generation}"
    wanted = CLEANUP_PHASES if intent.cleanup else WANTED_PHASES[intent.operation]
    if row.phase not in wanted:
        return f"the row is {row.phase} (version {row.version})"
    return None


def is_slow(intent: Intent) -> bool:
    """Operations that may wait out a grace period (stop, delete, a launch replacing an older
    generation): they run in their caller's lane, never in the shared slots."""
    return intent.operation != "launch" or intent.previous_generation is not None


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


@dataclass(frozen=True, slots=True)
class Dropped:
    """An intent the row no longer wants: finished without a driver call or a result."""

    reason: str


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
    intent: Intent
    tp: TopicPartition | None = None  # None: picked up from a row, not from the log
    offset: int = -1
    progress: PartitionProgress | None = None

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.finish(self.offset)


@dataclass
class Executor:
    settings: Settings
    driver: Driver
    pool: Pool  # the rows: read before every driver call
    max_concurrency: int | None = None  # default: settings.executor_concurrency
    slow_per_caller: int | None = None  # default: settings.executor_slow_per_caller
    retry: RetryPolicy | None = None  # default: give up after settings.executor_retry_seconds
    commit_interval: float = 0.5
    revoke_grace: float = 5.0
    shutdown_grace: float = 10.0
    assign_timeout: float = 30.0  # start() waits this long for the first assignment
    clock: Clock = utcnow
    # The attached providers' values for a launch (services/executor/credentials.py); None:
    # launches get no provider values (tests of the executor alone).
    credentials: CredentialSource | None = None
    consumer: AIOKafkaConsumer | None = None
    producer: AIOKafkaProducer | None = None
    running: int = 0  # driver calls in progress (in a shared slot or a caller's lane)
    waiting: int = 0  # driver calls waiting for a slot or a lane
    dropped: int = 0  # intents dropped because their row no longer wants them
    skipped: int = 0  # intents skipped because a later one in the queue supersedes them
    _queues: dict[str, deque[_Item]] = field(default_factory=dict)
    _workers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _news: dict[str, asyncio.Event] = field(default_factory=dict)  # set when a key gets work
    _owned: dict[TopicPartition, PartitionProgress] = field(default_factory=dict)
    _active: dict[str, _Item] = field(default_factory=dict)  # the intent each worker runs
    _slots: asyncio.Semaphore | None = None
    _lanes: dict[str, asyncio.Semaphore] = field(default_factory=dict)  # per caller (actor)
    _assigned: asyncio.Event = field(default_factory=asyncio.Event)
    _closing: bool = False
    _drained: bool = False
    _crashed: BaseException | None = None  # a worker's unexpected error: run() raises it
    _kills: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.max_concurrency is None:
            self.max_concurrency = self.settings.executor_concurrency
        if self.slow_per_caller is None:
            self.slow_per_caller = self.settings.executor_slow_per_caller
        if self.retry is None:
            self.retry = RetryPolicy(give_up_after=self.settings.executor_retry_seconds)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and join the group; returns once partitions are assigned (or after
        ``assign_timeout``), so a new group's starting position is fixed before anything
        is decided after it."""
        assert self.max_concurrency is not None
        self._slots = asyncio.Semaphore(self.max_concurrency)
        self.producer = AIOKafkaProducer(
            **kafka_client_args(self.settings, "executor"), enable_idempotence=True, acks="all"
        )
        await self.producer.start()
        self.consumer = AIOKafkaConsumer(
            **kafka_client_args(self.settings, "executor"),
            group_id=self.settings.executor_group,
            enable_auto_commit=False,
            # A new group starts at the end: what was decided before it joined is the reconcile
            # loop's to pick up from the rows (never a replay of the whole log).
            auto_offset_reset="latest",
            session_timeout_ms=self.settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=max(300, self.settings.kafka_session_timeout_ms // 4),
            client_id="executor",
        )
        self.consumer.subscribe([self.settings.topic_events], listener=_Rebalance(self))
        await self.consumer.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._assigned.wait(), self.assign_timeout)

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

    def health(self) -> tuple[str | None, dict[str, object]]:
        """Why this executor is not doing its work now (None: it is), and its partitions."""
        detail: dict[str, object] = {
            "partitions": sorted(tp.partition for tp in self._owned),
            "running": self.running,
            "waiting": self.waiting,
        }
        if self._crashed is not None:
            return f"a worker failed: {self._crashed!r}", detail
        if self._closing:
            return "draining", detail
        if not self._assigned.is_set():
            return "not assigned partitions yet", detail
        return None, detail

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
        self._add(_Item(intent, tp, record.offset, progress))

    def pick_up(self, row: Sandbox) -> bool:
        """Queue what a progressing row still wants (the reconcile loop calls this for rows
        that stayed unchanged in a progressing phase for a whole pass). Nothing is queued
        while the sandbox has intents here (they will act on the row), nor for a sandbox whose
        partition another executor owns."""
        intent = intent_of_row(row)
        if intent is None or self._closing or self.pending(row.key) or not self.owns(row.key):
            return False
        log.info("picking up %s of %s generation %d from its %s row",
                 intent.operation, row.key, row.generation, row.phase)  # fmt: skip
        self._add(_Item(intent))
        return True

    def stop_stale(self, runtime: RuntimeInfo) -> bool:
        """Queue a stop of ``runtime``, of an older generation than its sandbox's row, still
        running (the reconcile loop calls this). No event asks for it: the launch or stop that
        should have stopped it was lost with an executor that died, or never reached this
        group, and a row that moved on never asks for an older generation again. Nothing is
        queued while the sandbox has intents here, nor for another executor's partition."""
        if self._closing or self.pending(runtime.key) or not self.owns(runtime.key):
            return False
        log.info("stopping %s generation %d: older than its row's, still %s",
                 runtime.key, runtime.generation, runtime.state)  # fmt: skip
        intent = Intent("stop", runtime.key, runtime.sandbox_id, runtime.generation,
                        f"result:stale:{runtime.runtime_id}", "reconciler", stale=True)  # fmt: skip
        self._add(_Item(intent))
        return True

    def owns(self, key: str) -> bool:
        """Whether ``key``'s partition of the events topic is assigned here: only its owner
        may act on a sandbox (another executor of the group serves the others)."""
        topic = self.settings.topic_events
        known = self.consumer.partitions_for_topic(topic) if self.consumer else None
        count = len(known) if known else self.settings.kafka_partitions
        partition = (murmur2(record_key(key)) & 0x7FFFFFFF) % count  # the default partitioner
        return TopicPartition(topic, partition) in self._owned

    def _add(self, item: _Item) -> None:
        key = item.intent.key
        self._queues.setdefault(key, deque()).append(item)
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
        if self._closing:
            return False
        if item.tp is None:  # picked up from a row: ours while we own the sandbox's partition
            return self.owns(item.intent.key)
        return self._owned.get(item.tp) is item.progress

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
                    log.info("%s of %s generation %d skipped: superseded by a later %s",
                             item.intent.operation, key, item.intent.generation,
                             later.intent.operation)  # fmt: skip
                    self.skipped += 1
                    item.finish()
                    continue
                if item.progress is not None:
                    item.progress.running.add(item.offset)
                self._active[key] = item
                try:
                    result = await self._execute(item, queue)
                    if isinstance(result, Dropped):
                        self.dropped += 1
                        item.finish()
                    elif result is not None:
                        # The driver call happened: losing its result would leave the row
                        # waiting forever, so it is retried until sent.
                        await publish_until_sent(
                            self.producer, self.settings.topic_observations, result
                        )
                        item.finish()
                finally:
                    del self._active[key]
                    if item.progress is not None:
                        item.progress.running.discard(item.offset)
                        item.progress.changed.set()
        finally:
            if self._workers.get(key) is asyncio.current_task():
                del self._workers[key]
                self._news.pop(key, None)
                if not queue:
                    self._queues.pop(key, None)

    async def _execute(
        self, item: _Item, queue: deque[_Item]
    ) -> DriverOperationResult | Dropped | None:
        """Call the driver, retrying transient failures; None when abandoned unreported
        (shutdown or revoke: the intent stays uncommitted and is redelivered), ``Dropped``
        when the row no longer wants it."""
        assert self.retry is not None
        intent = item.intent
        loop = asyncio.get_running_loop()
        began = loop.time()
        attempt = 0
        while True:
            attempt += 1
            result = await self._call(item)
            if result is None or isinstance(result, Dropped):
                return result
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
            observation_id=intent.result_id,
            occurred_at=self.clock(),
            actor="executor",
            result=result,
        )

    def _lane(self, intent: Intent) -> asyncio.Semaphore:
        """Where the call waits its turn: a shared slot, or its caller's own lane when it may
        wait out a grace period (so slow sandboxes of one caller never hold the others up)."""
        assert self._slots is not None and self.slow_per_caller is not None
        if not is_slow(intent):
            return self._slots
        lane = self._lanes.get(intent.actor)
        if lane is None:
            width = self.settings.executor_slow_callers.get(intent.actor, self.slow_per_caller)
            lane = self._lanes[intent.actor] = asyncio.Semaphore(max(1, width))
        return lane

    async def _call(self, item: _Item) -> CallResult | Dropped | None:
        """One driver call in its slot or lane, if the row still wants it; every failure comes
        back as a DriverError (an unexpected exception is a non-retryable one). None, and no
        call, if the intent stopped being this executor's while it waited for the slot."""
        lane = self._lane(item.intent)
        self.waiting += 1
        try:
            await lane.acquire()
        finally:
            self.waiting -= 1
        try:
            if not self._current(item):
                return None
            why = await self._unwanted(item)
            if not self._current(item):
                return None  # revoked or shutting down meanwhile: left for the next owner
            if why is not None:
                await self._dropped(item.intent, why)
                return Dropped(why)
            self.running += 1
            try:
                return await self._driver_call(item.intent)
            finally:
                self.running -= 1
        finally:
            lane.release()

    async def _driver_call(self, intent: Intent) -> CallResult:
        try:
            match intent.operation:
                case "launch":
                    assert intent.launch is not None
                    # The values are read now, from PostgreSQL: they never travel in the log.
                    values = await self.credentials(intent.key) if self.credentials else None
                    secrets = values.env if values is not None else {}
                    launched = await self.driver.launch(replace(intent.launch, secrets=secrets))
                    if values is None or launched.adopted or not launched.started:
                        return launched  # what an earlier launch's runtime read is unknown
                    return replace(launched, credentials=values.revisions)
                case "stop":
                    return await self.driver.stop(intent.key, intent.generation)
                case "delete":
                    return await self.driver.delete(intent.key, intent.sandbox_id)
            raise AssertionError(intent.operation)
        except DriverError as exc:
            return exc
        except Exception as exc:
            log.exception("%s of %s: unexpected driver error", intent.operation, intent.key)
            return DriverError(f"unexpected driver error: {exc!r}", retryable=False)

    async def _unwanted(self, item: _Item) -> str | None:
        """Read the row (retrying while PostgreSQL is unreachable) and judge the intent."""
        delay = 0.2
        while True:
            try:
                return unwanted(item.intent, await read_row(self.pool, item.intent.key))
            except CONNECTION_ERRORS as exc:
                if not self._current(item):
                    return "no longer this executor's"
                log.warning("cannot read the row of %s (%s); again in %.1fs",
                            item.intent.key, exc, delay)  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _dropped(self, intent: Intent, why: str) -> None:
        log.debug("%s of %s generation %d dropped: %s",
                  intent.operation, intent.key, intent.generation, why)  # fmt: skip
        # A start or restart overtaken by a stop of its own generation may never have run:
        # it still owes the older generations their stop, which would otherwise keep running.
        if intent.operation == "launch" and intent.previous_generation is not None:
            row = await read_row(self.pool, intent.key)
            if (
                row is not None
                and (row.sandbox_id, row.generation) == (intent.sandbox_id, intent.generation)
                and row.phase in (Phase.STOPPING, Phase.STOPPED)
            ):
                await self._stop_older(intent)

    async def _stop_older(self, intent: Intent) -> None:
        """Stop every runtime of the intent's incarnation older than its generation that still
        runs. Not only the previous generation: when a chain of starts and stops queued up,
        the launches between were skipped or dropped, and the one running may be older."""
        try:
            runtimes = await self.driver.get(intent.key)
        except Exception as exc:
            log.warning("listing %s to stop its older generations failed: %r", intent.key, exc)
            return
        for runtime in runtimes:
            if (
                runtime.sandbox_id == intent.sandbox_id
                and runtime.generation < intent.generation
                and runtime.state != "exited"
            ):
                older = replace(intent, operation="stop", generation=runtime.generation)
                result = await self._driver_call(older)
                if isinstance(result, DriverError):
                    log.warning("stopping generation %d of %s failed: %s",
                                runtime.generation, intent.key, result.reason)  # fmt: skip

    # -- offsets and rebalances --------------------------------------------------------------

    async def commit(self, progress: dict[TopicPartition, PartitionProgress] | None = None) -> None:
        assert self.consumer is not None
        # A copy: a rebalance may revoke partitions while the commit is in flight, and the
        # progress it marks is the one whose offsets were sent.
        chosen = dict(self._owned if progress is None else progress)
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
        assert self.consumer is not None
        fresh = []
        for tp in assigned:
            self._owned.setdefault(tp, PartitionProgress())
            if await self.consumer.committed(tp) is None:
                fresh.append(tp)
        if fresh:
            # Fix a new group's position at the end now (not at its first fetch, which may
            # come after more was decided) and commit it, so a restart resumes from there.
            ends = await self.consumer.end_offsets(fresh)
            for tp in fresh:
                self.consumer.seek(tp, ends[tp])
                self._owned[tp].highest_seen = ends[tp] - 1
            try:
                await self.consumer.commit({tp: ends[tp] for tp in fresh})
                for tp in fresh:
                    self._owned[tp].committed = ends[tp]
            except KafkaError as exc:
                log.warning("committing the starting offsets failed (will retry): %s", exc)
        log.info("executor assigned %s", sorted(tp.partition for tp in assigned))
        metrics.ASSIGNED_PARTITIONS.labels("executor").set(len(self._owned))
        self._assigned.set()

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Drop the queued intents of ``revoked``, let running ones finish, commit."""
        gone = {tp: p for tp in revoked if (p := self._owned.pop(tp, None)) is not None}
        metrics.ASSIGNED_PARTITIONS.labels("executor").set(len(self._owned))
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
