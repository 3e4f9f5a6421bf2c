"""The scaling figure (``python -m services.bench scaling [--quick]``): the processor and the
executor as 1, 2 and 4 processes of the real role commands, one consumer group each, on three
brokers of the bench's own and the shared PostgreSQL, each figure beside Kafka's own on the
same brokers in the same run.

- **Processor**: the processes share the partitions out on empty topics, then a generated log
  (``workload``: four inputs per sandbox, every one a state change) is produced and drained,
  timed until every input is committed and published (``drained``). Checked, not only timed:
  the inputs each process's partitions held (its share), every input recorded once and applied
  to its row (history holds each input's position once; each row took its four inputs). Then
  creates at a steady rate below saturation, each timed to its row. Beside them: the log's
  produce (``acks=all``, three replicas) and a plain consumer reading it, and Kafka's own
  produce → consume latency at the same steady rate.
- **Executor**, with the fake driver (in-memory, one per process): the control path, not a
  container runtime. One processor decides a backlog of creates while no executor runs; then
  the executors start together (the brokers' initial rebalance delay gives them one
  assignment) and handle the launch intents: events a second from the first result to the
  last (the broker's append times), each sandbox launched once, every row Ready. Then creates
  at a steady rate below saturation, each timed create → Ready (through both processor hops).
- CPU per input (per event) of everything that does the work: the role processes, their
  PostgreSQL backends and the three brokers (from /proc; the load generator left out), with
  how busy the cores were and the load average.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from events.codec import encode
from services.bench import cpu
from services.bench.drained import applied, timed_drain
from services.bench.scaling_stack import Brokers, Roles, parties, running, three_brokers
from services.bench.steady import READY, ROW, Steady, create, steady_creates
from services.bench.workload import lifecycle_messages, produce_all
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack.isolation import isolated


@dataclass(frozen=True)
class Plan:
    counts: tuple[int, ...] = (1, 2, 4)
    keys: int = 10_000  # sandboxes of the processor's log (four inputs each)
    creates: int = 3_000  # the executors' backlog
    seconds: float = 10.0  # of each steady rate
    max_rate: int = 250  # the steady rates: a quarter of one process's drain, at most this
    partitions: int = 12  # the product's default
    rebalance_delay_ms: int = 3_000  # Kafka's default
    logs: Path | None = None  # the role processes' logs (default: a directory of the run's)
    idle_seconds: float = 5.0  # the brokers' idle CPU, measured first


def plan(quick: bool) -> Plan:
    if quick:
        return Plan(keys=2_000, creates=600, seconds=3.0)
    return Plan()


@dataclass
class Figure:
    """One role at one process count."""

    role: str
    count: int
    work: int  # inputs (processor) or events (executor) timed
    rate: float  # of them a second
    shares: list[int]  # the work each process's partitions held
    correct: bool  # every input on its row once / every sandbox launched once and Ready
    checked: str  # what was checked, in words
    rebalanced: bool  # an assignment changed while it was timed
    cpu_us: dict[str, float]  # per input (event), by party
    busy: float | None  # of the cores, while timed
    load: tuple[float, float]  # the 1-minute load average before and after
    reference: str  # Kafka's own throughput on the same brokers, same run
    steady: Steady | None = None
    window: tuple[float, int] = (0.0, 0)  # the CPU's: seconds, units of work in it

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu_us.values())


async def main(settings: Settings, quick: bool) -> list[Figure]:
    return await run(settings, plan(quick))


async def run(settings: Settings, plan: Plan) -> list[Figure]:
    figures: list[Figure] = []
    async with three_brokers(settings, plan.partitions, plan.rebalance_delay_ms) as brokers:
        run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        logs = plan.logs or settings.state_dir / "bench" / f"scaling-{run_id}"
        await _warm_up(brokers.settings, plan.keys)
        idle = await _idle_ms(brokers.pids, plan.idle_seconds)
        print(
            f"scaling  three brokers of the run's own (replication 3, min ISR 2), "
            f"{plan.partitions} partitions, the shared PostgreSQL; {os.cpu_count()} cores; "
            f"load {os.getloadavg()[0]:.1f}; the brokers idle: {idle:.0f} ms CPU/s; "
            f"role logs {logs}"
        )
        rate = None
        for count in plan.counts:
            figure = await processor_figure(brokers, count, plan, rate, logs)
            rate = rate or (figure.steady.rate if figure.steady else None)
            figures.append(_shown(figure, idle))
        # a create is two processor inputs (the create, the launch's result)
        cap, rate = (rate or 20) // 2, None
        for count in plan.counts:
            figure = await executor_figure(brokers, count, plan, rate, logs, cap)
            rate = rate or (figure.steady.rate if figure.steady else None)
            figures.append(_shown(figure, idle))
    _summary(figures, idle)
    return figures


async def _warm_up(settings: Settings, keys: int) -> None:
    """The processor's log produced and read once, untimed, on topics of its own: brokers
    just started run their first requests interpreted (the JVM's JIT has not compiled them
    yet), which would count against whichever figure comes first."""
    async with isolated(settings, "scale-w") as (s, _):
        records, _ = lifecycle_messages(keys)
        await produce_all(s, records)
        await _read_all(s, [s.topic_commands, s.topic_observations])


async def _idle_ms(pids: list[int], seconds: float) -> float:
    """The brokers' CPU ms a second with no client of the run's (the reference their CPU per
    input includes: replication fetches, the controllers' quorum)."""
    start, began = cpu.machine_mark({"Kafka": pids}), time.perf_counter()
    await asyncio.sleep(seconds)
    used = cpu.party_seconds(start, cpu.machine_mark({"Kafka": pids})).get("Kafka", 0.0)
    return used / (time.perf_counter() - began) * 1000


def _steady_rate(single: float, plan: Plan, rate: int | None, cap: int | None = None) -> int:
    """``rate`` if given (the single process's, kept for every count); else well below
    saturation: a quarter of what one process drained (the brokers, PostgreSQL and the load
    generator share the cores), at most ``max_rate`` (and ``cap``)."""
    if rate is not None:
        return rate
    return max(10, min(plan.max_rate, cap or plan.max_rate, int(single / 4 / 10) * 10))


async def processor_figure(
    brokers: Brokers, count: int, plan: Plan, rate: int | None, logs: Path
) -> Figure:
    load = os.getloadavg()[0]
    async with isolated(brokers.settings, "scale-p") as (s, pool):
        records, total = lifecycle_messages(plan.keys)
        began = time.perf_counter()
        await produce_all(s, records)
        produced = total / (time.perf_counter() - began)
        consumed = await _read_rate(s, [s.topic_commands, s.topic_observations])
        roles = Roles("processor", count, s, logs / f"processor-x{count}")
        async with running(roles):
            start, before = await _started(s, pool, [roles], brokers)
            began = time.perf_counter()
            drained = await timed_drain(s, total)
            end = await _mark(s, [roles], brokers)
            window = time.perf_counter() - began
            by_partition, correct, checked = await _recorded_once(pool, total, plan.keys)
            steady = await steady_creates(s, _steady_rate(drained.rate, plan, rate),
                                          plan.seconds, "steady", ROW)  # fmt: skip
            assignments = roles.assignments()
    shares = [sum(by_partition.get(p, 0) for p in a[-1]) for a in assignments]
    return Figure(
        "processor", count, drained.timed, drained.rate, shares, correct, checked,
        _rebalanced(assignments), _per(start, end, total - before), cpu.cores_busy(start, end),
        (load, os.getloadavg()[0]),
        f"Kafka alone: the log produced at {produced:,.0f}/s (acks=all), read by one plain "
        f"consumer at {consumed:,.0f}/s", steady, (window, total - before),
    )  # fmt: skip


async def _started(
    s: Settings, pool: asyncpg.Pool[asyncpg.Record], roles: list[Roles], brokers: Brokers
) -> tuple[cpu.MachineMark, int]:
    """Once the last role's processes hold their shares: the CPU mark the timed window starts
    at (their start-up left out) and the inputs recorded by then (left out of the count)."""
    await roles[-1].shared_out(s.kafka_partitions)
    mark = await _mark(s, roles, brokers)
    return mark, await applied(pool)


async def _mark(s: Settings, roles: list[Roles], brokers: Brokers) -> cpu.MachineMark:
    conn = await asyncpg.connect(s.pg_dsn)
    try:
        return cpu.machine_mark(await parties(conn, s, roles, brokers))
    finally:
        await conn.close()


def _rebalanced(assignments: list[list[set[int]]]) -> bool:
    """Whether a process was given partitions more than once (a rebalance while it worked)."""
    return any(len(a) != 1 for a in assignments)


async def _recorded_once(
    pool: asyncpg.Pool[asyncpg.Record], total: int, keys: int
) -> tuple[dict[int, int], bool, str]:
    """Inputs recorded by partition; whether every input was recorded once and every row
    moved once per input applied to it (history is unique by input position; an applied
    input adds one to its row's version), and what was found."""
    rows = await pool.fetch("SELECT partition, count(*) AS n FROM history GROUP BY partition")
    recorded = sum(r["n"] for r in rows)
    row = await pool.fetchrow(
        "SELECT count(*) AS found, count(*) FILTER (WHERE version = (SELECT count(*) "
        "FROM history h WHERE h.key = s.key AND h.disposition = 'applied')) AS moved "
        "FROM sandboxes s"
    )
    assert row is not None
    found, moved = row["found"], row["moved"]
    checked = (
        f"{recorded:,} of {total:,} inputs recorded once; {moved:,} of {keys:,} rows at the "
        f"version of the inputs applied to them"
    )
    return (
        {r["partition"]: r["n"] for r in rows},
        recorded == total and found == moved == keys,
        checked,
    )


async def executor_figure(
    brokers: Brokers, count: int, plan: Plan, rate: int | None, logs: Path, cap: int | None
) -> Figure:
    load = os.getloadavg()[0]
    fake = brokers.settings.model_copy(update={"driver": "fake", "fake_state_file": None})
    async with isolated(fake, "scale-e") as (s, pool):
        processor = Roles("processor", 1, s, logs / f"executor-x{count}-processor")
        executors = Roles("executor", count, s, logs / f"executor-x{count}")
        async with running(processor):
            await processor.shared_out(s.kafka_partitions)
            keys = [f"backlog-{i}" for i in range(plan.creates)]
            await produce_all(s, [("commands", k.encode(), encode(create(k))) for k in keys])
            await timed_drain(s, plan.creates)  # decided and published: the intents wait
            async with running(executors):
                await executors.shared_out(s.kafka_partitions)
                start, since = await _mark(s, [executors, processor], brokers), time.time()
                began = time.perf_counter()
                await _all_ready(pool, plan.creates)
                end = await _mark(s, [executors, processor], brokers)
                window = time.perf_counter() - began
                results = await _results(s)
                intents = await _read_rate(s, [s.topic_events])
                steady = await steady_creates(s, _steady_rate(_rate(results), plan, rate, cap),
                                              plan.seconds, "steady", READY)  # fmt: skip
                assignments = executors.assignments()
    shares = [sum(1 for r in results if r.partition in a[-1]) for a in assignments]
    launched = Counter(r.key for r in results)
    correct = sorted(launched) == sorted(keys) and set(launched.values()) == {1}
    timed = sum(1 for r in results if r.at >= since)
    return Figure(
        "executor", count, len(results), _rate(results), shares, correct,
        f"{len(launched):,} of {plan.creates:,} sandboxes launched, "
        f"{sum(launched.values()):,} results; every row Ready", _rebalanced(assignments),
        _per(start, end, timed), cpu.cores_busy(start, end), (load, os.getloadavg()[0]),
        f"Kafka alone: the events topic read by one plain consumer at {intents:,.0f}/s",
        steady, (window, timed),
    )  # fmt: skip


@dataclass(frozen=True)
class Result:
    key: str
    partition: int
    at: float  # the broker's append time, s


def _rate(results: list[Result]) -> float:
    """Results a second, from the first to the last one's append time."""
    if len(results) < 2:
        return float("nan")
    times = sorted(r.at for r in results)
    return (len(times) - 1) / max(times[-1] - times[0], 1e-3)


async def _all_ready(pool: asyncpg.Pool[asyncpg.Record], total: int, timeout: float = 600) -> None:
    async with asyncio.timeout(timeout):
        while await pool.fetchval("SELECT count(*) FROM sandboxes WHERE phase = 'Ready'") < total:
            await asyncio.sleep(0.02)


async def _results(s: Settings) -> list[Result]:
    """Every driver result on the observations topic (the executors' reports)."""
    found = []
    for record in await _read_all(s, [s.topic_observations]):
        body = json.loads(record.value)
        if body.get("type") == "DriverOperationResult":
            found.append(Result(body["key"], record.partition, record.timestamp / 1000))
    return found


async def _read_rate(s: Settings, topics: list[str]) -> float:
    """Records a second one plain consumer reads the topics at, from the beginning."""
    began = time.perf_counter()
    read = len(await _read_all(s, topics))
    return read / (time.perf_counter() - began)


async def _read_all(s: Settings, topics: list[str]) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record of ``topics`` up to their ends now, read by a group-less consumer."""
    reader = AIOKafkaConsumer(
        **kafka_client_args(s, "audit"), enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await reader.start()
    try:
        parts = [TopicPartition(t, p) for t in topics for p in range(s.kafka_partitions)]
        reader.assign(parts)
        await reader.seek_to_beginning(*parts)
        ends = await reader.end_offsets(parts)
        records: list[ConsumerRecord[bytes, bytes]] = []
        while [tp for tp in parts if await reader.position(tp) < ends[tp]]:
            for batch in (await reader.getmany(timeout_ms=200, max_records=10_000)).values():
                records.extend(batch)
        return records
    finally:
        await reader.stop()


def _per(start: cpu.MachineMark, end: cpu.MachineMark, count: int) -> dict[str, float]:
    return {k: v / max(count, 1) * 1e6 for k, v in cpu.party_seconds(start, end).items()}


def _shown(f: Figure, idle_ms: float) -> Figure:
    unit = "inputs" if f.role == "processor" else "events"
    shares = ", ".join(f"{n:,}" for n in f.shares)
    timed = "command → row" if f.role == "processor" else "create → Ready"
    parts = ", ".join(f"{k} {v:.0f}" for k, v in f.cpu_us.items())
    idle, seconds = _idle_share(f, idle_ms), f.window[0]
    busy = "" if f.busy is None else f"; cores {f.busy * 100:.0f} % busy"
    busy += f", {_own_share(f) * 100:.0f} % of them these parties'"
    cpu_line = (
        f"CPU per {unit[:-1]}: {f.cpu_total:.0f} µs ({parts}; of Kafka's, "
        f"{idle:.0f} its idle rate over {seconds:.1f} s){busy}"
        if f.window[1]
        else f"CPU per {unit[:-1]}: none timed (drained before every process held its share)"
    )
    print(
        f"{f.role:<9} {_processes(f.count)}  {f.work:,} {unit} at {f.rate:,.0f}/s  "
        f"(per process: {shares}){'  REBALANCED while timed' if f.rebalanced else ''}\n"
        f"             {f.reference}\n"
        f"             {'correct' if f.correct else 'WRONG'}: {f.checked}\n"
        f"             steady, {timed}: {f.steady}\n"
        f"             {cpu_line}; load {f.load[0]:.1f} → {f.load[1]:.1f}"
    )
    return f


def _summary(figures: list[Figure], idle_ms: float) -> None:
    """Each count's rate, p99 and CPU per unit of work beside the single process's."""
    for role in ("processor", "executor"):
        mine = [f for f in figures if f.role == role]
        if not mine:
            continue
        one = mine[0]
        text = "; ".join(
            f"{_processes(f.count)}: {_ratio(f.rate, one.rate):.2f} of one's rate, p99 "
            f"{f.steady.p(99) if f.steady else float('nan'):.1f} ms, "
            f"CPU per unit {_ratio(f.cpu_total, one.cpu_total):.2f} of one's"
            for f in mine
        )
        print(f"scaling   {role}: {text}")
        print(f"          {_per_core(one, idle_ms)}")
        cores = os.cpu_count() or 1
        bound = "; ".join(
            f"{_processes(f.count)} {_ratio(cores * 1e6, f.cpu_total):,.0f}/s "
            f"(measured {f.rate * f.cpu_total / cores / 1e6 * 100:.0f} % of it)"
            for f in mine
        )
        print(
            f"          CPU-bound on these {cores} cores alone, at each run's CPU per unit: {bound}"
        )


def _ratio(a: float, b: float) -> float:
    """a / b, NaN when b is 0 (a log drained in its first batch times nothing)."""
    return a / b if b else float("nan")


def _own_share(f: Figure) -> float:
    """The share of the cores the parties counted used while timed."""
    seconds, units = f.window
    return f.cpu_total * units / 1e6 / max(seconds, 1e-9) / (os.cpu_count() or 1)


def _per_core(f: Figure, idle_ms: float) -> str:
    """What a core of each party's own would sustain at the single process's CPU per unit of
    work (Kafka's above its idle rate): where more machines stop (one consumer group: at most
    as many busy processes as partitions)."""
    unit = "inputs" if f.role == "processor" else "events"
    used = dict(f.cpu_us)
    used["Kafka"] = used.get("Kafka", 0.0) - _idle_share(f, idle_ms)
    rates = ", ".join(f"{party} {1e6 / us:,.0f}" for party, us in used.items() if us > 0)
    return (
        f"{unit}/s a core of each would sustain, at one process's CPU per unit "
        f"(Kafka's above its idle rate): {rates}"
    )


def _idle_share(f: Figure, idle_ms: float) -> float:
    """µs per unit of work of the brokers' idle rate over the figure's CPU window."""
    seconds, units = f.window
    return idle_ms / 1000 * seconds / max(units, 1) * 1e6


def _processes(count: int) -> str:
    return f"{count} process" + ("es" if count > 1 else "")
