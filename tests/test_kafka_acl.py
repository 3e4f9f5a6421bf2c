"""Kafka authentication and ACLs on the real broker (SASL/SCRAM, one principal per role).

Each role can do what its grants say and nothing else, on an isolated environment's own
topics and groups (services/localstack/kafka_auth.py grants them there as `up` does on the
real names). A write refused for want of an ACL or of valid credentials never reaches the log,
so the processor's rows and history stay as they were.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import factories as f
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    TopicAuthorizationFailedError,
)
from harness import Env, eventually, isolated_env
from pipeline_support import command, history, row

from events.codec import encode
from events.publisher import CommandPublisher
from services.common.kafka_clients import ROLES, Role, kafka_client_args
from services.common.settings import Settings
from services.localstack import kafka_auth

PRODUCT_ROLES = [r for r in ROLES if r != "admin"]
READ, WRITE = "read", "write"


def granted(settings: Settings) -> set[tuple[str, str, str]]:
    """(role, topic, read|write) for every topic grant the roles have."""
    ops = {kafka_auth.AclOperation.READ: READ, kafka_auth.AclOperation.WRITE: WRITE}
    return {
        (g.role, g.name, ops[g.operation])
        for g in kafka_auth.role_grants(settings)
        if g.resource == kafka_auth.ResourceType.TOPIC and g.operation in ops
    }


async def can_write(settings: Settings, role: Role, topic: str) -> bool:
    # Not idempotent, so that only the topic's own ACL decides (an idempotent producer's
    # InitProducerId needs Write on some topic first).
    producer = AIOKafkaProducer(**kafka_client_args(settings, role), acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"probe", key=b"probe", partition=0)
    except TopicAuthorizationFailedError:
        return False
    finally:
        await producer.stop()
    return True


async def can_read(settings: Settings, role: Role, topic: str) -> bool:
    """Whether ``role`` gets the records of partition 0 of ``topic`` (which holds some)."""
    consumer = AIOKafkaConsumer(
        **kafka_client_args(settings, role), enable_auto_commit=False, group_id=None
    )
    await consumer.start()
    try:
        if topic not in await consumer.topics():  # not even Describe: the broker hides it
            return False
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        records = await eventually(
            lambda: consumer.getmany(tp, timeout_ms=200),
            lambda batch: bool(batch),
            what=f"{role} reading {topic}",
        )
        return bool(records[tp])
    except TopicAuthorizationFailedError:
        return False
    finally:
        await consumer.stop()


async def fill_partition_zero(env: Env) -> None:
    for topic in env.settings.topics:
        await env.produce_to(topic, 0, b"seed", b"seed")


async def test_each_role_can_write_and_read_exactly_the_topics_granted_to_it() -> None:
    async with isolated_env(partitions=1) as env:
        s = env.settings
        await fill_partition_zero(env)
        expected = granted(s)
        found = set()
        for role in PRODUCT_ROLES:
            for topic in s.topics:
                if await can_write(s, role, topic):
                    found.add((role, topic, WRITE))
                if await can_read(s, role, topic):
                    found.add((role, topic, READ))
        assert found == expected
        # The requirement, spelled out: who may write what.
        writers = {t: {r for r, topic, op in found if topic == t and op == WRITE} for t in s.topics}
        assert writers == {
            # a claim's next step (processor), a pool's members (scheduler: its pool controller)
            s.topic_commands: {"api", "provider-sync", "processor", "scheduler"},
            s.topic_observations: {"executor", "watcher", "scheduler"},
            s.topic_events: {"processor"},
            s.topic_deadletter: {"processor"},
            s.topic_checkpoints: {"processor"},
        }


async def commit_as(settings: Settings, role: Role, group: str, topic: str) -> None:
    consumer = AIOKafkaConsumer(
        **kafka_client_args(settings, role), group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.commit({tp: 0})
    finally:
        await consumer.stop()


async def test_a_consumer_group_is_usable_by_its_own_role_only() -> None:
    async with isolated_env(partitions=1) as env:
        s = env.settings
        await commit_as(s, "processor", s.processor_group, s.topic_commands)
        await commit_as(s, "executor", s.executor_group, s.topic_events)
        with pytest.raises(GroupAuthorizationFailedError):
            await commit_as(s, "executor", s.processor_group, s.topic_events)
        with pytest.raises(GroupAuthorizationFailedError):
            await commit_as(s, "processor", s.executor_group, s.topic_commands)


def as_user(settings: Settings, role: Role, **changes: Any) -> dict[str, Any]:
    return kafka_client_args(settings, role) | changes


async def refused_publish(client: dict[str, Any], topic: str, message: Any) -> BaseException:
    """Publish ``message`` as ``client`` and return the error it was refused with."""
    producer = AIOKafkaProducer(**client, enable_idempotence=True, acks="all")
    try:
        await producer.start()
        await producer.send_and_wait(topic, encode(message), key=message.key.encode())
    except (
        TopicAuthorizationFailedError,
        ClusterAuthorizationFailedError,  # may write no topic at all: no producer id either
        KafkaConnectionError,  # authentication failed, or no SASL: the broker hangs up
    ) as exc:
        return exc
    finally:
        await producer.stop()
    raise AssertionError(f"{message.type} to {topic} was accepted")


async def test_a_refused_writer_changes_nothing_in_the_log_or_the_fold() -> None:
    # One partition: once the marker is decided, everything the log held before it is too.
    async with isolated_env(partitions=1) as env:
        s = env.settings
        await env.start_processor()
        target, marker = f.create("target"), f.create("marker")
        async with CommandPublisher(kafka_client_args(s, "api"), s.topic_commands) as pub:
            await command(env, pub, target)
            before = (await row(env, "target"), await history(env, "target"))
            forged_delete = f.delete("target", actor="someone-else")
            forged_removal = f.removed("target")
            attempts = [
                (as_user(s, "watcher"), s.topic_commands, forged_delete),
                (as_user(s, "executor"), s.topic_commands, forged_delete),
                (as_user(s, "api"), s.topic_observations, forged_removal),
                (as_user(s, "audit"), s.topic_observations, forged_removal),
                (as_user(s, "api", sasl_plain_username="nobody"), s.topic_commands, forged_delete),
                (as_user(s, "api", sasl_plain_password="wrong"), s.topic_commands, forged_delete),
                (as_user(s, "api", security_protocol="PLAINTEXT"), s.topic_commands, forged_delete),
            ]
            errors = [type(await refused_publish(*a)) for a in attempts]
            await command(env, pub, marker)
        assert errors == [
            *[TopicAuthorizationFailedError] * 3,
            ClusterAuthorizationFailedError,
            *[KafkaConnectionError] * 3,
        ]
        assert (await row(env, "target"), await history(env, "target")) == before
        commands = await env.read_topic(s.topic_commands)
        assert [r.value for r in commands] == [encode(target), encode(marker)]
        assert await env.read_topic(s.topic_observations) == []


async def test_the_credentials_file_is_private_and_holds_every_role(settings: Settings) -> None:
    """What `up` wrote for the local stack: mode 0600, a distinct password per role."""
    path = settings.kafka_credentials_path
    assert path.stat().st_mode & 0o777 == 0o600
    users = kafka_auth.load_credentials(settings)
    assert set(users) == set(ROLES)
    assert len({c.password for c in users.values()}) == len(ROLES)
    assert len({c.username for c in users.values()}) == len(ROLES)


async def test_the_broker_files_keep_passwords_off_command_lines_and_world_readable_files(
    settings: Settings,
) -> None:
    admin = kafka_auth.load_credentials(settings)["admin"]
    paths = kafka_auth.kafka_paths(settings)
    assert kafka_auth.jaas_path(settings).stat().st_mode & 0o777 == 0o600
    assert not (paths.home / "format.args").exists()
    for readable in (paths.properties, paths.log, paths.format_log):
        assert admin.password not in readable.read_text()
    pid = int(paths.pid.read_text())
    cmdline = await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_bytes)
    assert admin.password.encode() not in cmdline
    assert b"-Djava.security.auth.login.config=" in cmdline
