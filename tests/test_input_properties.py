"""Arbitrary bytes and JSON on both input topics, on the real stack: the processor stays alive
and records every input exactly once, applied (or rejected, ignored, ...) or dead-lettered.

Hypothesis draws the records (derandomized: the same ones on every run); they are produced in
one go to one environment, since a fresh Kafka and PostgreSQL environment per example would
cost seconds each.
"""

from __future__ import annotations

import json
from typing import Any

import factories as f
from harness import Env, eventually, isolated_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.codec import encode
from services.common.kafka_clients import kafka_client_args

PARTITIONS = 2
NAMES = ["p-a", "p-b", "p-c"]

# Any code point, lone surrogates and NUL included (json.dumps escapes them).
any_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, categories=None),
                   max_size=12)  # fmt: skip
# What PostgreSQL cannot store, drawn often enough to matter among the arbitrary rest.
awkward_text = st.sampled_from(["\x00", "a\x00b", "\ud800", "x\udfff", "\uffff", ""]) | any_text
awkward_ints = st.sampled_from([2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64]) | st.integers()
awkward_keys = st.sampled_from([b"\x00", b"p-a\x00", b"\xff\xfe", b""]) | st.binary(max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=6,
)


def valid_bodies(name: str) -> list[dict[str, Any]]:
    messages = [
        f.create(name), f.start(name), f.stop(name), f.delete(name), f.running(name, 1),
        f.exited(name, 1, exit_code=3), f.failed(name, 1, reason="r"), f.launched(name, 1),
    ]  # fmt: skip
    return [json.loads(encode(m)) for m in messages]


@st.composite
def values(draw: st.DrawFn, name: str) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "valid", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    body = draw(st.sampled_from(valid_bodies(name)))
    if kind == "mutated":
        fields = [*sorted(body), "spec.image", "spec.env", "spec.command", "spec.labels"]
        field = draw(st.sampled_from(fields))
        target = body.get("spec") if field.startswith("spec.") else body
        if isinstance(target, dict):
            name = field.removeprefix("spec.")
            value = draw(awkward_text | awkward_ints | json_values)
            if name in ("env", "labels"):
                value = {draw(st.sampled_from(["A", "team"])): value}
            elif name == "command":
                value = [value]
            target[name] = value
    return json.dumps(body).encode()


@st.composite
def records(draw: st.DrawFn) -> tuple[bool, bytes | None, bytes, int | None]:
    """(to the commands topic?, key, value, explicit partition or None for the partitioner)."""
    name = draw(st.sampled_from(NAMES))
    key = draw(st.sampled_from([name.encode(), None]) | awkward_keys)
    partition = draw(st.none() | st.integers(0, PARTITIONS - 1))
    return draw(st.booleans()), key, draw(values(name)), partition


def drawn(count: int) -> list[tuple[bool, bytes | None, bytes, int | None]]:
    out: list[tuple[bool, bytes | None, bytes, int | None]] = []

    @settings(max_examples=count, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(records())
    def collect(record: tuple[bool, bytes | None, bytes, int | None]) -> None:
        out.append(record)

    collect()
    return out


async def produce(
    env: Env, drawn_records: list[tuple[bool, bytes | None, bytes, int | None]]
) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(**kafka_client_args(env.settings, "admin"), acks="all",
                                enable_idempotence=True)  # fmt: skip
    await producer.start()
    try:
        futures = []
        for to_commands, key, value, partition in drawn_records:
            topic = env.settings.topic_commands if to_commands else env.settings.topic_observations
            futures.append(await producer.send(topic, value=value, key=key, partition=partition))
        for future in futures:
            await future
    finally:
        await producer.stop()


async def test_arbitrary_records_on_both_topics_are_each_applied_or_dead_lettered_once() -> None:
    inputs = drawn(200)
    async with isolated_env(partitions=PARTITIONS) as env:
        await env.start_processor()
        await produce(env, inputs)
        await env.wait_applied(len(inputs), timeout=120)
        _, _, task = env.processors[0]
        assert not task.done(), task
        rows = await env.fetch(
            'SELECT topic, partition, "offset", disposition FROM history ORDER BY id'
        )
        # Exactly once: one history row per input record, at the offsets produced.
        assert len(rows) == len(inputs)
        assert len({(r["topic"], r["partition"], r["offset"]) for r in rows}) == len(inputs)
        for topic in (env.settings.topic_commands, env.settings.topic_observations):
            for p in range(PARTITIONS):
                offsets = sorted(r["offset"] for r in rows
                                 if r["topic"] == topic and r["partition"] == p)  # fmt: skip
                assert offsets == list(range(len(offsets)))
        dead = [r for r in rows if r["disposition"] == "dead-lettered"]
        assert dead and len(dead) < len(rows)  # both kinds occurred
        letters = await eventually(
            lambda: env.read_topic(env.settings.topic_deadletter),
            lambda rs: len(rs) >= len(dead),
            what="every dead letter published",
        )
        assert sorted((json.loads(d.value)["source"]["topic"], json.loads(d.value)["source"]
                       ["partition"], json.loads(d.value)["source"]["offset"]) for d in letters) \
            == sorted((r["topic"], r["partition"], r["offset"]) for r in dead)  # fmt: skip
