"""Publish a DeadlineDue for every deadline of a live row that has passed, and for every Ready
row with an idle timeout that the doors' recorded use says is idle (``deadline`` idle, its
``last_used_at``: the fold decides, projections/lifecycle/idle.py).

Each round reads every due row (indexed queries, in pages of ``batch`` rows by key), publishes
what it has not published for that row version yet, earliest due first, then sleeps until the
next recorded deadline, a change of the rows (NOTIFY) or ``scheduler_poll_seconds``, whichever
comes first. The wall clock is read here and only here; the fold sees the time as the
message's ``occurred_at``.

A message per (row version, deadline) is enough: if the fold acts on it, the row changes and
the deadline is gone; if the fold ignores it (the row moved on in between), the version
changed and the next round publishes anew if it is still due. After a restart everything due is
published again, and the fold ignores what it already acted on.

A round reads all due rows, not the first ``batch``: rows whose messages the fold cannot
consume yet (their partition stopped at a poison record, or the processor down) stay due, and
a first page of them must not hide the deadlines after them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from aiokafka.errors import KafkaError

from events.common import Deadline, DeadlineKind
from events.observations import DeadlineDue
from events.publisher import RenewingProducer, publish_observation, publish_until_sent
from events.topics import CHANGES_CHANNEL
from projections.store import CONNECTION_ERRORS
from services.common import metrics
from services.common.database import connect_pool
from services.common.kafka_clients import kafka_client_args
from services.common.notify_channels import Listening
from services.common.settings import Settings
from services.common.suspend import suspend_refusal
from services.common.usage import forget_deleted, idle_rows
from services.scheduler.pool_controller import PoolController

log = logging.getLogger("sandstream.scheduler")

ACTOR = "scheduler"
# At most this often, however many changes are notified: a round is one query.
MIN_ROUND_SECONDS = 0.1

_DUE = """
SELECT key, generation, version, deadline, expires_at, hold IS NOT NULL AS held
FROM sandboxes
WHERE phase <> 'Deleted' AND (deadline_at <= $1 OR (expires_at <= $1 AND hold IS NULL))
  AND key > $3
ORDER BY key
LIMIT $2
"""
_NEXT = """
SELECT least(
    (SELECT min(deadline_at) FROM sandboxes WHERE phase <> 'Deleted' AND deadline_at > $1),
    (SELECT min(expires_at) FROM sandboxes
     WHERE phase <> 'Deleted' AND expires_at > $1 AND hold IS NULL))
"""


def utcnow() -> datetime:
    return datetime.now(UTC)


def deadline_due(
    key: str,
    generation: int,
    version: int,
    kind: DeadlineKind,
    due_at: datetime,
    now: datetime,
    last_used_at: datetime | None = None,
) -> DeadlineDue:
    """The message for one due deadline; its id names the row version it was read at (and,
    for idle, the time it became idle: a use since makes a new one)."""
    return DeadlineDue(
        type="DeadlineDue",
        observation_id=f"deadline:{key}:{generation}:{kind}:{due_at.isoformat()}:v{version}",
        key=key,
        generation=generation,
        occurred_at=now,
        actor=ACTOR,
        deadline=kind,
        due_at=due_at,
        last_used_at=last_used_at,
    )


def idle_message(record: Any, now: datetime) -> DeadlineDue:
    """What one idle row calls for (pure): its last use, for the fold to decide on."""
    return deadline_due(
        record["key"], record["generation"], record["version"], "idle", record["due_at"], now,
        record["last_used_at"],
    )  # fmt: skip


def due_messages(record: Any, now: datetime) -> list[DeadlineDue]:
    """What one due row calls for (pure): its phase deadline, its expiry unless held."""
    out = []
    key, generation, version = record["key"], record["generation"], record["version"]
    if record["deadline"] is not None:
        deadline = Deadline.model_validate_json(record["deadline"])
        if deadline.due_at <= now:
            out.append(deadline_due(key, generation, version, deadline.kind, deadline.due_at, now))
    expires_at = record["expires_at"]
    if expires_at is not None and expires_at <= now and not record["held"]:
        out.append(deadline_due(key, generation, version, "ttl", expires_at, now))
    return out


@dataclass
class Scheduler:
    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    clock: Callable[[], datetime] = utcnow
    batch: int = 1000
    producer: RenewingProducer | None = None
    published: int = 0  # DeadlineDue messages sent since start
    rounds: int = 0  # rounds completed since start
    idle_scans: int = 0  # reads of the recorded use since start (one a flush interval at most)
    forgotten: int = 0  # rows of deleted sandboxes' use removed since start
    _sent: set[str] = field(default_factory=set)  # ids sent for rows still due
    # The idle scan runs at most once per flush interval of the doors' use (what it reads
    # changes no faster); the ids it found due last time, kept between scans.
    _next_idle_scan: datetime | None = None
    _idle_ids: set[str] = field(default_factory=set)
    # Set at start and when a read of PostgreSQL fails: the first idle scan after is held two
    # flush intervals from the next read that succeeds. While PostgreSQL is out of reach the
    # doors cannot write the use they see (an exec running all along records nothing), so
    # until each has flushed once since (its first flush may fail as PostgreSQL comes back:
    # two intervals), the recorded use is as old as the outage, and a sandbox in use through
    # an outage longer than its timeout would be taken for idle.
    _use_unsettled: bool = True
    _unsuspendable: set[str] = field(default_factory=set)  # said once: idle, not suspendable
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    listening: Listening | None = None

    async def start(self) -> None:
        self.producer = RenewingProducer(kafka_client_args(self.settings, "scheduler"))
        await self.producer.start()
        self.listening = Listening(self.pool, CHANGES_CHANNEL, self._notified, "scheduler")
        self.listening.start()

    async def stop(self) -> None:
        if self.listening is not None:
            await self.listening.close()
        if self.producer is not None:
            await self.producer.stop()

    def _notified(self, *_: object) -> None:
        self._changed.set()

    async def round(self, stop: asyncio.Event | None = None) -> int:
        """Publish what is due and not yet published for its row version; returns how many."""
        assert self.producer is not None
        now = self.clock()
        flush = timedelta(seconds=self.settings.use_flush_seconds)
        try:
            due = [m for r in await self.due_rows(now) for m in due_messages(r, now)]
            if self._use_unsettled:
                self._use_unsettled = False
                self._next_idle_scan = now + 2 * flush
            if self._next_idle_scan is None or now >= self._next_idle_scan:
                rows = await self.idle_rows(now)
                idle = [idle_message(r, now) for r in rows if self.may_suspend(r["key"])]
                self._idle_ids = {m.observation_id for m in idle}
                self._next_idle_scan = now + flush
                due += idle
                self.forgotten += await forget_deleted(self.pool, self.batch)
                self.idle_scans += 1
        except CONNECTION_ERRORS:
            self._use_unsettled = True
            raise
        fresh = sorted(
            (m for m in due if m.observation_id not in self._sent), key=lambda m: m.due_at
        )
        for message in fresh:
            if message.deadline == "idle":  # once, on a fresh read, or the next scan's read
                if self.stale(message) or not await self.sent_once(message):
                    continue
            elif not await publish_until_sent(
                self.producer, self.settings.topic_observations, message, stop
            ):
                break
            self._sent.add(message.observation_id)
            self.published += 1
            metrics.DEADLINES_FIRED.labels(message.deadline).inc()
            log.info("%s of %s (generation %d) due at %s", message.deadline, message.key,
                     message.generation, message.due_at.isoformat())  # fmt: skip
        # Forget what is no longer due: those rows moved on.
        self._sent &= {m.observation_id for m in due} | self._idle_ids
        self.rounds += 1
        return len(fresh)

    # An idle message is decided on the use the scheduler read, so it is sent only while that
    # read is fresh: not kept through a Kafka outage (decided once the broker is back, on use
    # read before it, it would suspend a sandbox used meanwhile: an exec on a Ready sandbox
    # needs no Kafka), nor sent after earlier publishes waited longer than a flush interval.
    # The next idle scan reads the use again and sends what is still idle.
    def stale(self, message: DeadlineDue) -> bool:
        age = self.clock() - message.occurred_at
        return age > timedelta(seconds=self.settings.use_flush_seconds)

    async def sent_once(self, message: DeadlineDue) -> bool:
        assert self.producer is not None
        try:
            await publish_observation(self.producer, self.settings.topic_observations, message)
        except KafkaError as exc:
            log.warning("idle %s not sent (%s); the next scan reads its use again",
                        message.key, exc)  # fmt: skip
            return False
        return True

    async def due_rows(self, now: datetime) -> list[Any]:
        """Every row with a deadline due at ``now``, read ``batch`` rows at a time."""
        rows: list[Any] = []
        after = ""
        while True:
            page = await self.pool.fetch(_DUE, now, self.batch, after)
            rows += page
            if len(page) < self.batch:
                return rows
            after = page[-1]["key"]

    def may_suspend(self, key: str) -> bool:
        """Whether the backend keeps ``key``'s workspace through a suspend: else its idle
        timeout is not acted on (said once), since each suspend would fail and leave it Ready,
        to be found idle again. The API refuses such a timeout; an older row may have one."""
        why = suspend_refusal(self.settings, key)
        if why is not None and key not in self._unsuspendable:
            self._unsuspendable.add(key)
            log.warning("idle timeout of %s not acted on: it cannot be suspended here (%s)",
                        key, why)  # fmt: skip
        return why is None

    async def idle_rows(self, now: datetime) -> list[Any]:
        """Every Ready row idle at ``now`` (by the recorded use, plus the flush interval)."""
        return await idle_rows(self.pool, now, self.settings.use_flush_seconds)

    async def next_due(self) -> datetime | None:
        value: datetime | None = await self.pool.fetchval(_NEXT, self.clock())
        if self._next_idle_scan is not None:
            value = self._next_idle_scan if value is None else min(value, self._next_idle_scan)
        return value

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._changed.clear()
            wait = self.settings.scheduler_poll_seconds
            try:
                await self.round(stop)
                upcoming = await self.next_due()
            except CONNECTION_ERRORS as exc:  # PostgreSQL restarts: try again next round
                log.warning("scheduler: PostgreSQL unavailable (%s); retrying", exc)
                self._use_unsettled = True
                upcoming = None
            if upcoming is not None:
                wait = min(wait, max(0.0, (upcoming - self.clock()).total_seconds()))
            await _first_of(stop, self._changed, wait)
            await _first_of(stop, asyncio.Event(), MIN_ROUND_SECONDS)


async def _first_of(stop: asyncio.Event, changed: asyncio.Event, timeout: float) -> None:
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(changed.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    pool = await connect_pool(settings)
    scheduler = Scheduler(settings, pool)
    controller = PoolController(settings, pool)
    try:
        await scheduler.start()
        await controller.start()
        await asyncio.gather(scheduler.run(stop), controller.run(stop))
    finally:
        await controller.stop()
        await scheduler.stop()
        await pool.close()
