"""Producer-side helpers: publish commands and observations with the idempotent producer."""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    KafkaError,
    TopicAuthorizationFailedError,
)

from events.backoff import STOPPED, Backoff, retry
from events.codec import encode
from events.commands import Command
from events.observations import Observation
from events.topics import COMMANDS, record_key

_log = logging.getLogger("sandstream.publisher")


def new_command_id() -> str:
    return str(uuid.uuid4())


def now() -> datetime:
    return datetime.now(UTC)


class CommandPublisher:
    """Publishes commands keyed by sandbox name with an idempotent producer (acks=all).

    ``publish`` returns once the broker acknowledged the record, with its partition and offset.
    ``client`` holds the connection's keyword arguments (bootstrap servers, security);
    ``principal`` is the Kafka principal it connects as (``User:<name>``), None without SASL.
    """

    def __init__(
        self, client: Mapping[str, Any], topic: str = COMMANDS, **producer_args: Any
    ) -> None:
        self.topic = topic
        user = client.get("sasl_plain_username")
        self.principal = f"User:{user}" if user else None
        self._args = {**client, **producer_args}
        self.producer = self._new_producer()
        self._refused: AIOKafkaProducer | None = None  # replaced before its next send
        self._renewing = asyncio.Lock()

    async def __aenter__(self) -> CommandPublisher:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def publish(self, command: Command) -> tuple[int, int]:
        producer = await self._usable()
        sent = await producer.send(self.topic, value=encode(command), key=record_key(command.key))
        try:
            meta = await sent
        except (TopicAuthorizationFailedError, ClusterAuthorizationFailedError):
            # aiokafka does not take back the sequence number of a batch the broker refused:
            # this producer's next batch on the partition would be refused as out of order
            # (OutOfOrderSequenceNumber), and every one after it, long after the ACL is granted.
            self._refused = producer
            raise
        return meta.partition, meta.offset

    def _new_producer(self) -> AIOKafkaProducer:
        return AIOKafkaProducer(**self._args, enable_idempotence=True, acks="all")

    async def _usable(self) -> AIOKafkaProducer:
        """The producer, a new one if the broker refused one of its batches. Starting it fails
        while the principal may not produce idempotently at all (ClusterAuthorizationFailedError,
        without Write on any topic); the next publish tries again."""
        if self._refused is not self.producer:
            return self.producer
        async with self._renewing:
            if self._refused is self.producer:
                fresh = self._new_producer()
                try:
                    await fresh.start()
                except BaseException:
                    await fresh.stop()
                    raise
                refused, self.producer = self.producer, fresh
                self._refused = None
                await asyncio.shield(refused.stop())  # its other batches are sent first
        return self.producer

    async def publish_many(self, commands: list[Command]) -> None:
        futures = [
            await self.producer.send(self.topic, value=encode(c), key=record_key(c.key))
            for c in commands
        ]
        await asyncio.gather(*futures)


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
    backoff = Backoff(0.2, 5.0, _log, f"publishing {observation.observation_id}")
    publish = functools.partial(publish_observation, producer, topic, observation)
    return await retry(publish, backoff=backoff, retry_on=(KafkaError,), stop=stop) is not STOPPED
