"""The benchmarks' references must be right before a ratio against them means anything: the
ceiling projector records every input once, in order per sandbox, and is fenced like the
processor; the rebuild's copied events fold to one row per sandbox."""

from __future__ import annotations

import os
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition

from events.codec import EVENTS, decode
from projections.fold import fold
from projections.lifecycle import evolve
from services.bench import ceiling, cpu
from services.bench import processor as bench_processor
from services.bench.fold import decoded_log, fold_cpu
from services.bench.main import run
from services.bench.rebuild import copies, rebuild_figures, template_events
from services.bench.stages import consumer_records, stages_cpu
from services.bench.workload import lifecycle_messages, produce_all
from services.common.settings import Settings
from services.localstack.isolation import isolated
from services.processor.intake import Parsed, parse


async def test_ceiling_records_every_input_once_with_consecutive_versions(
    settings: Settings,
) -> None:
    async with isolated(settings, "bench-test") as (s, pool):
        records, total = lifecycle_messages(30)
        await produce_all(s, records)
        rate = await ceiling.drain(s, total, max_records=17)  # many small polls
        assert rate > 0
        rows = await pool.fetch("SELECT key, version FROM ceiling_rows")
        assert len(rows) == 30
        assert {r["version"] for r in rows} == {4}
        versions = await pool.fetch(
            "SELECT key, array_agg(version ORDER BY version) AS v FROM ceiling_history GROUP BY key"
        )
        assert {tuple(r["v"]) for r in versions} == {(1, 2, 3, 4)}
        assert len(versions) == 30
        assert await pool.fetchval("SELECT sum(next_offset) FROM ceiling_offsets") == total


async def test_ceiling_write_is_fenced_when_another_writer_moved_the_offsets(
    settings: Settings,
) -> None:
    async with isolated(settings, "bench-test") as (s, pool):
        records, total = lifecycle_messages(5)
        await produce_all(s, records)
        await ceiling.drain(s, total)
        conn = await asyncpg.connect(s.pg_dsn, server_settings={"search_path": s.pg_schema})
        try:
            stale = ceiling.Ceiling(s, conn)  # believes every partition is at offset 0
            await conn.execute(
                "CREATE TEMP TABLE ceiling_changed (key text, phase text, version bigint) "
                "ON COMMIT DELETE ROWS"
            )

            tp = await pool.fetchrow(
                "SELECT topic, part FROM ceiling_offsets WHERE next_offset > 0 LIMIT 1"
            )
            record = ConsumerRecord(tp["topic"], tp["part"], 0, 0, 0, b"k", records[0][2],
                                    None, 1, len(records[0][2]), ())  # fmt: skip
            with pytest.raises(ceiling.Fenced):
                await stale.apply({TopicPartition(tp["topic"], tp["part"]): [record]})
        finally:
            await conn.close()


def test_rebuild_copies_fold_to_one_stopped_row_per_sandbox() -> None:
    rows = {}
    for key, value in copies(template_events(), 7):
        event = decode(EVENTS, value)
        assert event.key == key.decode()
        rows[event.key] = evolve(rows.get(event.key), event)
    assert len(rows) == 7
    assert {r.phase.value for r in rows.values()} == {"Stopped"}
    assert len({r.sandbox_id for r in rows.values()}) == 7


async def test_the_rebuild_benchmark_runs_its_rebuild_against_the_password_protected_database(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The child that rebuilds gets the settings with the password (a JSON dump masks it)."""
    await rebuild_figures(Settings(), keys=5)
    printed = capsys.readouterr().out
    assert "rebuild" in printed and "20 inputs (20 decided events, 5 rows)" in printed, printed


def test_the_fold_bench_folds_the_log_into_a_state_change_per_input() -> None:
    """The decide-stage figure is of the log the processor bench drains: every input decided
    and applied (one event each), every sandbox Stopped at the end."""
    inputs = decoded_log(3)
    assert len(inputs) == 12
    result = fold({}, {}, inputs)
    assert [len(s.decision.events) for s in result.steps] == [1] * 12
    assert {k: s.phase.value if s else None for k, s in result.states.items()} == {
        f"bench-{k}": "Stopped" for k in range(3)
    }
    assert fold_cpu(inputs) > 0


async def test_the_latency_run_stops_its_kafka_clients_before_its_topics_go_even_on_failure(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client left running while the topics and their ACLs are removed logs "not
    authorized" for each until the process ends: every one is stopped first, whatever
    happened (here: the first command cannot be encoded)."""
    made: list[AIOKafkaConsumer | AIOKafkaProducer] = []

    class Producer(AIOKafkaProducer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    class Consumer(AIOKafkaConsumer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    def unencodable(_: object) -> bytes:
        raise RuntimeError("cannot encode")

    monkeypatch.setattr(bench_processor, "AIOKafkaProducer", Producer)
    monkeypatch.setattr(bench_processor, "AIOKafkaConsumer", Consumer)
    monkeypatch.setattr(bench_processor, "encode", unencodable)
    async with isolated(settings, "bench-test") as (s, _):
        with pytest.raises(RuntimeError, match="cannot encode"):
            await bench_processor._paced_commands(s, rate=10, seconds=1, processor=os.getpid())
        assert len(made) == 2
        assert all(client._closed for client in made)


def test_the_stages_bench_parses_decides_and_plans_every_input_of_the_log() -> None:
    """The parse/decide/plan figure is of the processor's own functions on the bench's log:
    every record is on its key's partition and parses (none is dead-lettered), and each of the
    three stages is timed."""
    settings = Settings()
    records = consumer_records(settings, 3)
    assert len(records) == 12
    items = [parse(r, settings.topic_commands, settings.kafka_partitions) for r in records]
    assert all(isinstance(i, Parsed) for i in items)
    figures = stages_cpu(settings, records)
    assert set(figures) == {"parse", "decide", "plan"} and all(v > 0 for v in figures.values())


async def test_the_latency_choice_runs_the_latency_benchmark_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every paced command's row is seen, beside Kafka's own latency, the processor's CPU and
    what each party sharing the cores spent;
    no throughput run comes first."""
    await run("latency", quick=True, latency_rate=20)
    printed = capsys.readouterr().out
    assert "throughput" not in printed, printed
    assert "latency     100/100 commands at 20/s" in printed, printed
    assert "Kafka alone p50" in printed and "CPU: processor" in printed, printed
    assert "machine, while sending:" in printed and "PostgreSQL" in printed, printed


async def test_the_decided_choice_times_hold_and_release_through_the_api_beside_its_references(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every request got its decided answer (the run fails otherwise), printed beside Kafka's
    and PostgreSQL's own round trips; no other benchmark runs."""
    await run("decided", quick=True)
    printed = capsys.readouterr().out
    assert "throughput" not in printed and "latency " not in printed, printed
    assert "decided     100 sequential :hold/:release with wait" in printed, printed
    for line in ("API            p50", "Kafka alone    p50", "NOTIFY alone   p50"):
        assert line in printed, printed


def test_cpu_per_input_counts_the_broker_only_when_its_process_was_read(tmp_path: Any) -> None:
    pidfile = tmp_path / "broker.pid"
    pidfile.write_text(f"{os.getpid()}\n")
    pid = cpu.broker_pid(pidfile)
    assert pid == os.getpid()
    start = cpu.CpuMark(1.0, None, 2.0)
    assert cpu.per_input(start, cpu.CpuMark(1.5, None, 3.0), 1000) == (
        "500 + Kafka 1000 µs CPU/input"
    )
    assert cpu.mark([], pid).broker is not None  # this process stands in for the broker
    assert cpu.broker_pid(tmp_path / "absent.pid") is None
    assert cpu.mark([], None).broker is None
    assert cpu.per_input(start, cpu.CpuMark(1.5, None, None), 1000) == "500 µs CPU/input"


def test_the_machine_budget_counts_each_partys_processes_read_at_both_marks() -> None:
    start = cpu.MachineMark((100, 400), {"processor": {1: 1.0}, "Kafka": {2: 5.0, 3: 1.0}})
    end = cpu.MachineMark(
        (400, 800), {"processor": {1: 1.5}, "Kafka": {2: 5.1, 4: 9.0}, "bench": {5: 1.0}}
    )
    # Kafka: pid 3 exited and pid 4 appeared in between; only pid 2 is counted.
    assert cpu.machine_budget(start, end, 1000) == (
        f"{os.cpu_count()} cores 75 % busy; CPU per command (µs): processor 500, Kafka 100"
    )
    nothing = cpu.MachineMark(None, {"processor": {}})
    assert cpu.machine_budget(nothing, nothing, 1000) == "CPU per command (µs): n/a"


def test_a_machine_mark_reads_running_processes_and_leaves_out_others() -> None:
    gone = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10_000_000
    mark = cpu.machine_mark({"this": [os.getpid()], "gone": [gone]})
    assert mark.parties["this"][os.getpid()] > 0
    assert mark.parties["gone"] == {}
    assert mark.cores is not None and 0 < mark.cores[0] <= mark.cores[1]
