"""Failures: which backend a failure says was lost (ridden out in place), which writes
PostgreSQL refused for what a record holds (dead-lettered), and letting go of what a loss broke.
"""

from __future__ import annotations

import contextlib
from typing import Any

import asyncpg
from aiokafka.errors import KafkaError

from projections.store import CONNECTION_ERRORS

# SQLSTATE classes of a write refused for what the records hold (data exceptions, integrity
# constraints, a trigger's RAISE, program limits), as opposed to the server's state.
_REFUSED_CLASSES = ("22", "23", "P0", "54")


class WriteRefused(Exception):
    """PostgreSQL refused a batch for what one of its records holds."""


def refused_for_content(exc: BaseException) -> bool:
    return isinstance(exc, asyncpg.PostgresError) and str(exc.sqlstate)[:2] in _REFUSED_CLASSES


def kafka_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a Kafka client error: broker down or restarting,
    a send not acknowledged in time."""
    while exc is not None:
        if isinstance(exc, KafkaError):
            return True
        exc = exc.__cause__  # type: ignore[assignment]
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
    while exc is not None:
        if isinstance(exc, CONNECTION_ERRORS):
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


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
