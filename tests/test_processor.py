"""The processor end to end on real Kafka and real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import factories as f
from aiokafka import AIOKafkaConsumer, TopicPartition
from harness import Env, eventually, isolated_env

from events.codec import EVENTS, decode, encode
from services.api.readmodel import await_outcome
from services.common.kafka_clients import kafka_client_args
from services.processor.rebuild import rebuild_and_compare


async def row(env: Env, key: str) -> dict[str, object] | None:
    rows = await env.fetch("SELECT * FROM sandboxes WHERE key = $1", key)
    return dict(rows[0]) if rows else None


async def test_commands_and_observations_flow_into_rows_history_outcomes_and_events() -> None:
    async with isolated_env() as env:
        await env.start_processor()
        create = f.create("demo", command_id="c-create")
        async with await env.publisher() as pub:
            await pub.publish(create)
            outcome = await await_outcome(env.pool, "c-create", timeout=30)
            assert outcome is not None and outcome.accepted and outcome.generation == 1
            await env.observe(f.snapshot("demo", 1, "running"))
            await eventually(lambda: row(env, "demo"), lambda r: r and r["phase"] == "Ready")

            # Stop from Provisioning is fine, but here it is Ready: accepted, Stopping.
            await pub.publish(f.stop("demo", command_id="c-stop"))
            stop = await await_outcome(env.pool, "c-stop", timeout=30)
            assert stop is not None and stop.accepted and stop.phase == "Stopping"
            await env.observe(
                f.snapshot("demo", 1, "running"),  # late: ignored while Stopping
                f.snapshot("demo", 1, "exited", exit_code=143),
                f.snapshot("demo", 1, "exited", exit_code=143),  # duplicate: changes nothing
            )
            final = await eventually(
                lambda: row(env, "demo"), lambda r: r and r["phase"] == "Stopped"
            )
            await env.wait_applied(6)
            assert final is not None and final["version"] == 4  # created, ready, stopping, stopped

            # A rejected command gets its code and a message naming the phase.
            await pub.publish(f.start("demo", command_id="c-start", expected_version=1))
            rejected = await await_outcome(env.pool, "c-start", timeout=30)
            assert rejected is not None and rejected.code == "ABORTED"
            assert "expected version 1" in rejected.message

            # A retry of an accepted command gets the first outcome back and changes nothing.
            await pub.publish(f.stop("demo", command_id="c-stop"))
            await env.wait_applied(8)
            dup = await env.fetch(
                "SELECT disposition FROM history WHERE command_id = 'c-stop' ORDER BY id"
            )
            assert [d["disposition"] for d in dup] == ["applied", "duplicate"]

        history = await env.fetch("SELECT * FROM history WHERE key = 'demo' ORDER BY id")
        assert [h["disposition"] for h in history] == [
            "applied", "applied", "applied", "ignored", "applied", "ignored", "rejected",
            "duplicate",
        ]  # fmt: skip
        assert "Stopping" in history[3]["reason"]
        assert all(h["topic"] and h["offset"] is not None for h in history)

        events = await eventually(
            lambda: env.read_topic(env.settings.topic_events),
            lambda rs: len(rs) >= 4,
            what="4 published events",
        )
        decoded = [decode(EVENTS, r.value) for r in events]
        assert [e.type for e in decoded] == [
            "SandboxCreated", "SandboxReady", "SandboxStopping", "SandboxStopped",
        ]  # fmt: skip
        assert [e.version for e in decoded] == [1, 2, 3, 4]
        assert decoded[0].cause.command_id == "c-create"
        assert all(r.key == b"demo" for r in events)
        report = await rebuild_and_compare(env.settings)
        assert report.equal, report.differences

        # The same check as a command, as an operator would run it.
        cli = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("sandstream")), "rebuild", "-o", "json",
            env=env.env_vars(), stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, _ = await cli.communicate()
        assert cli.returncode == 0
        assert json.loads(stdout) | {"schema": None} == {
            "equal": True, "rebuilt": 1, "live": 1, "schema": None, "differences": [],
        }  # fmt: skip


async def test_malformed_records_go_to_the_dead_letter_topic_and_valid_ones_apply() -> None:
    async with isolated_env(partitions=1) as env:
        await env.start_processor()
        good = [f.create(f"sb-{i}", command_id=f"ok-{i}") for i in range(3)]
        mismatched = f.create("right-name", command_id="bad-key")
        await env.produce(
            env.settings.topic_commands,
            [
                (b"sb-0", encode(good[0])),
                (b"x", b"not json"),
                (b"sb-1", encode(good[1])),
                (b"x", json.dumps({"type": "LaunchMissiles", "key": "x"}).encode()),
                (b"x", json.dumps({"type": "StopSandbox", "key": "x"}).encode()),
                (b"wrong-name", encode(mismatched)),
                (None, b""),
                (b"sb-2", encode(good[2])),
            ],
        )
        await env.wait_applied(8)
        letters = await eventually(
            lambda: env.read_topic(env.settings.topic_deadletter),
            lambda rs: len(rs) >= 5,
            what="5 dead letters",
        )
        reasons = [json.loads(r.value)["reason"] for r in letters]
        assert reasons[0].startswith("not valid JSON")
        assert "unknown message type 'LaunchMissiles'" in reasons[1]
        assert "field 'command_id': Field required" in reasons[2]
        assert "does not match body key 'right-name'" in reasons[3]
        assert reasons[4] == "empty record value"
        sources = [json.loads(r.value)["source"] for r in letters]
        assert [s["offset"] for s in sources] == [1, 3, 4, 5, 6]
        assert {s["topic"] for s in sources} == {env.settings.topic_commands}
        live = await env.fetch("SELECT key, phase FROM sandboxes ORDER BY key")
        assert [(r["key"], r["phase"]) for r in live] == [
            ("sb-0", "Provisioning"),
            ("sb-1", "Provisioning"),
            ("sb-2", "Provisioning"),
        ]
        offsets = await env.fetch("SELECT topic, next_offset FROM input_offsets")
        assert {(r["topic"], r["next_offset"]) for r in offsets} >= {
            (env.settings.topic_commands, 8)
        }


async def test_the_processor_commits_its_offsets_to_kafka_for_lag_tooling() -> None:
    async with isolated_env(partitions=1) as env:
        s = env.settings
        await env.produce(
            s.topic_commands, [(n, encode(f.create(n.decode()))) for n in (b"a", b"b")]
        )
        await env.start_processor()
        await env.wait_applied(2)
        consumer = AIOKafkaConsumer(
            **kafka_client_args(s, "admin"),
            group_id=s.processor_group,
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            tp = TopicPartition(s.topic_commands, 0)
            committed = await eventually(
                lambda: consumer.committed(tp), lambda at: at == 2, what="the lag commit"
            )
            assert committed == 2
        finally:
            await consumer.stop()
