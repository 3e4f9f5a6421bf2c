"""The executor: turns decided intents into driver calls and reports what happened.

It consumes the events topic, and for each intent (launch, stop, delete) calls the driver and
appends the result to the observations topic, where the processor decides what it means. This
module assembles it; its parts: ``intake`` (the consumer, offsets, rebalances), ``queues`` (a
queue and a worker per sandbox), ``calls`` (one driver call, its row check and retries),
``intents`` (what each event asks, pure), ``progress`` (which work is this executor's).

- **Serial per sandbox, concurrent across sandboxes, bounded.** Each key has its own queue and
  worker task, so a 30-second delete of A never delays B. Fast calls (a create's launch) share
  ``max_concurrency`` slots; slow ones (stop, delete, a start's or restart's launch, which may
  wait out a grace period) never do: deletes and an operator's starts and restarts run in
  their caller's own lane, ``slow_per_caller`` at once per actor, so one caller's stuck
  sandboxes never hold a slot anyone else needs; stops and rotation or detach restarts, whose
  deadlines leave no room for a wait, take no lane (``intents.takes_lane``). Waiting for a
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
  follows them; the row check drops those the rows moved past. A new group starts where the
  decided work begins: per partition at the decision of its oldest row still waiting for a
  driver call (less a clock margin), else at the end (``Intake.starts``); the reconcile loop
  hands it what the log no longer shows (``pick_up``).
- **Handed over in `sandstream up`.** The processor beside it hands each event it commits
  (``Intake.hand``): queued at once, a Kafka hop sooner; the log's copy is finished with it
  (its offset committed once the item ends), never run again.
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
- **A retried delete or stop is not run twice.** SandboxDeleteRetried asks for the delete
  again, SandboxStopRetried for a failed stop; while a delete of that incarnation (a stop of
  that generation) is queued or running here (retrying, or hung in the driver) it is
  redundant and skipped, so it can never cut the running one's retries short.
- **Shutdown.** ``run`` returns after draining: queued intents are left for the next executor,
  running calls get ``shutdown_grace`` seconds to finish and report, and offsets are committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from uuid import UUID

from aiokafka import AIOKafkaConsumer

from drivers.protocol import Driver, RuntimeInfo
from events.observations import DriverOperationResult
from events.publisher import RenewingProducer, publish_until_sent
from projections.lifecycle import Sandbox
from services.common.kafka_clients import kafka_client_args
from services.common.providers import LaunchValues
from services.common.settings import Settings
from services.executor.calls import DriverCalls, RetryPolicy
from services.executor.clock import Clock, utcnow
from services.executor.credentials import CredentialSource
from services.executor.intake import Intake
from services.executor.intents import Intent, intent_of_row
from services.executor.progress import Ownership, WorkItem, until_idle
from services.executor.queues import SandboxQueues
from services.executor.rows import Pool

__all__ = ["Executor", "RetryPolicy"]

log = logging.getLogger("sandstream.executor")


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
    producer: RenewingProducer | None = None
    ownership: Ownership = field(init=False)
    calls: DriverCalls = field(init=False)
    queues: SandboxQueues = field(init=False)
    intake: Intake = field(init=False)
    _drained: bool = False

    def __post_init__(self) -> None:
        self.ownership = Ownership(self.settings)
        self.calls = DriverCalls(
            self.settings,
            self.driver,
            self.pool,
            self.ownership,
            retry=self.retry or RetryPolicy(give_up_after=self.settings.executor_retry_seconds),
            max_concurrency=self.max_concurrency or self.settings.executor_concurrency,
            slow_per_caller=self.slow_per_caller or self.settings.executor_slow_per_caller,
            clock=self.clock,
            values=self._values,
        )
        self.queues = SandboxQueues(self.ownership, self.calls, self._publish)
        self.intake = Intake(
            self.settings,
            self.ownership,
            self.queues,
            self.calls,
            revoke_grace=self.revoke_grace,
            pool=self.pool,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and join the group; returns once partitions are assigned (or after
        ``assign_timeout``), so a new group's starting position is fixed before anything
        is decided after it."""
        self.producer = RenewingProducer(kafka_client_args(self.settings, "executor"))
        await self.producer.start()
        await self.intake.start(self.assign_timeout)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll and dispatch until ``stop``, then drain (see the module docstring)."""
        loop = asyncio.get_running_loop()
        next_commit = loop.time() + self.commit_interval
        try:
            while not stop.is_set():
                if self.queues.crashed is not None:
                    # Its intent stays uncommitted (the partition could not move on): stop
                    # loudly, a restart redelivers it.
                    raise RuntimeError("an executor worker failed") from self.queues.crashed
                await self.intake.poll()
                if loop.time() >= next_commit:
                    await self.commit()
                    next_commit = loop.time() + self.commit_interval
        finally:
            await self.drain()

    async def drain(self, grace: float | None = None) -> None:
        """Stop taking work, give running calls ``grace`` seconds to report, commit."""
        if self._drained:
            return
        self._drained = self.ownership.closing = True
        self.queues.wake()  # retry back-offs give up without reporting
        grace = self.shutdown_grace if grace is None else grace
        progress = list(self.ownership.owned.values())
        if not await until_idle(progress, grace):
            log.warning("shutdown: %d driver calls still running after %.1fs", self.running, grace)
        with contextlib.suppress(Exception):
            await self.commit()

    async def stop(self) -> None:
        """Release everything; call after ``run`` returned (or instead of it)."""
        if not self._drained and self.intake.consumer is not None:
            await self.drain(grace=0)
        await self.queues.cancel()
        await self.intake.stop()
        if self.producer is not None:
            await self.producer.stop()

    async def commit(self) -> None:
        """Commit each owned partition's committable offset (the intake's)."""
        await self.intake.commit()

    async def _values(self, key: str, row: Sandbox | None) -> LaunchValues | None:
        """The values a launch of ``key`` hands over: read from ``credentials`` when it runs
        (so a source swapped in after the start is the one used). ``row``, the row the launch
        was just checked against, attaching no provider: none, without asking (what the
        source would answer, a PostgreSQL round trip later)."""
        if self.credentials is None:
            return None
        if row is not None and not row.providers:
            return LaunchValues()
        return await self.credentials(key)

    async def _publish(self, result: DriverOperationResult) -> None:
        assert self.producer is not None  # started
        await publish_until_sent(self.producer, self.settings.topic_observations, result)

    # -- introspection (tests, health) -------------------------------------------------------

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        return self.intake.consumer

    @property
    def running(self) -> int:
        """Driver calls in progress (in a shared slot or a caller's lane)."""
        return self.calls.running

    @property
    def waiting(self) -> int:
        """Driver calls waiting for a slot or a lane."""
        return self.calls.waiting

    @property
    def dropped(self) -> int:
        """Intents dropped because their row no longer wants them."""
        return self.calls.dropped

    @property
    def skipped(self) -> int:
        """Intents skipped because a later one in the queue supersedes them."""
        return self.queues.skipped

    def health(self) -> tuple[str | None, dict[str, object]]:
        """Why this executor is not doing its work now (None: it is), and its partitions."""
        detail: dict[str, object] = {
            "partitions": sorted(tp.partition for tp in self.ownership.owned),
            "running": self.running,
            "waiting": self.waiting,
        }
        if self.queues.crashed is not None:
            return f"a worker failed: {self.queues.crashed!r}", detail
        if self.ownership.closing:
            return "draining", detail
        if not self.intake.assigned.is_set():
            return "not assigned partitions yet", detail
        return None, detail

    def pending(self, key: str) -> int:
        """Intents of ``key`` queued or being executed (retries included) here."""
        return self.queues.pending(key)

    def owns(self, key: str) -> bool:
        """Whether ``key``'s partition of the events topic is assigned here."""
        return self.ownership.owns(key)

    # -- what the reconcile loop hands over --------------------------------------------------

    def pick_up(self, row: Sandbox) -> bool:
        """Queue what a progressing row still wants (the reconcile loop calls this for rows
        that stayed unchanged in a progressing phase for a whole pass). Nothing is queued
        while the sandbox has intents here (they will act on the row), nor for a sandbox whose
        partition another executor owns."""
        intent = intent_of_row(row)
        if intent is None or not self._may_queue(row.key):
            return False
        log.info("picking up %s of %s generation %d from its %s row",
                 intent.operation, row.key, row.generation, row.phase)  # fmt: skip
        self.queues.add(WorkItem(intent))
        return True

    def stop_stale(self, runtime: RuntimeInfo) -> bool:
        """Queue a stop of ``runtime``, of an older generation than its sandbox's row, still
        running (the reconcile loop calls this). No event asks for it: the launch or stop that
        should have stopped it was lost with an executor that died, or never reached this
        group, and a row that moved on never asks for an older generation again. Nothing is
        queued while the sandbox has intents here, nor for another executor's partition."""
        if not self._may_queue(runtime.key):
            return False
        log.info("stopping %s generation %d: older than its row's, still %s",
                 runtime.key, runtime.generation, runtime.state)  # fmt: skip
        intent = Intent("stop", runtime.key, runtime.sandbox_id, runtime.generation,
                        f"result:stale:{runtime.runtime_id}", "reconciler", stale=True)  # fmt: skip
        self.queues.add(WorkItem(intent))
        return True

    def stop_stray(self, runtime: RuntimeInfo) -> bool:
        """Queue a stop of ``runtime``, of its row's own generation, running while the row is
        Stopped (the reconcile loop calls this): started behind sandstream's back, or its stop
        was lost; no event will ask for it. Nothing is queued while the sandbox has intents
        here, nor for another executor's partition."""
        if not self._may_queue(runtime.key):
            return False
        log.warning("stopping %s generation %d: it runs, but its row is Stopped",
                    runtime.key, runtime.generation)  # fmt: skip
        intent = Intent("stop", runtime.key, runtime.sandbox_id, runtime.generation,
                        f"result:stray:{runtime.runtime_id}", "reconciler", stray=True)  # fmt: skip
        self.queues.add(WorkItem(intent))
        return True

    def remove_suspended(self, runtime: RuntimeInfo) -> bool:
        """Queue a suspend of ``runtime``, left under its Suspended row (the reconcile loop
        calls this): the suspend removes it and keeps the workspace. Nothing is queued while
        the sandbox has intents here, nor for another executor's partition."""
        if not self._may_queue(runtime.key):
            return False
        log.warning("removing %s generation %d: its row is Suspended",
                    runtime.key, runtime.generation)  # fmt: skip
        result_id = f"result:suspended:{runtime.runtime_id}"
        intent = Intent("suspend", runtime.key, runtime.sandbox_id, runtime.generation,
                        result_id, "reconciler", stray=True)  # fmt: skip
        self.queues.add(WorkItem(intent))
        return True

    def collect(self, key: str, sandbox_id: UUID, generation: int) -> bool:
        """Queue a delete of incarnation ``sandbox_id`` of ``key``, which this store tombstoned
        (at ``generation``) and of which the backend still holds something (the reconcile loop
        calls this): no event asks for it any more. Its result names the tombstone's
        generation, which the processor records as ignored (the audit of the collection).
        Nothing is queued while the sandbox has intents here, nor for another executor's
        partition."""
        if not self._may_queue(key):
            return False
        log.warning("collecting the leftovers of %s incarnation %s, deleted at generation %d",
                    key, sandbox_id, generation)  # fmt: skip
        intent = Intent("delete", key, sandbox_id, generation, f"result:leftover:{sandbox_id}",
                        "reconciler", leftover=True)  # fmt: skip
        self.queues.add(WorkItem(intent))
        return True

    def _may_queue(self, key: str) -> bool:
        return not self.ownership.closing and not self.pending(key) and self.owns(key)
