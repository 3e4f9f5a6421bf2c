"""A command that reaches the log late (the provider outbox relaying a rotation after a long
Kafka outage) gets its launch deadline from when it entered the log, not from when it was
stored: issue "Trust, round four", item 1.

The outage itself does not need re-enacting at its length: all the processor ever sees of it
is a command whose ``occurred_at`` (the time the outbox stored it) lies before the time the
broker appended it. The pipeline test publishes exactly that at the real scale (the default
windows: grace + 600 s retries + 300 s launch, a command 30 minutes old), so it runs the path
a real outage takes, with real Kafka, PostgreSQL and the scheduler.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import factories as f
from aiokafka import ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from harness import Env, eventually, isolated_env
from pipeline_support import command, running_plane, wait_phase
from pydantic import SecretStr

from drivers.fake import FakeDriver
from events.codec import EVENTS, decode, encode
from events.decided import AgentRestarted
from events.publisher import now
from events.topics import COMMANDS
from projections.lifecycle import grace_of
from services.audit import entries, golden, timeline
from services.audit.verify import verify
from services.common.kafka_clients import kafka_client_args
from services.localstack.kafka_broker import DYNAMIC_TOPIC_CONFIG, _log_append_time
from services.processor.intake import LOG_APPEND_TIME, Parsed, entered, parse
from services.scheduler.scheduler import Scheduler

OUTAGE = timedelta(minutes=30)  # longer than the whole launch window (grace + 900 s)
WAIT = 60.0
# Launches read the attached providers' values: the vault needs its key.
KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())


def _record(timestamp: datetime, timestamp_type: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic="t", partition=0, offset=0, timestamp=int(timestamp.timestamp() * 1000),
        timestamp_type=timestamp_type, key=b"k", value=b"", checksum=None,
        serialized_key_size=1, serialized_value_size=0, headers=(),
    )  # fmt: skip


def test_a_relayed_input_takes_effect_no_earlier_than_the_broker_appended_it() -> None:
    stored = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    appended = stored + OUTAGE
    relayed_inputs = (
        f.rotate("a", occurred_at=stored),
        f.detach("a", occurred_at=stored),
        f.due("a", "ttl", stored, occurred_at=stored),
    )
    for relayed in relayed_inputs:
        assert entered(relayed, _record(appended, LOG_APPEND_TIME)).occurred_at == appended
        # A producer's own stamp (CreateTime) is no log time; a later occurred_at is kept.
        assert entered(relayed, _record(appended, 0)) is relayed
        assert entered(relayed, _record(stored - OUTAGE, LOG_APPEND_TIME)) is relayed
    # Commands stamped by their door when published, and observations, keep their time.
    for kept in (f.create("a", occurred_at=stored), f.running("a", occurred_at=stored)):
        assert entered(kept, _record(appended, LOG_APPEND_TIME)) is kept


@asynccontextmanager
async def scheduler_of(env: Env) -> AsyncIterator[Scheduler]:
    """A scheduler whose rounds the test runs itself (``round``): no race with its loop."""
    scheduler = Scheduler(env.settings, env.pool)
    await scheduler.start()
    try:
        yield scheduler
    finally:
        await scheduler.stop()


async def test_a_rotation_relayed_after_a_long_outage_restarts_the_agent_without_timing_out() -> (
    None
):
    """Old code: the restart's deadline was stored-time + grace + 900 s, 15 minutes past, so
    the scheduler's first round timed the new generation out (SandboxTimedOut, its cleanup
    stop ended it). Now the deadline counts from the append time: nothing is due, the launch
    (held in the driver meanwhile) reports, and the agent runs the new generation."""
    driver = FakeDriver()
    async with (
        isolated_env(credentials_key=KEY) as env,
        running_plane(env, driver),
        scheduler_of(env) as scheduler,
    ):
        async with await env.publisher() as pub:
            await command(env, pub, f.create("agent", providers=["gh"], occurred_at=now()))
            await wait_phase(env, "agent", "Ready", timeout=WAIT)
            held = driver.block("launch", "agent")
            stored = now() - OUTAGE
            rotation = f.rotate("agent", {"gh": 2}, actor="rotator", occurred_at=stored)
            await command(env, pub, rotation)
            await held.entered()
            appended = await _append_time(env, rotation.command_id)
            restarted = await _agent_restarted(env)
            assert restarted.deadline is not None
            limits = env.settings.lifecycle_limits
            window = grace_of(restarted.spec, limits) + limits.launch_retry_seconds
            assert limits.launch_seconds is not None
            window += limits.launch_seconds
            assert restarted.deadline.due_at == appended + timedelta(seconds=window)
            assert restarted.occurred_at == appended
            assert await scheduler.round() == 0  # nothing due: the window starts now
            held.release()
            row = await wait_phase(env, "agent", "Ready", timeout=WAIT, generation=2)
        assert row["reason"] is None or "Timeout" not in row["reason"]
        types = [
            decode(EVENTS, r.value).type for r in await env.read_topic(env.settings.topic_events)
        ]
        assert "SandboxTimedOut" not in types and types.count("AgentRestarted") == 1
        report = await verify(env.settings)  # re-deciding the log gives the same events
        assert report.divergences == [] and report.ok
        # So does the audit timeline, which re-decides the history's verbatim bodies.
        async with env.pool.acquire() as conn:
            recorded = await entries.of_sandbox(conn, "agent")
        limits = env.settings.lifecycle_limits
        steps = timeline.replay(recorded, env.settings.topic_commands, limits=limits)
        [step] = [s for s in steps if s.entry.message_type == "RotateCredentials"]
        assert step.agrees and step.state is not None
        assert step.state.deadline == restarted.deadline


async def test_an_expiry_delivered_after_a_long_outage_stops_with_the_grace_period() -> None:
    """The scheduler publishes a DeadlineDue until Kafka takes it, keeping its first time: after
    an outage it arrives 30 minutes old. Old code: the expiry's stop deadline (that time + grace
    + margin) was long past, the next round escalated the stop and the agent was killed
    without its grace period. Now the stop counts from the append time: nothing is due while
    the stop (held in the driver) runs, and it ends Stopped without a kill."""
    driver = FakeDriver()
    async with (
        isolated_env() as env,
        running_plane(env, driver),
        scheduler_of(env) as scheduler,
        await env.publisher() as pub,
    ):
        create = f.create("ttl", ttl_seconds=3600, on_expiry="stop", occurred_at=now())
        await command(env, pub, create)
        row = await wait_phase(env, "ttl", "Ready", timeout=WAIT)
        expires_at = await env.fetchval("SELECT expires_at FROM sandboxes WHERE key = 'ttl'")
        held = driver.block("stop", "ttl")
        late = f.due(
            "ttl", "ttl", expires_at, generation=row["generation"], occurred_at=now() - OUTAGE
        )
        await env.produce(
            env.settings.topic_observations, [(b"ttl", encode(late))], role="scheduler"
        )
        await held.entered()
        await wait_phase(env, "ttl", "Stopping", timeout=WAIT)
        assert await scheduler.round() == 0  # the stop's grace period and margin start now
        held.release()
        await wait_phase(env, "ttl", "Stopped", timeout=WAIT)
        events = await env.read_topic(env.settings.topic_events)
    types = [decode(EVENTS, r.value).type for r in events]
    assert "SandboxExpired" in types and "SandboxStopEscalated" not in types
    assert driver.calls_for("kill", "ttl") == []


async def _append_time(env: Env, command_id: str) -> datetime:
    """When the broker appended the command (the topic records LogAppendTime)."""
    for r in await env.read_topic(env.settings.topic_commands):
        if command_id.encode() in (r.value or b""):
            assert r.timestamp_type == LOG_APPEND_TIME
            return datetime.fromtimestamp(r.timestamp / 1000, tz=UTC)
    raise AssertionError(f"command {command_id} not in the log")


async def _agent_restarted(env: Env) -> AgentRestarted:
    found = [decode(EVENTS, r.value) for r in await env.read_topic(env.settings.topic_events)]
    (restarted,) = [e for e in found if isinstance(e, AgentRestarted)]
    return restarted


async def _own_configs(env: Env, topic: str) -> dict[str, str]:
    admin = AIOKafkaAdminClient(**kafka_client_args(env.settings, "admin"))
    await admin.start()
    try:
        [found] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        entries = found.resources[0][4]
        return {e[0]: e[1] for e in entries if e[3] == DYNAMIC_TOPIC_CONFIG}
    finally:
        await admin.close()


async def _set_configs(env: Env, topic: str, configs: dict[str, str]) -> None:
    admin = AIOKafkaAdminClient(**kafka_client_args(env.settings, "admin"))
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs)])
    finally:
        await admin.close()


async def test_topics_made_before_are_switched_to_the_append_time_keeping_their_settings() -> None:
    """An installation whose topics record CreateTime (made by an older version) gets
    LogAppendTime from the stack's topic set-up; the topic's other settings stay."""
    async with isolated_env(partitions=1) as env:
        topic = env.settings.topic_commands
        before = await _own_configs(env, topic)
        assert before["message.timestamp.type"] == "LogAppendTime"  # made with it
        older = {**before, "message.timestamp.type": "CreateTime", "retention.ms": "86400000"}
        await _set_configs(env, topic, older)
        # A change reaches the broker's view through the metadata log: poll for it.
        await eventually(lambda: _own_configs(env, topic), lambda c: c == older, what="CreateTime")
        assert await _log_append_time(env.settings) == [topic]
        switched = {**older, "message.timestamp.type": "LogAppendTime"}
        await eventually(lambda: _own_configs(env, topic), lambda c: c == switched, what="switched")
        assert await _log_append_time(env.settings) == []  # nothing left to switch


def test_a_golden_input_keeps_the_append_time_it_was_recorded_with() -> None:
    """A golden log recorded from topics with LogAppendTime replays as the processor decided
    it (a relayed rotation as of its append time); files recorded before read as CreateTime."""
    stored = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    appended = stored + OUTAGE
    body = encode(f.rotate("a", occurred_at=stored))
    ms = int(appended.timestamp() * 1000)
    recorded = golden.Input("commands", 0, 7, ms, b"a", body, LOG_APPEND_TIME)
    again = golden.Input.from_json(recorded.to_json())
    assert again == recorded and again.record().timestamp_type == LOG_APPEND_TIME
    parsed = parse(again.record(), COMMANDS, 1)
    assert isinstance(parsed, Parsed) and parsed.message.occurred_at == appended
    older = {k: v for k, v in recorded.to_json().items() if k != "timestamp_type"}
    assert golden.Input.from_json(older).record().timestamp_type == 0
    assert "timestamp_type" not in golden.Input("commands", 0, 7, ms, b"a", body).to_json()
