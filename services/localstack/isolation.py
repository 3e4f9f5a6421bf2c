"""Isolated environments on a shared Kafka and PostgreSQL: for tests and benchmarks.

An environment has its own topics, consumer groups and PostgreSQL schema (all migrations
applied), so several can run side by side on the one local stack; it is removed afterwards.
The roles' ACLs are granted on its own topic and group names (and revoked afterwards), so the
processor, executor, API and the rest run as their own principals there, as in production.

An environment whose process was killed before removing it stays behind. Its schema, made
first, carries a comment naming the process and the environment's names, so ``prune`` (``python
-m services.localstack prune``) removes exactly the environments whose process is gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from services.common.database import connect_pool
from services.common.kafka_clients import kafka_client_args
from services.common.migrations import apply_migrations
from services.common.settings import Settings
from services.localstack import kafka_auth
from services.localstack.config import replication_factor, topic_configs

# The settings an environment has of its own (its ACLs are granted on them).
NAME_FIELDS = (
    "topic_commands",
    "topic_observations",
    "topic_events",
    "topic_deadletter",
    "topic_checkpoints",
    "pg_schema",
    "processor_group",
    "executor_group",
)
OWNER_MARK = "sandstream isolated environment "  # how the schema's comment begins


def isolated_settings(base: Settings, prefix: str, **overrides: Any) -> Settings:
    """``base`` with topic names, groups and schema of their own (``prefix`` + a random tag)."""
    tag = f"{prefix}{uuid.uuid4().hex[:10]}"
    names = {
        "topic_commands": f"{tag}.commands",
        "topic_observations": f"{tag}.observations",
        "topic_events": f"{tag}.events",
        "topic_deadletter": f"{tag}.deadletter",
        "topic_checkpoints": f"{tag}.checkpoints",
        "pg_schema": tag.replace("-", "_"),
        "processor_group": f"{tag}-processor",
        "executor_group": f"{tag}-executor",
    }
    return base.model_copy(update=names | overrides)


@asynccontextmanager
async def isolated(
    base: Settings, prefix: str, **overrides: Any
) -> AsyncIterator[tuple[Settings, asyncpg.Pool[asyncpg.Record]]]:
    """Create the environment's topics and schema, yield its settings and a pool, remove it."""
    settings = isolated_settings(base, prefix, **overrides)
    topics = list(settings.topics)
    await _mark_owner(settings)  # first: whatever is left of it, prune can find
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    t,
                    settings.kafka_partitions,
                    replication_factor(settings),
                    topic_configs=topic_configs(settings),
                )
                for t in topics
            ]
        )
    finally:
        await admin.close()
    if kafka_auth.enabled(settings):
        await asyncio.to_thread(kafka_auth.grant, settings)
    await apply_migrations(settings.pg_dsn, schema=settings.pg_schema)
    pool = await connect_pool(settings)
    try:
        yield settings, pool
    finally:
        await pool.execute(f'DROP SCHEMA "{settings.pg_schema}" CASCADE')
        await pool.close()
        if kafka_auth.enabled(settings):
            await asyncio.to_thread(kafka_auth.revoke, settings)
        admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
        await admin.start()
        try:
            await admin.delete_topics(topics)
        finally:
            await admin.close()


async def _mark_owner(settings: Settings) -> None:
    owner = {"pid": os.getpid(), "host": socket.gethostname()}
    note = OWNER_MARK + json.dumps({**owner, "names": names_of(settings)})
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        for statement in ("CREATE SCHEMA %I", "COMMENT ON SCHEMA %I IS %L"):
            await conn.execute(await _formatted(conn, statement, settings.pg_schema, note))
    finally:
        await conn.close()


def names_of(settings: Settings) -> dict[str, str]:
    return {field: str(getattr(settings, field)) for field in NAME_FIELDS}


async def _formatted(conn: asyncpg.Connection[asyncpg.Record], statement: str, *args: str) -> str:
    """``statement`` with PostgreSQL's own quoting of ``args`` (``%I``, ``%L``): a utility
    statement takes no parameters."""
    sql: str = await conn.fetchval("SELECT format($1, VARIADIC $2::text[])", statement, args)
    return sql


# --------------------------------------------------------------------------- prune


@dataclass(frozen=True)
class Leftover:
    """An environment's schema and what its comment says of its owner."""

    schema: str
    pid: int
    host: str
    names: dict[str, str]


def leftovers(comments: Iterable[tuple[str, str]]) -> list[Leftover]:
    """The environments among ``(schema, comment)`` pairs: those whose comment is an owner mark
    naming the schema itself (anything else is not ours to judge)."""
    found = []
    for schema, comment in comments:
        if not comment.startswith(OWNER_MARK):
            continue
        try:
            note = json.loads(comment.removeprefix(OWNER_MARK))
            names = {field: str(note["names"][field]) for field in NAME_FIELDS}
            left = Leftover(schema, int(note["pid"]), str(note["host"]), names)
        except (ValueError, KeyError, TypeError):
            continue
        if names["pg_schema"] == schema:
            found.append(left)
    return found


def abandoned(found: Iterable[Leftover], host: str, alive: Callable[[int], bool]) -> list[Leftover]:
    """Those made on ``host`` by a process that is gone. One of another host, or of a pid now
    running (its own, or another process's that reuses it), is left alone."""
    return [left for left in found if left.host == host and not alive(left.pid)]


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


async def prune(base: Settings) -> tuple[list[Leftover], int]:
    """Remove every environment of this host whose process is gone: its topics, its ACLs, then
    its schema (last, so an interrupted prune finds it again). Returns those removed and how
    many environments were left because their process runs or another host made them."""
    conn = await asyncpg.connect(base.pg_dsn)
    try:
        rows = await conn.fetch(
            "SELECT nspname, obj_description(oid, 'pg_namespace') AS comment FROM pg_namespace "
            "WHERE obj_description(oid, 'pg_namespace') LIKE $1",
            OWNER_MARK + "%",
        )
    finally:
        await conn.close()
    found = leftovers((r["nspname"], r["comment"]) for r in rows)
    gone = abandoned(found, socket.gethostname(), process_alive)
    for left in gone:
        await _remove(base.model_copy(update=left.names))
    return gone, len(found) - len(gone)


async def _remove(settings: Settings) -> None:
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
    await admin.start()
    try:
        present = set(await admin.list_topics()) & set(settings.topics)
        if present:
            await admin.delete_topics(sorted(present))
    finally:
        await admin.close()
    if kafka_auth.enabled(settings):
        await asyncio.to_thread(kafka_auth.revoke, settings)
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        drop = "DROP SCHEMA IF EXISTS %I CASCADE"
        await conn.execute(await _formatted(conn, drop, settings.pg_schema))
    finally:
        await conn.close()
