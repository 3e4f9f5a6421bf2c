"""The fold never stalls on a record's size: a dead letter always fits in a Kafka record, and
what Kafka refuses for good is never taken for a lost broker.

On the real broker (its ``message.max.bytes`` is read, not assumed): records of 0.9 MiB and just
under the broker's limit, not UTF-8, are dead-lettered as an excerpt with the original's size
and SHA-256 while later commands go on being decided; records of 1.0 and 1.3 MiB are refused
at produce time, and the test checks what the producer sees.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any

import factories as f
import pytest
from aiokafka import AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    CorruptRecordException,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from confluent_kafka.admin import (
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)
from harness import Env, eventually, isolated_env
from test_input_edges import key_on

from events.codec import encode
from events.deadletter import (
    KEY_BYTES,
    MAX_BYTES,
    REASON_CHARS,
    VALUE_BYTES,
    dead_letter,
    excerpt,
    record_key,
)
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack import kafka_auth
from services.processor.failures import PublishRefused, backend_lost
from services.processor.intake import Rejected, parse

MIB = 1024 * 1024


async def broker_max_bytes(env: Env) -> int:
    """The commands topic's ``max.message.bytes``: the largest record batch the broker takes
    on it (the broker's ``message.max.bytes`` unless the topic sets its own)."""
    admin = AIOKafkaAdminClient(**kafka_client_args(env.settings, "admin"))
    await admin.start()
    try:
        [found] = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, env.settings.topic_commands)]
        )
        entries = found.to_object()["resources"][0]["config_entries"]
        [value] = [e["config_value"] for e in entries if e["config_names"] == "max.message.bytes"]
        return int(value)
    finally:
        await admin.close()


def largest_value(key: bytes, limit: int) -> int:
    """The largest value a record of ``key`` may have for its batch to be at most ``limit``
    bytes (aiokafka's estimate of a batch of one record is an upper bound)."""
    return limit - DefaultRecordBatchBuilder.estimate_size_in_bytes(key, b"", [])


def not_utf8(size: int) -> bytes:
    """``size`` bytes that are no UTF-8 text (0xff never occurs in UTF-8)."""
    return (b"\xff\xfe" * (size // 2 + 1))[:size]


async def big_producer(env: Env, max_request_size: int) -> AIOKafkaProducer:
    producer = AIOKafkaProducer(
        **kafka_client_args(env.settings, "admin"), acks="all", max_request_size=max_request_size
    )
    await producer.start()
    return producer


async def history_at(env: Env, topic: str, partition: int, offset: int) -> dict[str, Any] | None:
    rows = await env.fetch(
        'SELECT * FROM history WHERE topic = $1 AND partition = $2 AND "offset" = $3',
        topic, partition, offset,
    )  # fmt: skip
    return dict(rows[0]) if rows else None


@pytest.mark.parametrize("size", ["0.9 MiB", "just under the broker's limit"])
async def test_a_huge_record_that_is_not_utf8_is_dead_lettered_and_later_commands_are_decided(
    size: str,
) -> None:
    """Found from outside: such a record was dead-lettered whole, as base64 (a third larger
    than the broker takes), the send was refused and taken for a lost broker, and nothing was
    decided any more. The dead letter must fit, and every later command be decided."""
    async with isolated_env(partitions=2) as env:
        limit = await broker_max_bytes(env)
        key = b"huge"
        length = int(0.9 * MIB) if size == "0.9 MiB" else largest_value(key, limit)
        value = not_utf8(length)
        topic = env.settings.topic_commands
        producer = await big_producer(env, 2 * limit)
        try:
            sent = await producer.send_and_wait(topic, value=value, key=key)
        finally:
            await producer.stop()
        await env.start_processor()
        refused = await eventually(
            lambda: history_at(env, topic, sent.partition, sent.offset),
            lambda h: h is not None,
            what="the huge record's history entry",
        )
        assert refused is not None and refused["disposition"] == "dead-lettered"
        # Later commands, of a sandbox on each partition, are decided.
        later = [key_on(p, 2, "after") for p in (0, 1)]
        await env.produce(topic, [(k.encode(), encode(f.create(k, command_id=k))) for k in later])
        await env.wait_applied(3)
        rows = await env.fetch("SELECT key, phase FROM sandboxes ORDER BY key")
        assert [(r["key"], r["phase"]) for r in rows] == [(k, "Provisioning") for k in later]
        letters = await eventually(
            lambda: env.read_topic(env.settings.topic_deadletter),
            lambda found: len(found) == 1,
            what="the dead letter on its topic",
        )
        letter = json.loads(letters[0].value)
        assert letter["source"] | {"timestamp": None} == {
            "topic": topic, "partition": sent.partition, "offset": sent.offset, "timestamp": None,
        }  # fmt: skip
        assert letter["value"]["size"] == length
        assert letter["value"]["sha256"] == hashlib.sha256(value).hexdigest()
        assert letter["value"]["truncated"] and letter["value"]["encoding"] == "base64"
        assert len(letters[0].value) < 16 * 1024
        assert letters[0].key == key


@pytest.mark.parametrize("size", [1.0, 1.3])
async def test_a_record_above_the_broker_limit_is_refused_to_the_producer_and_changes_nothing(
    size: float,
) -> None:
    """1.0 MiB (a batch of one such record is above the default ``message.max.bytes``) and 1.3
    MiB: the producer's own check refuses them (``max_request_size``, 1 MiB by default); with
    that check raised, the broker refuses them. Either way the producer is told the record is
    too large, nothing reaches the topic, and the processor goes on."""
    async with isolated_env(partitions=2) as env:
        limit = await broker_max_bytes(env)
        value = not_utf8(int(size * MIB))
        assert DefaultRecordBatchBuilder.estimate_size_in_bytes(b"k", value, []) > limit
        topic = env.settings.topic_commands
        await env.start_processor()
        default = await big_producer(env, 1024 * 1024)  # aiokafka's (and Java's) default
        raised = await big_producer(env, 4 * limit)
        try:
            with pytest.raises(MessageSizeTooLargeError, match="max_request_size"):
                await default.send(topic, value=value, key=b"k")
            with pytest.raises(MessageSizeTooLargeError) as by_broker:
                await raised.send_and_wait(topic, value=value, key=b"k")
            assert by_broker.value.errno == 10  # MESSAGE_TOO_LARGE, the broker's answer
        finally:
            await default.stop()
            await raised.stop()
        later = key_on(0, 2, "after")
        await env.produce(topic, [(later.encode(), encode(f.create(later, command_id="c")))])
        await env.wait_applied(1)
        assert [r.offset for r in await env.read_topic(topic)] == [0]  # only the later one


# ---------------------------------------------------------------------------------------------
# The one builder: small whatever the record holds


def test_a_dead_letter_is_small_whatever_the_record_holds() -> None:
    """The worst case: key, value and reason of characters JSON escapes to six bytes each, on
    a topic with the longest name Kafka allows."""
    worst = "\x01" * MIB
    letter = dead_letter(
        worst, "t" * 249, 2**31 - 1, 2**63 - 1, f.T0, worst.encode(), worst.encode()
    )
    assert len(encode(letter)) <= MAX_BYTES
    assert record_key(worst.encode()) == worst.encode()[:KEY_BYTES]
    assert letter.value is not None and letter.value.size == MIB and letter.value.truncated
    assert letter.value.sha256 == hashlib.sha256(worst.encode()).hexdigest()
    assert letter.reason.endswith("…") and len(letter.reason) == REASON_CHARS


def test_an_excerpt_keeps_whole_characters_and_says_how_it_is_written() -> None:
    text = ("a" + "é" * VALUE_BYTES).encode()  # byte VALUE_BYTES splits an é
    cut = excerpt(text, VALUE_BYTES)
    assert cut is not None and cut.encoding == "utf-8" and cut.truncated
    assert cut.text == "a" + "é" * ((VALUE_BYTES - 1) // 2)
    whole = excerpt(b"\xff\x00", VALUE_BYTES)
    assert whole is not None and (whole.text, whole.encoding, whole.truncated) == (
        "/wA=", "base64", False,
    )  # fmt: skip
    assert excerpt(None, VALUE_BYTES) is None


# ---------------------------------------------------------------------------------------------
# What no retry can fix is never "Kafka lost"


@pytest.mark.parametrize(
    "refusal",
    [MessageSizeTooLargeError(), CorruptRecordException(), TopicAuthorizationFailedError()],
)
def test_a_refusal_no_retry_can_fix_is_not_a_lost_broker(refusal: Exception) -> None:
    try:
        raise RuntimeError("publishing the outbox failed") from refusal
    except RuntimeError as wrapped:
        assert backend_lost(wrapped) is None
    assert backend_lost(refusal) is None
    assert backend_lost(KafkaTimeoutError()) == "Kafka"  # a send not acknowledged: waiting helps


def test_parse_refuses_a_record_above_the_input_limit_undecoded() -> None:
    record = ConsumerRecord("c", 0, 0, 0, 0, b"k", b"{" * 11, None, 1, 11, [])
    item = parse(record, "c", 1, max_bytes=10)
    assert isinstance(item, Rejected)
    assert item.reason.startswith("record value is 11 bytes, above the 10 the processor decides")


# ---------------------------------------------------------------------------------------------
# What the processor decides fits; what could still not fit is set aside, not waited for


def create_of_size(key: str, size: int) -> bytes:
    """A valid CreateSandbox of exactly ``size`` bytes (its environment filled up)."""
    env: dict[str, str] = {}
    while True:
        encoded = encode(f.create(key, command_id=key, sandbox_spec=f.spec(env=env)))
        missing = size - len(encoded)
        if missing == 0:
            return encoded
        name = f"V{len(env)}"
        grow = min(10_000, missing - len(f'"{name}":"",'))
        assert grow >= 0, "overshot"
        env[name] = "x" * grow


async def test_a_command_above_the_input_limit_is_dead_lettered_and_one_at_it_is_published() -> (
    None
):
    """A valid 0.9 MiB create is refused at intake (its events would leave no room in a record
    for what they add); one of exactly the limit is decided and its event reaches the topic."""
    async with isolated_env(partitions=1) as env:
        limit = env.settings.processor_max_input_bytes
        assert int(0.9 * MIB) > limit
        topic = env.settings.topic_commands
        producer = await big_producer(env, 2 * MIB)
        try:
            for key, size in (("big", int(0.9 * MIB)), ("at-limit", limit)):
                await producer.send_and_wait(
                    topic, value=create_of_size(key, size), key=key.encode()
                )
        finally:
            await producer.stop()
        await env.start_processor()
        await env.wait_applied(2)
        history = await env.fetch('SELECT key, disposition, reason FROM history ORDER BY "offset"')
        assert [(h["key"], h["disposition"]) for h in history] == [
            ("big", "dead-lettered"), ("at-limit", "applied"),
        ]  # fmt: skip
        assert history[0]["reason"].startswith(f"record value is {int(0.9 * MIB)} bytes")
        events = await eventually(
            lambda: env.read_topic(env.settings.topic_events),
            lambda found: len(found) == 1,
            what="the event of the create at the limit",
        )
        assert (
            events[0].key == b"at-limit" and json.loads(events[0].value)["type"] == "SandboxCreated"
        )
        assert len(events[0].value) <= env.settings.kafka_max_record_bytes


async def test_an_event_too_large_to_send_is_set_aside_and_everything_after_it_is_published(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An event above the largest record the processor sends (a sandbox with a spec near the
    input limit and hundreds of providers; here the record limit is lowered instead) is set
    aside: recorded, counted, never sent; the cursor moves past it and nothing waits for it."""
    caplog.set_level(logging.INFO, logger="sandstream.processor")
    async with isolated_env(partitions=1, kafka_max_record_bytes=64 * 1024) as env:
        big = f.create("big", command_id="c-big", sandbox_spec=f.spec(env={
            f"V{i}": "x" * 10_000 for i in range(8)
        }))  # fmt: skip
        async with await env.publisher() as pub:
            await pub.publish_many([f.create("a", command_id="c-a"), big])
            await env.start_processor()
            await env.wait_applied(2)
            await pub.publish_many([f.create("c", command_id="c-c"), f.stop("big", command_id="s")])
            await env.wait_applied(4)
        events = await eventually(
            lambda: env.read_topic(env.settings.topic_events),
            lambda found: len(found) == 3,
            what="every event but the one set aside",
        )
        assert [(e.key, json.loads(e.value)["type"]) for e in events] == [
            (b"a", "SandboxCreated"), (b"c", "SandboxCreated"), (b"big", "SandboxStopping"),
        ]  # fmt: skip
        [aside] = await env.fetch("SELECT * FROM outbox_set_aside")
        outbox = await env.fetch(
            "SELECT id, key, length(value) AS size FROM outbox WHERE topic = $1 ORDER BY id",
            env.settings.topic_events,
        )
        assert (aside["outbox_id"], aside["key"]) == (outbox[1]["id"], b"big")
        assert aside["size"] == outbox[1]["size"] + 3 > 64 * 1024
        assert "SANDSTREAM_KAFKA_MAX_RECORD_BYTES" in aside["reason"]
        newest = await env.fetchval("SELECT max(id) FROM outbox")
        await eventually(
            lambda: env.fetchval("SELECT published_id FROM outbox_cursor"),
            lambda at: at == newest,
            what="the cursor past every record",
        )
        assert "lost Kafka" not in caplog.text
        logged = f"outbox record {aside['outbox_id']} ({env.settings.topic_events}"
        assert logged in caplog.text


async def test_a_topic_the_processor_may_not_write_stops_it_loudly_rather_than_waiting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No ACL to write the dead-letter topic: no retry fixes that, so the processor stops with
    PublishRefused naming the cause (its batch committed, published by the next run once an
    operator grants the ACL), instead of waiting for a broker that is not gone."""
    caplog.set_level(logging.INFO, logger="sandstream.processor")
    async with isolated_env(partitions=1) as env:
        s = env.settings
        await asyncio.to_thread(drop_grant, s, "processor", s.topic_deadletter)
        await env.produce(s.topic_commands, [(b"x", b"not json")])
        processor = await env.start_processor()
        [(_, _, task)] = env.processors
        await eventually(lambda: task.done(), bool, timeout=60, what="the processor to stop")
        env.processors.clear()
        await processor.stop()
        with pytest.raises(PublishRefused, match="TopicAuthorizationFailedError"):
            task.result()
        assert await env.fetchval("SELECT disposition FROM history") == "dead-lettered"
        assert "lost Kafka" not in caplog.text


def drop_grant(settings: Settings, role: str, topic: str) -> None:
    """Delete ``role``'s ACLs on ``topic`` (kafka_auth.grant made them) and wait until the
    broker no longer lists them."""
    [user] = [u for r, u in kafka_auth.usernames(settings).items() if r == role]
    only = AclBindingFilter(
        ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, f"User:{user}", "*",
        AclOperation.ANY, AclPermissionType.ANY,
    )  # fmt: skip
    kafka_auth.delete_acls(settings, [only])
