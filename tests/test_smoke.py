"""The real components are there: Kafka, PostgreSQL and the Podman API.

These tests fail (never skip) when a component is missing: run `make stack` first.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from podman import PodmanClient
from podman.domain.containers import Container

from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings


async def test_project_topics_exist_with_configured_partitions(settings: Settings) -> None:
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
    await admin.start()
    try:
        described = {t["topic"]: t for t in await admin.describe_topics(list(settings.topics))}
    finally:
        await admin.close()
    assert set(described) == set(settings.topics)
    for name, topic in described.items():
        assert topic["error_code"] == 0, name
        assert len(topic["partitions"]) == settings.kafka_partitions, name
        assert all(p["leader"] >= 0 for p in topic["partitions"]), name


async def test_kafka_idempotent_produce_then_consume(settings: Settings) -> None:
    topic = f"smoke-{uuid.uuid4().hex[:12]}"
    key, value = uuid.uuid4().bytes, b"hello sandstream"
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
    await admin.start()
    try:
        response = await admin.create_topics([NewTopic(topic, 1, 1)])
        assert [code for _, code, _ in response.topic_errors] == [0]
        producer = AIOKafkaProducer(
            **kafka_client_args(settings, "admin"), enable_idempotence=True, acks="all"
        )
        await producer.start()
        try:
            sent = await producer.send_and_wait(topic, value, key=key, headers=[("h", b"1")])
        finally:
            await producer.stop()

        consumer = AIOKafkaConsumer(
            **kafka_client_args(settings, "admin"), enable_auto_commit=False
        )
        await consumer.start()
        try:
            partition = TopicPartition(topic, sent.partition)
            consumer.assign([partition])
            consumer.seek(partition, sent.offset)
            record = await asyncio.wait_for(consumer.getone(), timeout=30)
        finally:
            await consumer.stop()
    finally:
        await admin.delete_topics([topic])
        await admin.close()
    assert (record.key, record.value, record.offset) == (key, value, sent.offset)
    assert list(record.headers) == [("h", b"1")]


async def test_postgres_answers_as_project_role(settings: Settings) -> None:
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        row = await conn.fetchrow(
            "SELECT current_user AS usr, current_database() AS db,"
            " current_setting('server_version_num')::int AS version,"
            " to_regclass('schema_migrations') IS NOT NULL AS migrations_table"
        )
    finally:
        await conn.close()
    assert row is not None
    assert (row["usr"], row["db"]) == (settings.pg_user, settings.pg_database)
    assert 150000 <= row["version"] < 160000
    assert row["migrations_table"], "stack up applies migrations and creates schema_migrations"


def test_podman_runs_stops_and_removes_a_container(settings: Settings) -> None:
    name = f"sandstream-smoke-{uuid.uuid4().hex[:8]}"
    with PodmanClient(base_url=settings.podman_url, timeout=60) as client:
        assert client.ping()
        container = client.containers.create(
            settings.sandbox_image,
            ["sh", "-c", "echo ready; exec sleep 300"],
            name=name,
            init=True,
            labels={"io.sandstream.test": "smoke"},
        )
        try:
            container.start()
            container.reload()
            assert container.status == "running"
            deadline = time.monotonic() + 10
            while b"ready" not in _logs(container):
                assert time.monotonic() < deadline, "container printed nothing"
                time.sleep(0.1)

            container.stop(timeout=10)
            container.reload()
            assert container.status == "exited"
            # With an init process as PID 1, SIGTERM ends `sleep` (128 + 15), not a SIGKILL
            # after the 10 s (137).
            assert container.attrs["State"]["ExitCode"] == 143
        finally:
            container.remove(force=True)
        assert client.containers.list(all=True, filters={"name": name}) == []


def _logs(container: Container) -> bytes:
    logs = container.logs(stdout=True, stderr=True)
    return logs if isinstance(logs, bytes) else b"".join(logs)
