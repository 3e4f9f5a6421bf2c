"""Commands in: publish once, answer retries with the first outcome, wait for the outcome.

The HTTP routes (and any other door into the API, such as a gRPC front) hand a built command
to ``CommandGateway.submit``; nothing else in the API publishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Final, TypeAlias

import asyncpg
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, TopicAuthorizationFailedError

from events.codec import encode
from events.commands import AdoptSandbox, Command, CreateSandbox
from events.outcomes import CommandOutcome
from events.publisher import REFUSED_FOR_ACL, CommandPublisher
from events.topics import MAX_INPUT_BYTES
from services.api import idempotency, readmodel
from services.api.idempotency import IdempotencyConflict
from services.api.readmodel import ChangeFeed
from services.common import metrics
from services.common.settings import Settings

log = logging.getLogger("sandstream.api")

PUBLISH_TIMEOUT: Final = 15.0
Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"


class PublishFailed(Exception):
    """Kafka did not acknowledge the command: it may still be applied."""

    def __init__(self, command: Command, cause: BaseException) -> None:
        super().__init__(
            f"Kafka did not acknowledge the command ({type(cause).__name__}); it may still be "
            f"applied: retry with the same command_id {command.command_id!r}"
        )
        self.command_id = command.command_id


class PublishForbidden(Exception):
    """Kafka refused the command for want of an ACL: it was not published, and retrying cannot
    help until an operator grants the API's principal the ACL."""

    def __init__(self, command: Command, cause: KafkaError, publisher: CommandPublisher) -> None:
        if isinstance(cause, TopicAuthorizationFailedError):
            missing = f"Write on topic {publisher.topic!r}"
        else:  # an idempotent producer's id: Kafka 3.0+ takes Write on any topic instead
            missing = f"IdempotentWrite on the cluster (or Write on topic {publisher.topic!r})"
        who = publisher.principal or "the API's Kafka principal"
        self.why = f"{who} lacks the ACL {missing} ({type(cause).__name__})"
        super().__init__(
            f"Kafka refused command {command.command_id!r}: {self.why}. The command was not "
            "accepted; no retry helps until an operator grants the ACL, then a retry with the "
            "same command id publishes it"
        )
        self.command_id = command.command_id


class CommandTooLarge(Exception):
    """The command is larger than the processor decides (or than a Kafka record): retrying
    cannot help."""

    def __init__(self, command: Command, size: int | None = None, limit: int | None = None) -> None:
        what = (
            f"is {size} bytes encoded, above the {limit} bytes the processor decides "
            "(SANDSTREAM_PROCESSOR_MAX_INPUT_BYTES)"
            if size is not None
            else "is too large for a Kafka record"
        )
        super().__init__(
            f"command {command.command_id!r} {what}: make its spec smaller (env, command, "
            "labels); it was not accepted"
        )
        self.size = size
        self.limit = limit


@dataclass(frozen=True, slots=True)
class Submitted:
    """What became of a submitted command: its outcome, or None while it is pending."""

    outcome: CommandOutcome | None
    retry: bool  # the command id was known: nothing was published again


class CommandGateway:
    def __init__(
        self,
        pool: Pool,
        publisher: CommandPublisher,
        feed: ChangeFeed,
        *,
        poll_interval: float = 1.0,
        publish_timeout: float = PUBLISH_TIMEOUT,
        max_bytes: int = MAX_INPUT_BYTES,
    ) -> None:
        """``max_bytes``: the largest encoded command accepted, the processor's
        ``processor_max_input_bytes`` (it dead-letters a larger record, so one published would
        be accepted and never decided)."""
        self.pool = pool
        self.publisher = publisher
        self.feed = feed
        self.poll_interval = poll_interval
        self.publish_timeout = publish_timeout
        # Why Kafka refused the last command for want of an ACL; None once one is published.
        self.refused: str | None = None
        self.max_bytes = max_bytes
        self.marks = idempotency.PublishedMarks(pool)

    @classmethod
    def of_role(
        cls,
        settings: Settings,
        pool: Pool,
        publisher: CommandPublisher,
        feed: ChangeFeed,
        *,
        poll_interval: float = 1.0,
        publish_timeout: float | None = None,
    ) -> CommandGateway:
        """The gateway a role runs (the API, OpenShell's door, provider-sync): the publish
        timeout (unless given) and the size limit from ``settings``."""
        if publish_timeout is None:
            publish_timeout = settings.api_publish_timeout_seconds
        return cls(
            pool,
            publisher,
            feed,
            poll_interval=poll_interval,
            publish_timeout=publish_timeout,
            max_bytes=settings.processor_max_input_bytes,
        )

    async def wait_outcome(
        self, command_id: str, key: str | None, timeout: float, *, published: bool = False
    ) -> CommandOutcome | None:
        """The command's outcome once decided; None if ``timeout`` passes first.
        ``published``: mark the command published first, on the connection of the first
        look-up (a pool acquisition fewer)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            mark = self.feed.mark()
            async with self.pool.acquire() as conn:
                if published:
                    await idempotency.mark_published(conn, command_id)
                    published = False
                outcome = await readmodel.fetch_outcome(conn, command_id, key)
            remaining = deadline - loop.time()
            if outcome is not None or remaining <= 0:
                return outcome
            await self.feed.wait(mark, min(remaining, self.poll_interval))

    async def submit(self, command: Command, wait: float | None) -> Submitted:
        """Publish ``command`` unless its id is known, then wait up to ``wait`` seconds for the
        outcome. Raises ``IdempotencyConflict`` when its id was first used for another request,
        ``CommandTooLarge`` when it is larger than the processor decides or than a record (before
        anything is recorded or published), ``PublishForbidden`` when Kafka refuses it for want
        of an ACL, ``PublishFailed`` when Kafka does not acknowledge it."""
        encoded = encode(command)
        size = len(encoded)
        if size > self.max_bytes:
            metrics.API_COMMANDS.labels(command.type, "too_large").inc()
            raise CommandTooLarge(command, size, self.max_bytes)
        step = metrics.API_COMMAND_STEP_SECONDS
        began = time.perf_counter()
        async with self.pool.acquire() as conn:  # one acquisition for both
            acquired = time.perf_counter()
            step.labels("pool_wait").observe(acquired - began)
            # A create is decided on the name itself (refused there while the name is bound),
            # and a claim's steps name their keys; other commands address what the name
            # stands for (services.common.names).
            asked = command
            named = not isinstance(command, CreateSandbox | AdoptSandbox)
            recorded = await idempotency.record_and_outcome(conn, command, resolve=named)
            command, first, decided = recorded.command, recorded.first, recorded.outcome
        step.labels("record").observe(time.perf_counter() - acquired)
        known = None if decided is None else CommandOutcome.model_validate_json(decided)
        if command is not asked:  # keyed by the member its name is bound to: encoded again
            encoded = encode(command)
        if known is not None and known.command_type != command.type:
            # Decided before the API recorded the id (published by another producer).
            raise IdempotencyConflict(
                command.command_id,
                idempotency.Recorded(known.key, known.command_type, "", "", True),
            )
        if known is not None or (first is not None and first.published):
            # A retry: the first outcome stands (or is on its way); nothing is published again.
            metrics.API_COMMANDS.labels(command.type, "retry").inc()
            if known is None and wait:
                known = await self.wait_outcome(command.command_id, command.key, wait)
            return Submitted(known, retry=True)
        sent = time.perf_counter()
        try:
            await asyncio.wait_for(self.publisher.publish(command, encoded), self.publish_timeout)
        except MessageSizeTooLargeError as exc:
            metrics.API_COMMANDS.labels(command.type, "too_large").inc()
            raise CommandTooLarge(command) from exc
        except REFUSED_FOR_ACL as exc:
            metrics.API_COMMANDS.labels(command.type, "forbidden").inc()
            forbidden = PublishForbidden(command, exc, self.publisher)
            log.error("publishing %s: %s", command.type, forbidden)
            self.refused = forbidden.why
            raise forbidden from exc
        except (KafkaError, TimeoutError) as exc:
            metrics.API_COMMANDS.labels(command.type, "unavailable").inc()
            log.warning("publishing %s %s failed: %r", command.type, command.command_id, exc)
            raise PublishFailed(command, exc) from exc
        self.refused = None
        published = time.perf_counter()
        step.labels("publish").observe(published - sent)
        metrics.API_COMMANDS.labels(command.type, "published").inc()
        if not wait:
            await self.marks.mark(command.command_id)
            step.labels("mark_published").observe(time.perf_counter() - published)
            return Submitted(None, retry=False)
        outcome = await self.wait_outcome(command.command_id, command.key, wait, published=True)
        return Submitted(outcome, retry=False)
