"""Kafka refusing the API's commands for want of an ACL (real broker, real ACLs: the API
principal's grant on the commands topic is deleted, then granted again) is not a lost broker:
the HTTP API answers 500 KAFKA_FORBIDDEN and the OpenShell door INTERNAL, never the retryable
503 or UNAVAILABLE, naming the topic and the principal and saying the command was not
accepted; once the ACL is granted again a retry with the same command id publishes it once,
also on the partition of the refused batch and for a principal whose only Write ACL it was.
A provider change's commands wait in the provider outbox meanwhile and the API's own relay
sends them once the ACL is back."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import apikit
import factories as f
import grpc
import pytest
from aiokafka import AIOKafkaClient
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError
from apikit import create_body, unique
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)
from harness import eventually, isolated_env
from pydantic import SecretStr
from test_dead_letters import drop_grant
from test_openshell_handlers import create_call, door_channel, failure

from drivers.fake import FakeDriver
from events.publisher import (
    CommandPublisher,
    RenewingProducer,
    now,
    publish_observation,
    publish_until_sent,
)
from services.api import provider_outbox
from services.api.gateway import CommandGateway
from services.api.readmodel import ChangeFeed
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack import kafka_auth


async def test_an_acl_refusal_is_500_kafka_forbidden_and_a_retry_after_the_grant_works() -> None:
    """The refused command goes to the partition the producer wrote just before: the retry after
    the grant is published there (aiokafka's idempotent producer does not roll back the
    sequence number of a refused batch, so without a new producer the broker would refuse every
    later batch of that partition as out of order)."""
    async with apikit.running_api(None) as api, api.client() as c:
        s = api.env.settings
        user = kafka_auth.usernames(s)["api"]
        name = unique("acl")
        before = await c.post("/v1/sandboxes", json=create_body(name))
        assert before.status_code == 202
        await asyncio.to_thread(drop_grant, s, "api", s.topic_commands)
        stop = {"command_id": "c-forbidden"}
        refused = await c.post(f"/v1/sandboxes/{name}:stop", json=stop)
        assert refused.status_code == 500, refused.text
        answer = refused.json()
        assert answer["code"] == "KAFKA_FORBIDDEN" and answer["command_id"] == "c-forbidden"
        message = answer["message"]
        assert message.startswith(
            f"Kafka refused command 'c-forbidden': User:{user} lacks the ACL Write on topic "
            f"{s.topic_commands!r} (TopicAuthorizationFailedError)."
        )
        assert "was not accepted" in message and "operator" in message
        unknown = await c.get("/v1/commands/c-forbidden")
        assert unknown.status_code == 404  # not published
        ready = await c.get("/readyz")
        assert ready.status_code == 503
        kafka = ready.json()["checks"]["kafka"]
        assert kafka["ok"] is False
        assert kafka["detail"].endswith(
            f"; the last command was refused: User:{user} lacks the ACL Write on topic "
            f"{s.topic_commands!r} (TopicAuthorizationFailedError)"
        )
        await asyncio.to_thread(kafka_auth.grant, s)
        retried = await c.post(f"/v1/sandboxes/{name}:stop", json=stop)
        assert retried.status_code == 202, retried.text
        assert retried.json()["command_id"] == "c-forbidden"
        after = await c.post(f"/v1/sandboxes/{name}:start")
        assert after.status_code == 202, after.text
        assert await api.commands_published() == 3
        await eventually(lambda: c.get("/readyz"), lambda r: r.status_code == 200,
                         what="ready again once the ACL is back")  # fmt: skip


async def test_a_command_kafka_refuses_by_acl_is_internal_at_the_openshell_door() -> None:
    async with (
        isolated_env(partitions=1) as env,
        CommandPublisher(
            kafka_client_args(env.settings, "api"), topic=env.settings.topic_commands
        ) as publisher,
    ):
        s = env.settings
        user = kafka_auth.usernames(s)["api"]
        await asyncio.to_thread(drop_grant, s, "api", s.topic_commands)
        gateway = CommandGateway(env.pool, publisher, ChangeFeed(env.pool))
        async with door_channel(s, env.pool, gateway, outcome_wait=0.5) as channel:
            refused = await failure(create_call(channel, "req-forbidden"))
            assert refused.code() == grpc.StatusCode.INTERNAL
            details = refused.details() or ""
            assert "'req-forbidden'" in details and "TopicAuthorizationFailedError" in details
            assert f"User:{user} lacks the ACL Write on topic {s.topic_commands!r}" in details
            assert "was not accepted" in details
            await asyncio.to_thread(kafka_auth.grant, s)
            # Published now; no processor decides it, so the door says it is pending.
            pending = await failure(create_call(channel, "req-forbidden"))
        assert pending.code() == grpc.StatusCode.UNAVAILABLE
        assert "published but not decided" in (pending.details() or "")
        assert len(await env.read_topic(s.topic_commands)) == 1


async def test_a_principal_with_no_write_left_stays_refused_then_publishes_once_granted() -> None:
    """As in production, the principal's only Write is on the commands topic: without it Kafka
    also refuses it an idempotent producer (ClusterAuthorizationFailedError when the refused
    producer is replaced), still INTERNAL naming the ACL; once granted, the retry is published."""
    async with isolated_env(partitions=1) as env, own_principal(env.settings) as (user, args):
        s = env.settings
        grant = write_acl(s.topic_commands, user)
        async with CommandPublisher(args, topic=s.topic_commands) as publisher:
            gateway = CommandGateway(env.pool, publisher, ChangeFeed(env.pool))
            async with door_channel(s, env.pool, gateway, outcome_wait=0.1) as channel:
                first = await failure(create_call(channel, "req-first"))
                assert "published but not decided" in (first.details() or "")
                await asyncio.to_thread(change_acls, s, delete=grant)
                refused = await failure(create_call(channel, "req-then"))
                assert refused.code() == grpc.StatusCode.INTERNAL
                assert "TopicAuthorizationFailedError" in (refused.details() or "")
                again = await failure(create_call(channel, "req-then"))
                assert again.code() == grpc.StatusCode.INTERNAL
                assert (
                    f"User:{user} lacks the ACL IdempotentWrite on the cluster (or Write on topic "
                    f"{s.topic_commands!r}) (ClusterAuthorizationFailedError)"
                ) in (again.details() or "")
                await asyncio.to_thread(change_acls, s, create=grant)
                published = await failure(create_call(channel, "req-then"))
                assert "published but not decided" in (published.details() or "")
        assert len(await env.read_topic(s.topic_commands)) == 2


async def test_a_rotation_kafka_refuses_by_acl_waits_in_the_outbox_and_the_relay_sends_it() -> None:
    key = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
    settings = {"credentials_key": key, "provider_outbox_seconds": 0.2}
    p, name = unique("acl-p"), unique("acl-r")
    async with apikit.running_api(FakeDriver(), settings_update=settings) as api, api.client() as c:
        env, s = api.env, api.env.settings
        async with await env.publisher() as publisher:
            await publisher.publish(f.create(name, providers=[p], occurred_at=now()))
        await api.wait_phase(name, "Ready")
        r = await c.post("/v1/providers", json={"name": p, "credentials": {"K": "one"}})
        assert r.status_code == 201, r.text
        await asyncio.to_thread(drop_grant, s, "api", s.topic_commands)
        r = await c.put(f"/v1/providers/{p}/credentials", json={"credentials": {"K": "two"}})
        assert r.status_code == 200, r.text  # the values are stored; the restart is owed
        [line] = r.json()["sandboxes"]
        assert (line["action"], line["delivery"]) == ("restart", "pending")
        stored = await eventually(
            lambda: env.fetch("SELECT attempts, last_error FROM provider_outbox"),
            lambda rows: len(rows) == 1 and rows[0]["attempts"] >= 2,
            what="the relay trying the stored restart again",
        )
        assert "TopicAuthorizationFailedError" in stored[0]["last_error"]
        await asyncio.to_thread(kafka_auth.grant, s)
        await eventually(lambda: provider_outbox.pending(env.pool), lambda n: n == 0,
                         what="the relay sending the restart once the ACL is back")  # fmt: skip
        await eventually(
            lambda: env.fetchval("SELECT generation FROM sandboxes WHERE key = $1", name),
            lambda generation: generation == 2,
            what=f"{name} restarted with the new values",
        )


def write_acl(topic: str, user: str) -> AclBinding:
    return AclBinding(
        ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, f"User:{user}", "*",
        AclOperation.WRITE, AclPermissionType.ALLOW,
    )  # fmt: skip


def change_acls(
    settings: Settings, *, create: AclBinding | None = None, delete: AclBinding | None = None
) -> None:
    """Create or delete one ACL, and return once the broker lists it so (it then enforces it)."""
    admin = AdminClient(kafka_auth.admin_config(settings))
    if create is not None:
        for future in admin.create_acls([create]).values():
            future.result(timeout=30)
        kafka_auth.wait_until_described(
            lambda: admin.describe_acls(kafka_auth.EVERY_ACL).result(30), [create]
        )
    if delete is not None:
        kafka_auth.delete_acls(settings, [kafka_auth.matching(delete)])


async def test_an_observation_refused_by_acl_is_sent_once_the_acl_is_granted_again() -> None:
    """The watcher's, the executor's and the scheduler's producer. After a refused batch,
    aiokafka's idempotent producer had the broker refuse every later one on that partition as
    out of order (OutOfOrderSequenceNumber): the role retried a report forever after the grant,
    and never delivered it until it restarted. The refused producer is replaced before the next
    send."""
    async with isolated_env(partitions=1) as env:
        s = env.settings
        producer = RenewingProducer(kafka_client_args(s, "watcher"))
        await producer.start()
        try:
            first = f.running("k1")
            await publish_observation(producer, s.topic_observations, first)
            await asyncio.to_thread(drop_grant, s, "watcher", s.topic_observations)
            refused = f.running("k1", generation=2)
            for _ in range(2):  # a role retries (one refusal alone did not wedge it here)
                with pytest.raises(TopicAuthorizationFailedError):
                    await publish_observation(producer, s.topic_observations, refused)
            await asyncio.to_thread(kafka_auth.grant, s)
            sent = publish_until_sent(producer, s.topic_observations, refused)
            assert await asyncio.wait_for(sent, 30) is True
        finally:
            await producer.stop()
        ids = [json.loads(r.value)["observation_id"] for r in await env.read_topic(
            s.topic_observations
        )]  # fmt: skip
        assert ids == [first.observation_id, refused.observation_id]


@asynccontextmanager
async def own_principal(settings: Settings) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A SCRAM user of the test's own with Write on the commands topic and nothing else (the
    shared ``api`` user has Write on every test's topics, which would let it produce
    idempotently anyway), and client arguments that log in as it. Removed afterwards."""
    user, password = f"sandstream-test-{secrets.token_hex(4)}", secrets.token_hex(16)
    admin = AdminClient(kafka_auth.admin_config(settings))
    scram = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, kafka_auth.SCRAM_ITERATIONS)
    upsert = UserScramCredentialUpsertion(user, scram, password.encode())
    for future in admin.alter_user_scram_credentials([upsert]).values():
        future.result(timeout=30)
    grant = write_acl(settings.topic_commands, user)
    await asyncio.to_thread(change_acls, settings, create=grant)
    args = kafka_client_args(settings, "api")
    args |= {"sasl_plain_username": user, "sasl_plain_password": password}
    try:
        await eventually(lambda: logs_in(args), bool, what=f"{user} to log in")
        yield user, args
    finally:
        await asyncio.to_thread(change_acls, settings, delete=grant)
        gone = UserScramCredentialDeletion(user, ScramMechanism.SCRAM_SHA_512)
        for future in admin.alter_user_scram_credentials([gone]).values():
            future.result(timeout=30)


async def logs_in(args: dict[str, Any]) -> bool:
    """Whether a client logs in with ``args`` (a new SCRAM user is known to the broker a moment
    after the controller took it)."""
    client = AIOKafkaClient(**args)
    try:
        await client.bootstrap()
    except KafkaError:
        return False
    finally:
        await client.close()
    return True
