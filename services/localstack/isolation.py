"""Isolated environments on a shared Kafka and PostgreSQL: for tests and benchmarks.

An environment has its own topics, consumer groups and PostgreSQL schema (all migrations
applied), so several can run side by side on the one local stack; it is removed afterwards.
The roles' ACLs are granted on its own topic and group names (and revoked afterwards), so the
processor, executor, API and the rest run as their own principals there, as in production.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from services.common.database import connect_pool
from services.common.kafka_clients import kafka_client_args
from services.common.migrations import apply_migrations
from services.common.settings import Settings
from services.localstack import kafka_auth
from services.localstack.config import replication_factor, topic_configs


def isolated_settings(base: Settings, prefix: str, **overrides: Any) -> Settings:
    """``base`` with topic names, groups and schema of their own (``prefix`` + a random tag)."""
    tag = f"{prefix}{uuid.uuid4().hex[:10]}"
    names = {
        "topic_commands": f"{tag}.commands",
        "topic_observations": f"{tag}.observations",
        "topic_events": f"{tag}.events",
        "topic_deadletter": f"{tag}.deadletter",
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
