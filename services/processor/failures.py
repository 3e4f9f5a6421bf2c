"""Failures: which backend a failure says was lost (ridden out in place), which refusals no
retry can fix (PostgreSQL's of a record: dead-lettered; Kafka's: never taken for a lost broker),
and letting go of what a loss broke.
"""

from __future__ import annotations

import contextlib
from typing import Any

import asyncpg
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidRequiredAcksError,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnsupportedForMessageFormatError,
)

from projections.store import CONNECTION_ERRORS

# SQLSTATE classes of a write refused for what the records hold (data exceptions, integrity
# constraints, a trigger's RAISE, program limits), as opposed to the server's state.
_REFUSED_CLASSES = ("22", "23", "P0", "54")


class WriteRefused(Exception):
    """PostgreSQL refused a batch for what one of its records holds."""


def refused_for_content(exc: BaseException) -> bool:
    return isinstance(exc, asyncpg.PostgresError) and str(exc.sqlstate)[:2] in _REFUSED_CLASSES


# What Kafka answers about a record or a request that sending it again cannot change: the
# record (too large, corrupt, a timestamp or format the topic refuses, a policy), or who sends
# it where (no ACL to write the topic, no such topic, acks the broker does not take).
REFUSED_BY_KAFKA: tuple[type[KafkaError], ...] = (
    MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError,
    CorruptRecordException, InvalidMessageError, InvalidTimestampError,
    UnsupportedForMessageFormatError, PolicyViolationError,
    TopicAuthorizationFailedError, ClusterAuthorizationFailedError,
    TransactionalIdAuthorizationFailed, InvalidTopicError, InvalidRequiredAcksError,
)  # fmt: skip


class PublishRefused(RuntimeError):
    """Kafka refuses what the processor publishes and no retry can change that (an ACL, a
    topic's limits): the processor stops, loudly, until an operator fixes it."""


def refused_by_kafka(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a refusal no retry can fix."""
    return _caused_by(exc, REFUSED_BY_KAFKA)


def kafka_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a Kafka client error that waiting can fix: broker
    down or restarting, a send not acknowledged in time. A refusal never is."""
    return _caused_by(exc, (KafkaError,)) and not refused_by_kafka(exc)


def _caused_by(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    found: BaseException | None = exc
    while found is not None:
        if isinstance(found, kinds):
            return True
        found = found.__cause__
    return False


def backend_lost(exc: BaseException) -> str | None:
    """Which backend ``exc`` says was lost ("PostgreSQL" or "Kafka"), or None for a bug."""
    if database_gone(exc):
        return "PostgreSQL"
    if kafka_gone(exc):
        return "Kafka"
    return None


def database_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a lost or refused PostgreSQL connection."""
    return _caused_by(exc, CONNECTION_ERRORS)


def terminate(conn: Any) -> None:
    """Drop a connection a lost backend may have broken. A closed connection goes back to its
    pool by itself (which then opens a new one); terminating one that still looks alive does
    the same."""
    with contextlib.suppress(*CONNECTION_ERRORS):
        if conn is not None:
            conn.terminate()


async def release(pool: asyncpg.Pool[asyncpg.Record], conn: Any) -> None:
    """Give a connection back to its pool (one whose session was lost is back there already)."""
    if conn is not None:
        with contextlib.suppress(*CONNECTION_ERRORS):
            await pool.release(conn)
