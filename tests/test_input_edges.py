"""The processor's input edges on the real stack (Kafka, PostgreSQL): what PostgreSQL cannot
store is refused at the schema or dead-lettered, a record that cannot be written at all stops
its partition only (visibly, until an operator skips it), every sandbox stays in one partition,
and a log that no longer starts at offset 0 is said to be so."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from typing import Any

import apikit
import factories as f
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, RecordsToDelete
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from harness import Env, eventually, isolated_env
from prometheus_client import REGISTRY

from drivers.fake import FakeDriver
from events.codec import encode
from events.log_reader import LogTruncated
from events.topics import partition_for
from projections.store import BatchWrite, RowVersionMoved, sandbox_from_record, write_batch
from services.common.kafka_clients import kafka_client_args
from services.common.settings import PROJECT_ROOT
from services.processor.consumer import Processor
from services.processor.intake import PartitionCountChanged
from services.processor.ownership import InputsLost
from services.processor.rebuild import rebuild_and_compare


def key_on(partition: int, partitions: int, prefix: str) -> str:
    """A sandbox name that Kafka's default partitioner puts on ``partition``."""
    for i in range(10_000):
        name = f"{prefix}-{i}"
        if partition_for(name.encode(), partitions) == partition:
            return name
    raise AssertionError("no such name")


async def produce_to(env: Env, topic: str, records: list[tuple[bytes, bytes, int]]) -> None:
    """Produce (key, value, partition) records, each to the partition given."""
    producer = AIOKafkaProducer(**kafka_client_args(env.settings, "admin"), acks="all")
    await producer.start()
    try:
        for key, value, partition in records:
            await (await producer.send(topic, value=value, key=key, partition=partition))
    finally:
        await producer.stop()


async def history_of(env: Env, topic: str) -> dict[int, dict[str, Any]]:
    rows = await env.fetch('SELECT * FROM history WHERE topic = $1 ORDER BY "offset"', topic)
    return {r["offset"]: dict(r) for r in rows}


async def dead_letters(env: Env, count: int) -> list[dict[str, Any]]:
    records = await eventually(
        lambda: env.read_topic(env.settings.topic_deadletter),
        lambda rs: len(rs) >= count,
        what=f"{count} dead letters",
    )
    return [json.loads(r.value) for r in records]


async def run_cli(env: Env, *args: str) -> tuple[int, str, str]:
    """``sandstream ARGS`` from this checkout, with the environment's settings."""
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from services.cli.main import main; main()", *args,
        cwd=PROJECT_ROOT, env=env.env_vars(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await cli.communicate()
    assert cli.returncode is not None
    return cli.returncode, out.decode(), err.decode()


def alive(env: Env) -> bool:
    return all(not task.done() for _, _, task in env.processors)


def as_json(message: Any, **changes: Any) -> bytes:
    body = message.model_dump(mode="json")
    for path, value in changes.items():
        target = body
        *parents, last = path.split("__")
        for p in parents:
            target = target[p]
        target[last] = value
    return json.dumps(body).encode()


# ------------------------------------------------------------------ 1. poison records


async def test_the_api_answers_422_naming_the_field_for_what_postgresql_cannot_store() -> None:
    async with apikit.running_api(FakeDriver(), partitions=2) as api:
        name = apikit.unique("nul")
        lone_surrogate = (
            '{"name": "' + name + '", "spec": {"image": "i", "command": ["\\ud800"]}}'
        ).encode()
        cases = [
            ({"json": apikit.create_body(name) | {"spec": {"image": "i\x00"}}}, "spec.image",
             "must not contain the NUL character"),
            ({"json": apikit.create_body(name, env={"A": "x\x00y"})}, "spec.env.A", "NUL"),
            ({"json": apikit.create_body(name, labels={"team": "\x00"})}, "spec.labels.team",
             "NUL"),
            ({"content": lone_surrogate, "headers": {"content-type": "application/json"}},
             "spec.command.0", "lone surrogate"),
        ]  # fmt: skip
        before = await api.commands_published()
        async with api.client() as c:
            for kwargs, field, words in cases:
                r = await c.post("/v1/sandboxes", **kwargs)
                assert r.status_code == 422, (field, r.text)
                body = r.json()
                assert body["code"] == "INVALID_ARGUMENT"
                assert f"field {field!r}" in body["message"] and words in body["message"], body
            r = await c.post(f"/v1/sandboxes/{name}:stop", json={"expected_version": 2**63})
            assert r.status_code == 422 and "field 'expected_version'" in r.json()["message"]
            assert await api.commands_published() == before
            # A filter PostgreSQL could not even compare with is refused too (was a 500).
            r = await c.get("/v1/sandboxes", params={"label": "team=\x00"})
            assert r.status_code == 422 and "query parameter 'label'" in r.json()["message"]
            # The processor behind it is alive and applies the next valid command.
            r = await c.post("/v1/sandboxes", json=apikit.create_body(name), params={"wait": 30})
            assert r.status_code in (200, 201), r.text
        assert api.plane is not None and not api.plane.stopping.is_set()


async def test_poison_records_on_both_topics_are_dead_lettered_and_the_processor_goes_on() -> None:
    async with isolated_env(partitions=1) as env:
        await env.start_processor()
        s = env.settings
        await env.produce(s.topic_commands, [(b"base", encode(f.create("base")))])
        await env.wait_applied(1)
        create = f.create("nul-spec")
        failed = f.failed("base", 1, reason="boom")
        await env.produce(
            s.topic_commands,
            [
                (b"nul-spec", as_json(create, spec__image="i\x00")),  # jsonb refuses \u0000
                (b"nul-spec", as_json(create, spec__env={"A": "\x00"})),
                (b"bad\x00key", encode(f.create("bad"))),  # a NUL in the key itself
                (b"\xff\x00", b"\x00not json"),
                (b"ok", encode(f.create("ok"))),
            ],
        )
        await env.produce(
            s.topic_observations,
            [
                (b"base", as_json(failed, reason="\x00")),
                (b"base", as_json(f.exited("base", 1), exit_code=2**31)),
                (b"base", as_json(f.running("base", 1), generation=2**31)),
                (b"base", encode(f.running("base", 1))),
            ],
        )
        await env.wait_applied(10)
        assert alive(env)
        commands, observations = (
            await history_of(env, s.topic_commands),
            await history_of(env, s.topic_observations),
        )
        assert [commands[o]["disposition"] for o in range(1, 6)] == [
            "dead-lettered", "dead-lettered", "dead-lettered", "dead-lettered", "applied",
        ]  # fmt: skip
        assert "field 'spec.image': Value error, must not contain the NUL" in commands[1]["reason"]
        assert "field 'spec.env.A'" in commands[2]["reason"]
        assert commands[3]["key"] == "bad\\x00key"  # escaped: text cannot hold NUL
        assert [observations[o]["disposition"] for o in range(4)] == [
            "dead-lettered", "dead-lettered", "dead-lettered", "applied",
        ]  # fmt: skip
        assert "field 'reason'" in observations[0]["reason"]
        assert "field 'exit_code'" in observations[1]["reason"]
        assert "field 'generation'" in observations[2]["reason"]
        letters = await dead_letters(env, 7)
        assert sorted((d["source"]["topic"], d["source"]["offset"]) for d in letters) == sorted(
            [(s.topic_commands, o) for o in range(1, 5)]
            + [(s.topic_observations, o) for o in range(3)]
        )
        assert {d["key"]["text"] for d in letters} >= {"bad\x00key", "nul-spec", "base"}


async def refuse_poison_rows(env: Env) -> None:
    """A refusal the schema cannot foresee (defence in depth): a trigger on the real table
    refuses the row of the sandbox named "poison"."""
    await env.fetch(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION 'the poison row is refused'; END $$"
    )
    await env.fetch(
        "CREATE TRIGGER refuse_poison BEFORE INSERT ON sandboxes FOR EACH ROW "
        "WHEN (NEW.key = 'poison') EXECUTE FUNCTION refuse_poison()"
    )


async def test_a_batch_postgresql_refuses_is_split_and_only_the_culprit_is_dead_lettered() -> None:
    async with isolated_env(partitions=1) as env:
        await refuse_poison_rows(env)
        names = ["a-0", "a-1", "poison", "b-0", "b-1"]
        await env.produce(
            env.settings.topic_commands, [(n.encode(), encode(f.create(n))) for n in names]
        )
        await env.start_processor()  # one poll holds all five: one batch
        await env.wait_applied(5)
        assert alive(env)
        history = await history_of(env, env.settings.topic_commands)
        assert [history[o]["disposition"] for o in range(5)] == [
            "applied", "applied", "dead-lettered", "applied", "applied",
        ]  # fmt: skip
        assert "PostgreSQL refused to store it" in history[2]["reason"]
        assert "the poison row is refused" in history[2]["reason"]
        keys = {r["key"] for r in await env.fetch("SELECT key FROM sandboxes")}
        assert keys == {"a-0", "a-1", "b-0", "b-1"}
        (letter,) = await dead_letters(env, 1)
        assert letter["source"]["offset"] == 2 and "the poison row is refused" in letter["reason"]


async def test_a_record_that_cannot_be_stored_stops_only_its_partition_until_skipped() -> None:
    async with apikit.running_api(FakeDriver(), partitions=2) as api:
        env = api.env
        s = env.settings
        # Not even its dead letter can be recorded: the history refuses it (until skipped).
        await env.fetch(
            "CREATE FUNCTION refuse_stuck() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'stuck is refused'; END $$"
        )
        await env.fetch(
            "CREATE TRIGGER refuse_stuck BEFORE INSERT ON history FOR EACH ROW "
            "WHEN (NEW.key = 'stuck' AND NEW.disposition <> 'skipped') "
            "EXECUTE FUNCTION refuse_stuck()"
        )
        p = partition_for(b"stuck", 2)
        after, other = key_on(p, 2, "after"), key_on(1 - p, 2, "other")
        await env.produce(
            s.topic_commands,
            [(k.encode(), encode(f.create(k))) for k in ("stuck", after, other)],
        )
        # The other partition goes on.
        await eventually(lambda: api.phase(other), lambda ph: ph is not None, what=other)
        async with api.client() as c:
            ready = await eventually(
                lambda: c.get("/readyz"),
                lambda r: "stopped_partitions" in r.json()["checks"],
                what="/readyz to name the stopped partition",
            )
            assert ready.status_code == 503
            detail = ready.json()["checks"]["stopped_partitions"]["detail"]
            assert f"partition {p} stopped at {s.topic_commands} offset 0" in detail
            assert "stuck is refused" in detail
            metrics = (await c.get("/metrics")).text
        labels = {"topic": s.topic_commands, "partition": str(p)}
        assert (
            REGISTRY.get_sample_value("sandstream_processor_stopped_partition_offset", labels)
            == 0.0
        )
        assert "sandstream_processor_stopped_partition_offset{" in metrics
        assert await api.phase(after) is None  # behind the stopped record, in order
        assert api.plane is not None and not api.plane.stopping.is_set()

        where = ["--topic", s.topic_commands, "--partition", str(p), "--offset", "0"]
        # Retry: the processor tries the record again, and stops again (the cause is still there).
        first = await env.fetchval("SELECT stopped_at FROM stopped_partitions")
        code, _, err = await run_cli(env, "processor", "retry", *where)
        assert code == 0, err
        await eventually(
            lambda: env.fetchval("SELECT stopped_at FROM stopped_partitions"),
            lambda at: at is not None and at > first,
            what="the retried record to stop its partition again",
        )
        assert await api.phase(after) is None
        code, out, err = await run_cli(env, "processor", "skip", *where, "--reason", "test poison")
        assert code == 0, err
        assert "skipped" in out
        await eventually(lambda: api.phase(after), lambda ph: ph is not None, what=after)
        history = await history_of(env, s.topic_commands)
        skipped = [h for h in history.values() if h["partition"] == p and h["offset"] == 0]
        assert [(h["disposition"], h["key"]) for h in skipped] == [("skipped", "stuck")]
        assert "test poison" in skipped[0]["reason"]
        assert (
            REGISTRY.get_sample_value("sandstream_processor_stopped_partition_offset", labels)
            is None
        )
        async with api.client() as c:
            ready = await eventually(
                lambda: c.get("/readyz"), lambda r: r.status_code == 200, what="ready again"
            )
        # Skipping twice is refused, plainly.
        code, _, err = await run_cli(env, "processor", "skip", *where)
        assert code == 1 and "is not stopped at offset 0" in err


# ------------------------------------------------------------------ 2. one sandbox, one partition


async def test_a_record_on_the_wrong_partition_is_dead_lettered_naming_the_expected_one() -> None:
    async with isolated_env(partitions=4) as env:
        await env.start_processor()
        s = env.settings
        expected = partition_for(b"split", 4)
        wrong = (expected + 1) % 4
        await produce_to(
            env,
            s.topic_commands,
            [(b"split", encode(f.create("split")), wrong),
             (b"split", encode(f.create("split")), expected)],
        )  # fmt: skip
        await env.wait_applied(2)
        history = await env.fetch(
            "SELECT partition, disposition, reason FROM history ORDER BY partition"
        )
        by_partition = {h["partition"]: h for h in history}
        assert by_partition[wrong]["disposition"] == "dead-lettered"
        assert f"belongs on partition {expected} of 4" in by_partition[wrong]["reason"]
        assert by_partition[expected]["disposition"] == "applied"
        (letter,) = await dead_letters(env, 1)
        assert letter["source"]["partition"] == wrong
        assert await env.fetchval("SELECT partition FROM sandboxes WHERE key = 'split'") == expected


async def test_the_row_write_refuses_a_version_that_does_not_follow_the_stored_one() -> None:
    async with isolated_env(partitions=4) as env:
        await env.start_processor()
        await env.produce(env.settings.topic_commands, [(b"cas", encode(f.create("cas")))])
        await env.wait_applied(1)
        stored = sandbox_from_record(
            (await env.fetch("SELECT * FROM sandboxes WHERE key = 'cas'"))[0]
        )
        assert stored.version == 1
        nxt = replace(stored, version=2)
        topic = "elsewhere"  # offsets of a partition nobody else writes
        async with env.pool.acquire() as conn:
            # Decided from a row that is not there (stale "new row"): refused, nothing written.
            with pytest.raises(RowVersionMoved):
                await write_batch(conn, BatchWrite([(0, nxt)], [], [], [], {(topic, 0): (0, 1)}))
            # Decided from version 1: written.
            await write_batch(
                conn, BatchWrite([(0, nxt)], [], [], [], {(topic, 0): (0, 1)}, {"cas": 1})
            )
            # Decided from version 1 again (a second writer): refused, nothing written.
            with pytest.raises(RowVersionMoved):
                await write_batch(
                    conn, BatchWrite([(0, nxt)], [], [], [], {(topic, 1): (0, 1)}, {"cas": 1})
                )
        offsets = await env.fetch("SELECT partition FROM input_offsets WHERE topic = $1", topic)
        assert [o["partition"] for o in offsets] == [0]
        assert await env.fetchval("SELECT version FROM sandboxes WHERE key = 'cas'") == 2


async def test_a_changed_partition_count_of_the_input_topics_stops_the_processor_plainly() -> None:
    async with isolated_env(partitions=2) as env:
        s = env.settings
        # A name whose partition differs between 2 and 3 partitions.
        name = next(
            n for n in (f"moved-{i}" for i in range(1000))
            if partition_for(n.encode(), 2) != partition_for(n.encode(), 3)
        )  # fmt: skip
        processor = await env.start_processor()
        await env.produce(s.topic_commands, [(name.encode(), encode(f.create(name)))])
        await env.wait_applied(1)
        admin = AIOKafkaAdminClient(**kafka_client_args(s, "admin"))
        await admin.start()
        try:
            await admin.create_partitions({s.topic_commands: NewPartitions(3)})
            await admin.create_partitions({s.topic_observations: NewPartitions(3)})
        finally:
            await admin.close()
        _, _, task = env.processors[0]
        await eventually(lambda: task.done(), bool, what="the processor to refuse to run")
        env.processors.clear()
        await processor.stop()
        with pytest.raises(PartitionCountChanged, match=f"{s.topic_commands} has 3 partitions"):
            task.result()
        # A new processor refuses to start, with the configured count or with the new one.
        again = Processor(s, env.pool, name="p2")
        with pytest.raises(PartitionCountChanged, match="has 3 partitions"):
            await again.start()
        await again.stop()
        rekeyed = Processor(s.model_copy(update={"kafka_partitions": 3}), env.pool, name="p3")
        with pytest.raises(PartitionCountChanged, match=f"sandbox '{name}' was written from"):
            await rekeyed.start()
        await rekeyed.stop()


# ------------------------------------------------------------------ 5. the log stays replayable


async def test_project_topics_are_created_with_retention_forever() -> None:
    async with isolated_env(partitions=1) as env:
        admin = AIOKafkaAdminClient(**kafka_client_args(env.settings, "admin"))
        await admin.start()
        try:
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, t) for t in env.settings.topics]
            )
        finally:
            await admin.close()
        found = {}
        for response in responses:
            for resource in response.resources:  # (error, message, type, name, entries)
                found[resource[3]] = {e[0]: e[1] for e in resource[4]}
        assert set(found) == set(env.settings.topics)
        for name, configs in found.items():
            assert (configs["retention.ms"], configs["retention.bytes"]) == ("-1", "-1"), name


async def delete_first(env: Env, topic: str, partition: int, before: int) -> None:
    admin = AIOKafkaAdminClient(**kafka_client_args(env.settings, "admin"))
    await admin.start()
    try:
        await admin.delete_records({TopicPartition(topic, partition): RecordsToDelete(before)})
    finally:
        await admin.close()


async def test_rebuild_says_plainly_that_the_events_topic_no_longer_starts_at_offset_0() -> None:
    async with isolated_env(partitions=1) as env:
        await env.start_processor()
        await env.produce(env.settings.topic_commands, [(b"old", encode(f.create("old")))])
        await env.observe(f.running("old", 1))
        await eventually(lambda: env.read_topic(env.settings.topic_events), lambda rs: len(rs) >= 2)
        await delete_first(env, env.settings.topic_events, 0, 1)
        with pytest.raises(LogTruncated, match="partition 0 starts at offset 1"):
            await rebuild_and_compare(env.settings)
        code, _, text = await run_cli(env, "rebuild")
        assert code == 1
        assert "cannot rebuild" in text and "no longer starts at offset 0" in text, text
        assert "Traceback" not in text


async def test_a_processor_refuses_to_skip_inputs_deleted_before_it_applied_them() -> None:
    async with isolated_env(partitions=1) as env:
        names = ["gone-0", "gone-1", "kept"]
        await env.produce(
            env.settings.topic_commands, [(n.encode(), encode(f.create(n))) for n in names]
        )
        await delete_first(env, env.settings.topic_commands, 0, 2)
        await env.start_processor()
        _, _, task = env.processors[0]
        await eventually(lambda: task.done(), bool, what="the processor to refuse")
        processor, _, _ = env.processors.pop()
        await processor.stop()
        with pytest.raises(InputsLost, match="partition 0 starts at offset 2 but the processor"):
            task.result()
        assert await env.fetchval("SELECT count(*) FROM history") == 0
