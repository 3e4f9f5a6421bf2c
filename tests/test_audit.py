"""The audit tools on the real stack: verify re-decides the log and catches a changed rule, a
tampered or removed history row; `at` matches the recorded row at every input; export round
trips; the CLI says so with its exit status."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from typing import Any

import apikit
import changed_rules
import factories as f
import pyarrow.parquet as pq
import workload
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.records_to_delete import RecordsToDelete
from harness import Env, eventually, isolated_env

from drivers.fake import FakeDriver
from events.codec import encode
from projections.chain import link
from projections.lifecycle import Message
from projections.store import SANDBOX_COLUMNS, sandbox_from_record
from services.audit import entries, export, timeline
from services.audit.chains import check_chains
from services.audit.verify import Options, verify
from services.common.kafka_clients import kafka_client_args
from services.common.settings import PROJECT_ROOT

NAME = "audited"


def life(key: str = NAME) -> list[Message]:
    """A sandbox's whole life: created, launched, stopped, started again, a duplicate retry."""
    return [
        f.create(key, command_id="c-1", occurred_at=f.at(1)),
        f.launched(key, 1, occurred_at=f.at(2)),
        f.running(key, 1, occurred_at=f.at(3)),
        f.stop(key, command_id="c-2", occurred_at=f.at(4)),
        f.exited(key, 1, exit_code=143, occurred_at=f.at(5)),
        f.stopped(key, 1, occurred_at=f.at(6)),
        f.start(key, command_id="c-3", occurred_at=f.at(7)),
        f.stop(key, command_id="c-2", occurred_at=f.at(8)),  # a retry: duplicate
        f.launched(key, 2, occurred_at=f.at(9)),
        f.running(key, 2, occurred_at=f.at(10)),
    ]


async def feed(env: Env, messages: list[Message]) -> None:
    """Send each input to its topic and wait until it is decided: a known decision order."""
    done = int(await env.fetchval("SELECT count(*) FROM history"))
    for message in messages:
        is_command = f.topic_for(message) == f.topic_for(f.create())
        s = env.settings
        target = s.topic_commands if is_command else s.topic_observations
        await env.produce(target, [(message.key.encode(), encode(message))])
        done += 1
        await env.wait_applied(done)


async def all_published(env: Env) -> None:
    expected = int(
        await env.fetchval("SELECT coalesce(sum(cardinality(event_types)), 0) FROM history")
    )
    await eventually(
        lambda: env.read_topic(env.settings.topic_events),
        lambda rs: len(rs) >= expected,
        what=f"{expected} published events",
    )


async def recorded_run(env: Env) -> None:
    await env.start_processor()
    await feed(env, life())
    await env.produce(env.settings.topic_commands, [(NAME.encode(), b"{not json")])
    await env.wait_applied(11)
    await all_published(env)


async def test_verify_re_decides_a_real_run_and_finds_it_equal() -> None:
    async with isolated_env() as env:
        await recorded_run(env)
        report = await verify(env.settings)
        assert report.divergences == []
        assert report.inputs == 11 and report.sandboxes == 1
        assert report.chains is not None and report.chains.intact and report.chains.checked == 11
        assert report.reach.complete and report.ok


async def test_verify_with_a_changed_rule_names_the_first_input_it_would_rewrite() -> None:
    async with isolated_env() as env:
        await recorded_run(env)
        stop = await env.fetchval(
            "SELECT \"offset\" FROM history WHERE command_id = 'c-2' ORDER BY id LIMIT 1"
        )
        report = await verify(env.settings, Options(rules=changed_rules.decide, rules_name="x"))
        assert not report.ok
        [divergence] = report.divergences  # one sandbox: its first divergence only
        assert (divergence.key, divergence.topic, divergence.offset) == (
            NAME, env.settings.topic_commands, stop,
        )  # fmt: skip
        assert divergence.input == "StopSandbox"
        assert divergence.recorded.startswith("applied: Stopping")
        assert divergence.redecided.startswith("rejected: Ready")


async def test_a_tampered_history_row_breaks_the_chain_at_exactly_that_entry() -> None:
    async with isolated_env() as env:
        await recorded_run(env)
        assert (await check_chains_of(env)).intact
        ids = [r["id"] for r in await env.fetch("SELECT id FROM history ORDER BY id")]
        victim = ids[4]
        await env.fetch("UPDATE history SET reason = 'nothing to see' WHERE id = $1", victim)
        report = await check_chains_of(env)
        [broken] = report.broken
        assert broken.entry.id == victim
        assert "altered" in broken.problem
        assert not (await verify(env.settings)).ok


async def test_a_removed_history_row_is_a_broken_link_and_a_lost_input() -> None:
    async with isolated_env() as env:
        await recorded_run(env)
        rows = await env.fetch('SELECT id, topic, "offset" FROM history ORDER BY id')
        victim = rows[3]
        await env.fetch("DELETE FROM history WHERE id = $1", victim["id"])
        chains = await check_chains_of(env)
        [broken] = chains.broken
        assert broken.entry.id == rows[4]["id"] and "previous-hash" in broken.problem
        report = await verify(env.settings)
        lost = [d for d in report.divergences if "no history entry" in d.what]
        assert [(d.topic, d.offset) for d in lost] == [(victim["topic"], victim["offset"])]


async def check_chains_of(env: Env) -> Any:
    async with env.pool.acquire() as conn:
        return await check_chains(conn)


async def test_at_each_input_matches_the_row_recorded_after_it() -> None:
    async with isolated_env() as env:
        await recorded_run(env)
        async with env.pool.acquire() as conn:
            recorded = await entries.of_sandbox(conn, NAME)
        steps = timeline.replay(recorded, env.settings.topic_commands)
        assert all(s.agrees for s in steps)
        for entry in recorded:
            prefix = timeline.at(steps, position=(entry.topic, entry.offset))
            state = prefix[-1].state
            if entry.phase is not None:
                assert state is not None
                assert (state.phase.value, state.generation, state.version) == (
                    entry.phase, entry.generation, entry.version,
                )  # fmt: skip
        [live] = await env.fetch(f"SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE key = $1", NAME)
        assert timeline.at(steps, time=f.at(100))[-1].state == sandbox_from_record(live)
        as_of_stop = timeline.at(steps, time=f.at(4.5))[-1].state
        assert as_of_stop is not None and as_of_stop.phase.value == "Stopping"


async def test_explain_links_each_intent_to_the_driver_result_it_got() -> None:
    async with isolated_env() as env:
        await recorded_run(env)
        async with env.pool.acquire() as conn:
            recorded = await entries.of_sandbox(conn, NAME)
        story = timeline.explain(NAME, timeline.replay(recorded, env.settings.topic_commands))
        calls = [c for cs in story.calls.values() for c in cs]
        assert [(c.operation, c.generation, [r.entry.body["outcome"] for r in c.results])
                for c in calls] == [
            ("launch", 1, ["succeeded"]), ("stop", 1, ["succeeded"]), ("launch", 2, ["succeeded"]),
        ]  # fmt: skip
        assert story.state is not None and story.state.phase.value == "Ready"


async def test_export_round_trips_as_json_lines_and_parquet(tmp_path: Any) -> None:
    async with isolated_env() as env:
        await recorded_run(env)
        jsonl, parquet = tmp_path / "h.jsonl", tmp_path / "h.parquet"
        async with env.pool.acquire() as conn:
            everything = [e async for page in entries.stream(conn, entries.Filter()) for e in page]
            pages: list[int] = []
            every = entries.Filter()
            assert await export.export(conn, every, "jsonl", jsonl, pages.append, chunk=3) == 11
            assert pages == [3, 3, 3, 2]  # written page by page: memory is one page
            pages.clear()
            assert await export.export(conn, every, "parquet", parquet, pages.append, chunk=3) == 11
            assert pages == [3, 3, 3, 2]
            assert pq.ParquetFile(parquet).num_row_groups == 4
            stops = entries.Filter(key=NAME, types=["StopSandbox"])
            assert await export.export(conn, stops, "jsonl", tmp_path / "s.jsonl") == 2
        lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
        table = pq.read_table(parquet).to_pylist()
        assert len(lines) == len(table) == len(everything)
        for entry, line, row in zip(everything, lines, table, strict=True):
            expected = export.as_row(entry)
            assert row == expected
            assert line == json.loads(export.json_line(entry))
            assert line["message"] == entry.message and line["entry_hash"] == entry.entry_hash.hex()
            # The chain can be checked from the exported file alone.
            content = dataclasses.replace(entry).content() | {"occurred_at": row["occurred_at"]}
            prev = bytes.fromhex(line["prev_hash"]) if line["prev_hash"] else None
            assert link(prev, content).hex() == line["entry_hash"]


def cli(env: Env, *args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """`sandstream audit ARGS` in a subprocess, after ``prelude`` (Python run first)."""
    main = prelude + "from services.cli.main import main; main()"
    return subprocess.run(
        [sys.executable, "-c", main, "audit", *args],
        cwd=PROJECT_ROOT,
        env={**env.env_vars(), "PYTHONPATH": str(PROJECT_ROOT / "tests")},
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_the_cli_verifies_explains_and_fails_on_a_changed_rule(tmp_path: Any) -> None:
    async with isolated_env() as env:
        await recorded_run(env)
        ok = cli(env, "verify")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "log reach: the input log still begins at offset 0" in ok.stdout
        assert "✓ 0 divergences, 0 broken links" in ok.stdout
        changed = cli(env, "verify", "--rules", "changed_rules")
        assert changed.returncode == 1 and "StopSandbox" in changed.stdout
        page = tmp_path / "explain.html"
        explained = cli(env, "explain", NAME, "--html", str(page))
        assert explained.returncode == 0, explained.stderr
        assert "=> executor: launch generation 2: succeeded" in explained.stdout
        assert "<svg" in page.read_text() and "http" not in page.read_text().replace(
            "http://www.w3.org/2000/svg", ""
        )
        missing = cli(env, "at", NAME, "--offset", "commands:999")
        assert missing.returncode == 1 and "no input of this sandbox" in missing.stderr


# An install without the parquet extra (the container image): pyarrow does not import.
WITHOUT_PYARROW = """
import sys
class NoPyarrow:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "pyarrow":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoPyarrow())
"""


async def test_without_pyarrow_parquet_export_fails_at_once_naming_the_extra(
    tmp_path: Any,
) -> None:
    async with isolated_env() as env:
        await env.start_processor()
        await feed(env, life()[:2])
        target = tmp_path / "h.parquet"
        refused = cli(env, "export", str(target), "--format", "parquet", prelude=WITHOUT_PYARROW)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "pip install 'sandstream[parquet]'" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert "log reach" not in refused.stdout + refused.stderr  # failed before reading the log
        assert not target.exists()
        jsonl = tmp_path / "h.jsonl"
        exported = cli(env, "export", str(jsonl), prelude=WITHOUT_PYARROW)
        assert exported.returncode == 0, exported.stderr
        assert "exported 2 inputs (jsonl)" in exported.stderr
        assert [json.loads(line)["message_type"] for line in jsonl.read_text().splitlines()] == [
            "CreateSandbox", "DriverOperationResult",
        ]  # fmt: skip


IMPORT_EVERY_MODULE = """
import importlib, pkgutil
import events, projections, drivers, services
for package in (events, projections, drivers, services):
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not m.name.endswith("__main__"):
            try:
                importlib.import_module(m.name)
            except ImportError as e:
                print(m.name, e)
"""


def test_only_the_parquet_module_needs_pyarrow() -> None:
    """The API, the OpenShell server, every role and command import without the extra."""
    imported = subprocess.run(
        [sys.executable, "-c", WITHOUT_PYARROW + IMPORT_EVERY_MODULE],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.splitlines() == ["services.audit.parquet No module named 'pyarrow'"], (
        imported.stdout
    )


async def test_the_http_audit_answers_with_the_actor_the_token_named() -> None:
    async with apikit.running_api(FakeDriver()) as api:
        name = apikit.unique("aud")
        async with api.client() as admin:
            created = await admin.post("/v1/sandboxes?wait=30", json=apikit.create_body(name))
            assert created.status_code == 201, created.text
            await api.wait_phase(name, "Ready")
            stopped = await admin.post(f"/v1/sandboxes/{name}:stop?wait=30")
            assert stopped.status_code == 200, stopped.text
            # The admin token lacks audit:read.
            denied = await admin.get(f"/v1/audit/sandboxes/{name}/explain")
            assert denied.status_code == 403 and "audit:read" in denied.json()["message"]
        async with api.client(apikit.AUDITOR) as auditor:
            answer = await auditor.get(f"/v1/audit/sandboxes/{name}/explain")
            assert answer.status_code == 200, answer.text
            story = answer.json()
            commands = [s for s in story["inputs"] if s["input"].startswith("command")]
            assert [(c["actor"], c["disposition"]) for c in commands] == [
                ("admin", "applied"), ("admin", "applied"),
            ]  # fmt: skip
            assert story["inputs"][0]["driver_calls"][0]["operation"] == "launch"
            first = story["inputs"][0]
            at = await auditor.get(
                f"/v1/audit/sandboxes/{name}/at",
                params={"topic": "commands", "offset": first["offset"]},
            )
            assert at.json()["state"]["phase"] == "Provisioning"
            bad = await auditor.get(f"/v1/audit/sandboxes/{name}/at", params={"offset": 1})
            assert bad.status_code == 422
            exported = await auditor.get("/v1/audit/export", params={"name": name})
            lines = [json.loads(line) for line in exported.text.splitlines()]
            # The runtime's end may still be recorded after the export read: the export is the
            # history up to its last row, each row once.
            got = sorted(line["id"] for line in lines)
            recorded = await api.env.fetch(
                "SELECT id FROM history WHERE key = $1 AND id <= $2 ORDER BY id", name, got[-1]
            )
            assert got == [r["id"] for r in recorded] and len(got) >= 4, got
            assert exported.headers["content-type"].startswith("application/x-ndjson")
            assert (await auditor.get("/v1/audit/chains")).json()["intact"] is True
            victim = lines[1]["id"]
            await api.env.fetch("UPDATE history SET reason = 'edited' WHERE id = $1", victim)
            chains = (await auditor.get("/v1/audit/chains", params={"name": name})).json()
            assert chains["intact"] is False
            assert [b["history_id"] for b in chains["broken"]] == [victim]


async def test_verify_says_where_retention_cut_the_log_and_does_not_guess() -> None:
    """It once exited 0 although a sandbox could not be verified."""
    async with isolated_env() as env:
        await recorded_run(env)
        [row] = await env.fetch("SELECT partition FROM sandboxes WHERE key = $1", NAME)
        tp = TopicPartition(env.settings.topic_observations, row["partition"])
        admin = AIOKafkaAdminClient(**kafka_client_args(env.settings, "admin"))
        await admin.start()
        try:
            await admin.delete_records({tp: RecordsToDelete(before_offset=3)})
        finally:
            await admin.close()
        report = await verify(env.settings)
        assert not report.reach.complete and report.reach.begins_at(tp.topic, tp.partition) == 3
        assert f"{tp.topic}[{tp.partition}] from 3" in report.reach.statement()
        assert report.not_verifiable == {NAME}
        assert report.divergences == []
        assert not report.ok  # a sandbox not verified is not a verified record
        said = cli(env, "verify")
        assert said.returncode == 1
        assert "retention has deleted the oldest input records" in said.stderr
        assert f"✗ not verifiable (inputs older than the log): {NAME} (--accept-un" in said.stdout
        accepted = cli(env, "verify", "--accept-unverifiable")
        assert accepted.returncode == 0, accepted.stdout + accepted.stderr
        assert f"not verifiable (inputs older than the log): {NAME}\n" in accepted.stdout


async def test_verify_while_inputs_arrive_finds_no_false_divergence() -> None:
    inputs = workload.commands(400, keys=16, seed=21)
    async with isolated_env() as env:
        await env.start_processor()

        async def load() -> None:
            for start in range(0, 400, 20):
                async with await env.publisher() as pub:
                    await pub.publish_many(inputs[start : start + 20])

        arriving = asyncio.create_task(load())
        await env.wait_applied(100)
        report = await verify(env.settings)
        await arriving
        assert report.divergences == [], [d.describe() for d in report.divergences]
        assert report.inputs >= 100 and report.ok
