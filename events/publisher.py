"""Producer-side helpers: publish commands, and learn their outcome by command id."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from events.codec import encode
from events.commands import Command
from events.observations import Observation
from events.outcomes import CommandOutcome
from events.topics import CHANGES_CHANNEL, COMMANDS, record_key

_log = logging.getLogger("sandstream.publisher")


def new_command_id() -> str:
    return str(uuid.uuid4())


def now() -> datetime:
    return datetime.now(UTC)


class CommandPublisher:
    """Publishes commands keyed by sandbox name with an idempotent producer (acks=all).

    ``publish`` returns once the broker acknowledged the record, with its partition and offset.
    """

    def __init__(self, bootstrap: str, topic: str = COMMANDS, **producer_args: Any) -> None:
        self.topic = topic
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", **producer_args
        )

    async def __aenter__(self) -> CommandPublisher:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def publish(self, command: Command) -> tuple[int, int]:
        meta = await self.producer.send_and_wait(
            self.topic, value=encode(command), key=record_key(command.key)
        )
        return meta.partition, meta.offset

    async def publish_many(self, commands: list[Command]) -> None:
        futures = [
            await self.producer.send(self.topic, value=encode(c), key=record_key(c.key))
            for c in commands
        ]
        await asyncio.gather(*futures)


async def fetch_outcome(
    conn: Any, command_id: str, key: str | None = None
) -> CommandOutcome | None:
    """The outcome of a command; ``key`` narrows it when a client reused the id across sandboxes."""
    raw = await conn.fetchval(
        "SELECT outcome FROM command_outcomes WHERE command_id = $1 "
        "AND ($2::text IS NULL OR key = $2) ORDER BY decided_at LIMIT 1",
        command_id,
        key,
    )
    return CommandOutcome.model_validate_json(raw) if raw is not None else None


async def await_outcome(
    pool: asyncpg.Pool[asyncpg.Record],
    command_id: str,
    timeout: float = 10.0,
    key: str | None = None,
) -> CommandOutcome | None:
    """Wait until the processor has decided the command; None if the timeout passes first.

    Woken by the processor's per-batch NOTIFY, with a slow poll as a safety net.
    """
    woken = asyncio.Event()

    def _wake(*_: object) -> None:
        woken.set()

    async with pool.acquire() as conn:
        await conn.add_listener(CHANGES_CHANNEL, _wake)
        try:
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                woken.clear()
                outcome = await fetch_outcome(conn, command_id, key)
                remaining = deadline - asyncio.get_running_loop().time()
                if outcome is not None or remaining <= 0:
                    return outcome
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), timeout=min(remaining, 0.5))
        finally:
            await conn.remove_listener(CHANGES_CHANNEL, _wake)


async def publish_observation(
    producer: AIOKafkaProducer, topic: str, observation: Observation
) -> None:
    """Send one observation, keyed by its sandbox, and wait for the broker's acknowledgement."""
    await producer.send_and_wait(topic, value=encode(observation), key=observation.key.encode())


async def publish_until_sent(
    producer: AIOKafkaProducer,
    topic: str,
    observation: Observation,
    stop: asyncio.Event | None = None,
) -> bool:
    """Publish, retrying Kafka errors with back-off until sent (True) or ``stop`` (False)."""
    delay = 0.2
    while True:
        try:
            await publish_observation(producer, topic, observation)
            return True
        except KafkaError as exc:
            _log.warning("publishing %s failed, retrying: %s", observation.observation_id, exc)
        with contextlib.suppress(TimeoutError):  # the back-off, cut short by ``stop``
            await asyncio.wait_for((stop or asyncio.Event()).wait(), timeout=delay)
        if stop is not None and stop.is_set():
            return False
        delay = min(delay * 2, 5.0)
