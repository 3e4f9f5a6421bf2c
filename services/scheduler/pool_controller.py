"""The pool controller: keeps every warm pool at its size by publishing ordinary commands.

Level-triggered: each round reads the pools, their unclaimed members (rows with ``pool`` set,
not adopted) and the creates it asked for earlier, and publishes what the difference calls
for (``pool_plan.plan``): a ``CreateSandbox`` with ``pool`` set for each missing member, a
``DeleteSandbox`` for each failed, surplus or outdated one. It decides nothing on the log: the
fold decides each command as any other, so every pool decision is in the history.

Never over-creating across a SIGKILL: a create is recorded in ``pool_requests`` (committed)
before it is published, and counts as a member until the fold has decided it. A restarted
controller publishes again the requests it does not know it sent (same command id: the
processor answers a duplicate with the first outcome), so a create recorded but never sent is
not lost either.

Never touching a claimed member: a delete carries the member's row version as
``expected_version``, so a member adopted between the read and the delete is refused
(ABORTED) rather than deleted; adopted members are not read at all.

Runs in the scheduler role (single-active under its lease), woken (``POOLS_CHANNEL``) by pool
and template writes and by the processor's batches that wrote a member's row, and at least
every ``pool_poll_seconds`` (what no row shows: a refused create, the end of a failure pause).
Other rows' changes do not wake it: a fleet without pools costs it nothing per commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import string
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import asyncpg
from aiokafka.errors import KafkaError

from events.codec import COMMANDS, DecodeError, decode
from events.commands import Command, CreateSandbox, DeleteSandbox
from events.publisher import CommandPublisher, new_command_id
from events.topics import POOLS_CHANNEL
from projections.store import CONNECTION_ERRORS
from services.common import metrics, templates
from services.common import pools as store
from services.common.kafka_clients import kafka_client_args
from services.common.notify_channels import Listening
from services.common.pools import Member, PoolInfo, Request
from services.common.settings import Settings
from services.common.tasks import first_of
from services.scheduler.pool_plan import FAILED, plan

log = logging.getLogger("sandstream.pools")

ACTOR: Final = "pool-controller"
# A pool whose members fail (a bad image, a crashing agent) is refilled after a pause that
# doubles with each round of failures, up to the cap, and is over once a member is Ready.
FAILURE_PAUSE: Final = 1.0
FAILURE_PAUSE_MAX: Final = 60.0
_ALPHABET: Final = string.ascii_lowercase + string.digits
_DELETE_IDS: Final = uuid.UUID("5f0c3a59-8a8e-4ad5-93f1-4f5dfa1a2c7e")
MIN_ROUND_SECONDS: Final = 0.1
_FAILED: Final = "members keep failing:"


def utcnow() -> datetime:
    return datetime.now(UTC)


def member_key(pool: str) -> str:
    """``<pool>-<8 random [a-z0-9]>``: a sandbox name (pool names leave room for it)."""
    suffix = "".join(secrets.choice(_ALPHABET) for _ in range(store.MEMBER_SUFFIX_LENGTH))
    return f"{pool}-{suffix}"


def delete_command(member: Member, now: datetime) -> DeleteSandbox:
    """The delete of one member at the version it was read at (its id is derived from both,
    so asking again for the same row version is a duplicate)."""
    return DeleteSandbox(
        type="DeleteSandbox",
        command_id=str(uuid.uuid5(_DELETE_IDS, f"{member.key}:{member.version}")),
        key=member.key,
        occurred_at=now,
        actor=ACTOR,
        expected_version=member.version,
    )


def _create_command(p: PoolInfo, resolved: templates.Resolved, now: datetime) -> CreateSandbox:
    """A create of a new member of ``p`` from its template as resolved now."""
    return CreateSandbox.model_validate(
        {
            "type": "CreateSandbox",
            "command_id": new_command_id(),
            "key": member_key(p.name),
            "occurred_at": now,
            "actor": ACTOR,
            "spec": resolved.spec,
            "providers": resolved.providers,
            "on_expiry": resolved.on_expiry,
            "on_exit": resolved.on_exit,
            "template": resolved.ref,
            "pool": p.name,
        }
    )


@dataclass
class PoolController:
    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    clock: Callable[[], datetime] = utcnow
    publisher: CommandPublisher | None = None
    rounds: int = 0
    creates: int = 0  # CreateSandbox commands published since start
    deletes: int = 0  # DeleteSandbox commands published since start
    problems: dict[str, str] = field(default_factory=dict)  # pool -> why it cannot fill now
    _sent: set[str] = field(default_factory=set)  # command ids of requests published
    _deleting: dict[str, int] = field(default_factory=dict)  # key -> version a delete was sent at
    _failing: dict[str, tuple[int, float]] = field(default_factory=dict)  # pool -> streak, until
    _reported: set[str] = field(default_factory=set)  # pools with gauges set
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    listening: Listening | None = None

    async def start(self) -> None:
        args = kafka_client_args(self.settings, "scheduler", "sandstream-pools")
        self.publisher = CommandPublisher(args, topic=self.settings.topic_commands)
        await self.publisher.__aenter__()
        self.listening = Listening(self.pool, POOLS_CHANNEL, self._notified, "pool controller")
        self.listening.start()

    async def stop(self) -> None:
        if self.listening is not None:
            await self.listening.close()
        if self.publisher is not None:
            await self.publisher.__aexit__()

    def _notified(self, *_: object) -> None:
        self._changed.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._changed.clear()
            try:
                await self.round()
            except (*CONNECTION_ERRORS, KafkaError) as exc:
                log.warning("pool controller: %s; trying again next round", exc)
            await _wait(stop, self._changed, self.settings.pool_poll_seconds)
            await _wait(stop, asyncio.Event(), MIN_ROUND_SECONDS)

    async def round(self) -> None:
        """Read everything once, then publish what every pool needs."""
        async with self.pool.acquire() as conn:
            view = await store.read_view(conn)
            await self._forget_folded(conn, view.requests)
        pools, asked, members, revisions = view.pools, view.requests, view.members, view.revisions
        pending = [r for r in asked if not r.folded]
        await self._send_again(pending)
        waiting = Counter(r.pool for r in pending)
        by_pool: dict[str, list[Member]] = {}
        for m in members:
            by_pool.setdefault(m.pool, []).append(m)
        self._deleting = {m.key: v for m in members if (v := self._deleting.get(m.key)) is not None}
        for p in pools:
            mine = by_pool.pop(p.name, [])
            revision = revisions.get(p.template)
            missing = f"template {p.template!r} not found"
            if revision is None:
                self.problems[p.name] = missing
            elif self.problems.get(p.name) == missing:
                del self.problems[p.name]
            step = plan(p.size, p.strategy, p.template, revision, mine, waiting[p.name])
            fresh = [
                m
                for m in mine
                if not m.held and (m.template, m.template_revision) == (p.template, revision)
            ]
            paused = self._pause(p.name, fresh, step.deletes)
            await self._delete(step.deletes)
            if step.creates and not paused:
                await self._create(p, step.creates)
            _report(p.name, mine, waiting[p.name])
        for name, orphans in by_pool.items():  # pools deleted: their unclaimed members go
            step = plan(0, "OnReplenish", "", None, orphans, waiting[name])
            await self._delete(step.deletes)
        async with self.pool.acquire() as conn:
            await store.set_problems(conn, {p.name: self.problems.get(p.name) for p in pools})
        _forget_gone(self._reported - {p.name for p in pools})
        self._reported = {p.name for p in pools}
        self.problems = {k: v for k, v in self.problems.items() if k in self._reported}
        self._failing = {k: v for k, v in self._failing.items() if k in self._reported}
        self.rounds += 1

    def _pause(self, pool: str, current: list[Member], deletes: tuple[Member, ...]) -> bool:
        """Whether the pool's creates wait out a failure pause (started by members that failed
        since the last round, ended by a member of the current revision Ready: old members
        Ready during a roll to a broken revision do not end it)."""
        failed = [m for m in deletes if m.phase in FAILED and m.key not in self._deleting]
        streak, until = self._failing.get(pool, (0, 0.0))
        if any(m.phase == "Ready" for m in current) and not failed:
            if streak and self.problems.get(pool, "").startswith(_FAILED):
                del self.problems[pool]
            self._failing.pop(pool, None)
            return False
        if failed:
            streak += 1
            pause = min(FAILURE_PAUSE_MAX, FAILURE_PAUSE * 2 ** (streak - 1))
            until = time.monotonic() + pause
            self._failing[pool] = (streak, until)
            m = failed[0]
            self.problems[pool] = (
                f"{_FAILED} {len(failed)} member(s) failed ({m.key}: {m.phase}"
                + (f", {m.reason}" if m.reason else "")
                + f"); creating again in {pause:g}s"
            )
            log.warning("pool %s: %s", pool, self.problems[pool])
        return time.monotonic() < until

    async def _forget_folded(self, conn: Any, asked: list[Request]) -> None:
        """Requests the fold decided are members now (or refused: said in the pool's status)."""
        for r in asked:
            if r.refusal is not None:
                self.problems[r.pool] = f"create of {r.key} refused: {r.refusal}"
                log.warning("pool %s: create of %s refused: %s", r.pool, r.key, r.refusal)
            elif r.folded and self.problems.get(r.pool, "").startswith("create of"):
                del self.problems[r.pool]  # an accepted create: the refusals are over
        done = [r.key for r in asked if r.folded]
        if done:
            await store.drop_requests(conn, done)
            self._sent -= {r.command_id for r in asked if r.folded}

    async def _send_again(self, pending: list[Request]) -> None:
        """Requests recorded by an earlier controller (or before a failed send) go out again."""
        assert self.publisher is not None
        again: list[Command] = []
        for r in pending:
            if r.command_id in self._sent:
                continue
            try:
                command = decode(COMMANDS, r.command)
            except DecodeError as exc:  # stored by a version that wrote another shape
                log.error("pool request %s cannot be read (%s); dropped", r.key, exc)
                async with self.pool.acquire() as conn:
                    await store.drop_requests(conn, [r.key])
                continue
            again.append(command)
        await self.publisher.publish_many(again)
        self._sent.update(c.command_id for c in again)

    async def _create(self, p: PoolInfo, count: int) -> None:
        assert self.publisher is not None
        async with self.pool.acquire() as conn:
            try:
                resolved = await templates.resolve(conn, p.template)
            except templates.TemplateMissing as exc:
                self.problems[p.name] = str(exc)
                return
            now = self.clock()
            commands = [_create_command(p, resolved, now) for _ in range(count)]
            rows = [(c.key, p.name, c.command_id, c.model_dump_json()) for c in commands]
            await store.add_requests(conn, rows, now)
        # Recorded before published (a restarted controller sends again what it may not have
        # sent), then published together: one Kafka request for the round, not one each.
        await self.publisher.publish_many(list(commands))
        for command in commands:
            self._sent.add(command.command_id)
            self.creates += 1
            metrics.POOL_COMMANDS.labels("create").inc()
            log.info("pool %s: creating member %s", p.name, command.key)

    async def _delete(self, members: tuple[Member, ...]) -> None:
        assert self.publisher is not None
        # Those asked already at this version are left: the row has not moved yet.
        asking = [m for m in members if self._deleting.get(m.key) != m.version]
        await self.publisher.publish_many([delete_command(m, self.clock()) for m in asking])
        for m in asking:
            self._deleting[m.key] = m.version
            self.deletes += 1
            metrics.POOL_COMMANDS.labels("delete").inc()
            log.info("pool %s: deleting member %s (%s)", m.pool, m.key, m.phase)


REPORTED_PHASES: Final = ("Provisioning", "Starting", "Ready", "Error", "Stopped", "Deleting")


def _report(pool: str, members: list[Member], pending: int) -> None:
    counts = Counter(m.phase for m in members)
    for phase in REPORTED_PHASES:
        metrics.POOL_MEMBERS.labels(pool, phase).set(counts.get(phase, 0))
    metrics.POOL_MEMBERS.labels(pool, "Requested").set(pending)


def _forget_gone(pools: set[str]) -> None:
    """A deleted pool's gauges go with it (they would report its last counts forever)."""
    for pool in pools:
        for phase in (*REPORTED_PHASES, "Requested"):
            with contextlib.suppress(KeyError):
                metrics.POOL_MEMBERS.remove(pool, phase)


async def _wait(stop: asyncio.Event, changed: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(first_of(stop, changed), timeout)
