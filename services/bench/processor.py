"""Benchmarks (``make bench``): figures printed, never asserted.

- processor throughput: one processor drains a pre-filled log of commands and observations;
- command-to-row latency: commands paced at a fixed rate, each timed from send until its
  outcome row is committed (seen through the processor's per-batch NOTIFY);
- beside each, references measured in the same run: the same-work ceiling
  (``services.bench.same_work``: the processor's own rows, history, outcomes and outbox with
  the least Python) and the minimal ceiling (``services.bench.ceiling``) on the same log,
  Kafka's own produce-to-consume latency;
- scale-out (two processor processes), rebuild of a 1,000,000-input log, a cProfile by stage
  (``python -m services.bench profile``, not part of ``all``);
- the driver figures of ``services.bench.drivers`` (stop latency, unrelated-sandbox delay).

Each run uses its own topics and PostgreSQL schema and removes them afterwards.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import sys
import time

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from events.codec import encode
from events.commands import CreateSandbox
from events.topics import CHANGES_CHANNEL
from services.bench import ceiling, cpu, same_work_drain
from services.bench.drained import timed_drain
from services.bench.workload import SPEC, T0, lifecycle_messages, produce_all
from services.common.kafka_clients import kafka_client_args
from services.common.notify_channels import listen
from services.common.settings import Settings
from services.localstack.config import kafka_paths
from services.localstack.isolation import isolated
from services.processor.consumer import Processor


async def throughput(settings: Settings, keys: int, max_records: int) -> None:
    """The minimal ceiling, the same-work ceiling (into a schema of its own), then the
    processor, on one generated log; prints the three and the processor's ratio to the
    same-work ceiling in inputs per second and in CPU per input (absolute figures move 2x
    between runs here; the ratios are what to steer by).

    The processor and the same-work ceiling are like for like: both overlap a poll's write
    with the next poll's read and decision and publish off the poll's path, both read each
    poll's offsets, rows, outcomes and chain heads and decide on them, and one observer times
    both from the first commit until every input is committed and published
    (``services.bench.drained``). The minimal ceiling (serial, no guarantees but exactly-once)
    is printed for scale only."""
    async with (
        isolated(settings, "bench") as (s, pool),
        isolated(settings, "bench-same") as (same, _),
    ):
        records, total = lifecycle_messages(keys)
        await produce_all(s, records)
        broker = cpu.broker_pid(kafka_paths(s).pid)
        roof, _ = await ceiling.measured_drain(s, total, max_records, broker)
        same_s = s.model_copy(update={"pg_schema": same.pg_schema})
        work = await same_work_drain.measured_drain(same_s, total, max_records, broker)
        processor = Processor(s, pool, max_records=max_records, name="bench")
        await processor.start()
        stop = asyncio.Event()
        task = asyncio.create_task(processor.run(stop))
        mine = await timed_drain(s, total, lambda: _backend_pids(processor), broker)
        stop.set()
        await task
        await processor.stop()
        print(
            f"throughput  {total:>7} inputs  max_records={max_records:<6} "
            f"processor {mine.rate:>9,.0f}/s  same-work ceiling {work.rate:>9,.0f}/s  "
            f"minimal ceiling {roof:>9,.0f}/s\n"
            f"            processor/same-work: inputs/s {mine.rate / work.rate:.2f}  "
            f"CPU per input {_cpu_ratio(work.used, mine.used)}\n"
            f"            CPU: processor {mine.used or 'n/a'}; same-work {work.used or 'n/a'}"
        )


def _cpu_ratio(ceiling_used: cpu.PerInput | None, used: cpu.PerInput | None) -> str:
    """The ceiling's CPU per input over the processor's (1.0: as lean; the goal is 0.7 or
    more): of the drainer's own process, and with its PostgreSQL backends."""
    if ceiling_used is None or used is None:
        return "n/a"
    text = f"own {ceiling_used.process / used.process:.2f}"
    if ceiling_used.postgres is not None and used.postgres is not None:
        mine = used.process + used.postgres
        text += f", own + PostgreSQL {(ceiling_used.process + ceiling_used.postgres) / mine:.2f}"
    return text


def _backend_pids(processor: Processor) -> list[int]:
    """The PostgreSQL backends of the processor's batch, decide-ahead and publish-cursor
    connections."""
    return [c.get_server_pid() for c in processor.connections()]


async def latency(settings: Settings, rate: int, seconds: float) -> None:
    """Commands paced at ``rate``/s against a processor running in its own process."""
    async with isolated(settings, "bench") as (s, _):
        processor = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.processor",
            env={**os.environ, **s.as_env()},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await _paced_commands(s, rate, seconds, processor.pid)
        finally:
            processor.terminate()
            await asyncio.wait_for(processor.wait(), 30)


async def _paced_commands(s: Settings, rate: int, seconds: float, processor: int) -> None:
    sent: dict[str, float] = {}
    done: dict[str, float] = {}
    woken = asyncio.Event()
    listener = await asyncpg.connect(s.pg_dsn, server_settings={"search_path": s.pg_schema})
    await listen(listener, CHANGES_CHANNEL, lambda *_: woken.set())
    # Its own connection, not the pool's: a pool connection is reset (a round trip) per use.
    reader = await asyncpg.connect(s.pg_dsn, server_settings={"search_path": s.pg_schema})
    finished = asyncio.Event()

    pending: set[str] = set()  # sent, outcome not seen yet (kept small: no scans of `sent`)

    async def collect() -> None:
        while not finished.is_set():
            await woken.wait()
            woken.clear()
            seen_at = time.perf_counter()
            rows = await reader.fetch(
                "SELECT command_id FROM command_outcomes WHERE command_id = ANY($1)",
                list(pending),
            )
            for r in rows:
                pending.discard(r["command_id"])
                done.setdefault(r["command_id"], seen_at)

    producer = AIOKafkaProducer(
        **kafka_client_args(s, "api"), enable_idempotence=True, acks="all", linger_ms=0
    )
    await producer.start()
    collector = asyncio.create_task(collect())
    # Kafka's own produce -> consume latency at the same rate, in the same run: a plain
    # consumer of the commands topic notes when each command arrives.
    arrived: dict[str, float] = {}
    kafka_reader = await _tail_reader(s)
    tail = asyncio.create_task(_note_arrivals(kafka_reader, arrived, finished))
    try:
        # Warm up: wait until the processor has joined and applied a first command.
        warm = CreateSandbox(type="CreateSandbox", command_id="warm", key="warm", spec=SPEC,
                             occurred_at=T0, actor="bench")  # fmt: skip
        await producer.send_and_wait(s.topic_commands, value=encode(warm), key=b"warm")
        sent["warm"] = time.perf_counter()
        pending.add("warm")
        while "warm" not in done:
            await asyncio.sleep(0.05)
        count = int(rate * seconds)
        commands = [
            CreateSandbox(type="CreateSandbox", command_id=f"lat-{i}", key=f"lat-{i}", spec=SPEC,
                          occurred_at=T0, actor="bench")
            for i in range(count)
        ]  # fmt: skip
        payloads = [encode(c) for c in commands]
        # Not on `reader`: the collector may be using it (asyncpg refuses a second query).
        parties = await _parties(s, listener, processor)
        cpu_begin, machine_begin = cpu.process_cpu(processor), cpu.machine_mark(parties)
        begin = time.perf_counter()
        for i, command in enumerate(commands):
            delay = begin + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[command.command_id] = time.perf_counter()
            pending.add(command.command_id)
            await producer.send(s.topic_commands, value=payloads[i], key=command.key.encode())
        await producer.flush()
        achieved = count / (time.perf_counter() - begin)
        deadline = time.perf_counter() + 30
        while len(done) < len(sent) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        used = cpu.process_cpu(processor) - cpu_begin
        machine = cpu.machine_budget(machine_begin, cpu.machine_mark(parties), count)
        finished.set()
        woken.set()
        await collector
        await tail
        started = await _write_started(reader)
    finally:
        # Every client stops before the caller removes the topics and their ACLs, whatever
        # happened: one left running logs "not authorized" for each topic until it ends.
        finished.set()
        for task in (collector, tail):
            task.cancel()  # (done already unless something failed)
        await asyncio.wait([collector, tail])
        await kafka_reader.stop()
        await producer.stop()
        await listener.close()
        await reader.close()
    ms = sorted((done[c] - sent[c]) * 1000 for c in done if c != "warm")
    kafka_ms = sorted((arrived[c] - sent[c]) * 1000 for c in arrived if c in sent and c != "warm")
    q, k = statistics.quantiles(ms, n=100), statistics.quantiles(kafka_ms, n=100)
    print(
        f"latency     {len(ms)}/{count} commands at {rate}/s (sent {achieved:,.0f}/s)  "
        f"command->row p50 {q[49]:.1f} ms  p99 {q[98]:.1f} ms  max {ms[-1]:.1f} ms  |  "
        f"Kafka alone p50 {k[49]:.1f} ms  p99 {k[98]:.1f} ms  |  p99 ratio {q[98] / k[98]:.1f}"
        f"\n            {_stages(sent, arrived, started, done, q[98])}"
        f"\n            CPU: processor {used / count * 1e6:.0f} µs/command"
        f"\n            machine, while sending: {machine}"
    )


def _stages(
    sent: dict[str, float],
    arrived: dict[str, float],
    started: dict[str, float],
    done: dict[str, float],
    p99: float,
) -> str:
    """Where a command's time goes, for all and for the slowest 1 %: Kafka (send -> Kafka's
    own reader has it), the processor before its write (-> the write's transaction began:
    polling, reading, deciding, and the cycle in progress), and the write (-> the row seen
    committed: the statement, its commit, the NOTIFY)."""
    timed = [c for c in done if c != "warm" and c in arrived and c in started]
    slow = [c for c in timed if (done[c] - sent[c]) * 1000 >= p99]
    parts = {
        "Kafka": (sent, arrived),
        "before the write": (arrived, started),
        "the write": (started, done),
    }
    text = []
    for name, (since, until) in parts.items():
        every = statistics.median(until[c] - since[c] for c in timed) * 1000
        tail = statistics.median(until[c] - since[c] for c in slow) * 1000 if slow else math.nan
        text.append(f"{name} {every:.1f} / {tail:.1f}")
    return "stages, median of all / of the slowest 1 % (ms): " + ", ".join(text)


async def _write_started(conn: asyncpg.Connection[asyncpg.Record]) -> dict[str, float]:
    """Per command, when the write that decided it began (its transaction's start), on this
    process's ``perf_counter`` clock (one machine: the wall clocks agree)."""
    offset = time.time() - time.perf_counter()
    rows = await conn.fetch(
        "SELECT command_id, extract(epoch FROM decided_at)::float8 AS at FROM command_outcomes"
    )
    return {r["command_id"]: r["at"] - offset for r in rows}


async def _parties(
    s: Settings, conn: asyncpg.Connection[asyncpg.Record], processor: int
) -> dict[str, list[int]]:
    """Who shares the cores in a latency run: the processor, every PostgreSQL backend of the
    cluster (others' too: meaningful on a quiet machine), the local broker and this process
    (the load generator, Kafka's own reader and the row watcher)."""
    backends = [r["pid"] for r in await conn.fetch("SELECT pid FROM pg_stat_activity")]
    broker = cpu.broker_pid(kafka_paths(s).pid)
    return {
        "processor": [processor],
        "PostgreSQL": backends,
        "Kafka": [] if broker is None else [broker],
        "bench": [os.getpid()],
    }


async def _tail_reader(s: Settings) -> AIOKafkaConsumer:
    """A group-less consumer of the commands topic, positioned at its end."""
    reader = AIOKafkaConsumer(
        **kafka_client_args(s, "audit"),
        enable_auto_commit=False,
        fetch_max_wait_ms=s.processor_fetch_max_wait_ms,
    )
    await reader.start()
    parts = [TopicPartition(s.topic_commands, p) for p in range(s.kafka_partitions)]
    reader.assign(parts)
    await reader.seek_to_end(*parts)
    for tp in parts:  # resolve the end offsets now, before anything is sent
        await reader.position(tp)
    return reader


async def _note_arrivals(
    reader: AIOKafkaConsumer, arrived: dict[str, float], finished: asyncio.Event
) -> None:
    while not finished.is_set():
        batch = await reader.getmany(timeout_ms=100)
        seen_at = time.perf_counter()
        for records in batch.values():
            for record in records:
                arrived.setdefault(json.loads(record.value)["command_id"], seen_at)
