"""Producer-side helpers: publish commands and observations with the idempotent producer."""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

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


# What the broker answers a principal lacking an ACL: no retry fixes it, an operator does.
REFUSED_FOR_ACL: Final = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError)


class RenewingProducer:
    """An idempotent producer (acks=all) replaced after the broker refused one of its batches
    for want of an ACL. aiokafka does not take back the sequence number of a refused batch: the
    producer's next batch on that partition, and every one after it, would be refused as out of
    order (OutOfOrderSequenceNumber), long after the ACL is granted, until a restart.
    ``client`` holds the connection's keyword arguments (bootstrap servers, security)."""

    def __init__(self, client: Mapping[str, Any], **producer_args: Any) -> None:
        self._args = {**client, **producer_args}
        self.current = self._new_producer()
        self._refused: AIOKafkaProducer | None = None  # replaced before its next send
        self._renewing = asyncio.Lock()

    def _new_producer(self) -> AIOKafkaProducer:
        return AIOKafkaProducer(**self._args, enable_idempotence=True, acks="all")

    async def start(self) -> None:
        await self.current.start()

    async def stop(self) -> None:
        await self.current.stop()

    async def send_and_wait(
        self, topic: str, value: bytes | None = None, key: bytes | None = None
    ) -> Any:
        """Send one record and wait for its acknowledgement (the record's metadata)."""
        producer = await self._usable()
        sent = await producer.send(topic, value=value, key=key)
        try:
            return await sent
        except REFUSED_FOR_ACL:
            self._refused = producer
            raise

    async def send_many(self, topic: str, records: Sequence[tuple[bytes | None, bytes]]) -> None:
        """Send ``records`` (key, value) and wait for every acknowledgement: handed over all
        at once, they leave in as few requests as the producer can make of them (one per
        broker while none is in flight), in order within each partition."""
        producer = await self._usable()
        sent = [await producer.send(topic, value=value, key=key) for key, value in records]
        try:
            await asyncio.gather(*sent)
        except REFUSED_FOR_ACL:
            self._refused = producer
            raise

    async def _usable(self) -> AIOKafkaProducer:
        """The producer, a new one if the broker refused one of its batches. Starting it fails
        while the principal may not produce idempotently at all (ClusterAuthorizationFailedError,
        without Write on any topic); the next send tries again."""
        if self._refused is not self.current:
            return self.current
        async with self._renewing:
            if self._refused is self.current:
                fresh = self._new_producer()
                try:
                    await fresh.start()
                except BaseException:
                    await fresh.stop()
                    raise
                refused, self.current = self.current, fresh
                self._refused = None
                await asyncio.shield(refused.stop())  # its other batches are sent first
        return self.current


class CommandPublisher:
    """Publishes commands keyed by sandbox name with an idempotent producer (acks=all), a new
    one after a refusal for want of an ACL (``RenewingProducer``).

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
        self.producer = RenewingProducer(client, **producer_args)

    async def __aenter__(self) -> CommandPublisher:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def publish(self, command: Command, encoded: bytes | None = None) -> tuple[int, int]:
        """``encoded``: the command's bytes (``encode``) when the caller has them already."""
        value = encode(command) if encoded is None else encoded
        meta = await self.producer.send_and_wait(
            self.topic, value=value, key=record_key(command.key)
        )
        return meta.partition, meta.offset

    async def publish_many(self, commands: Sequence[Command]) -> None:
        """Publish ``commands`` together (``RenewingProducer.send_many``); returns once the
        broker acknowledged every one."""
        if not commands:
            return
        records = [(record_key(c.key), encode(c)) for c in commands]
        await self.producer.send_many(self.topic, records)


async def publish_observation(
    producer: RenewingProducer, topic: str, observation: Observation
) -> None:
    """Send one observation, keyed by its sandbox, and wait for the broker's acknowledgement."""
    await producer.send_and_wait(topic, value=encode(observation), key=observation.key.encode())


async def publish_until_sent(
    producer: RenewingProducer,
    topic: str,
    observation: Observation,
    stop: asyncio.Event | None = None,
) -> bool:
    """Publish, retrying Kafka errors with back-off until sent (True) or ``stop`` (False)."""
    return await publish_all_until_sent(producer, topic, [observation], stop)


async def publish_all_until_sent(
    producer: RenewingProducer,
    topic: str,
    observations: Sequence[Observation],
    stop: asyncio.Event | None = None,
) -> bool:
    """Publish ``observations`` together (each keyed by its sandbox), all of them again after
    a Kafka error, with back-off, until every one is acknowledged (True) or ``stop`` (False).
    At least once, as one at a time: a record the broker took before the error is sent again.
    Callers put no two observations of one sandbox in the same call, so each is acknowledged
    before the next of its sandbox is sent, whatever fails."""
    records = [(o.key.encode(), encode(o)) for o in observations]
    what = f"publishing {observations[0].observation_id}" + (
        f" and {len(observations) - 1} more" if len(observations) > 1 else ""
    )
    backoff = Backoff(0.2, 5.0, _log, what)
    publish = functools.partial(producer.send_many, topic, records)
    return await retry(publish, backoff=backoff, retry_on=(KafkaError,), stop=stop) is not STOPPED
