"""``python -m services.bench burst [--sandboxes N] [--rounds R] [--profile DIR]``: the peer
bench's cold burst for sandstream and bare Pods only, with what sandstream spends per sandbox
broken down, in a few minutes (``make bench-peer`` takes eleven at least).

The same set-up as ``peer`` (services/bench/peer_setup.py: a Kubernetes cluster of its own, a
Kafka broker of its own, ``sandstream up --driver kubernetes``), the same burst (N creates at
once, Ready, N deletes at once, gone; services/bench/peer.py's ``Bench.burst``), bare Pods
created by the load generator as the reference, the order reversed every other round. Beside
each sandstream burst it prints, per sandbox: the CPU of ``up``, its broker and its PostgreSQL
backends; the records appended to each of its topics; the rows its PostgreSQL schema inserted,
updated and deleted and the index scans it made (``pg_stat_user_tables``); and the delete's
time to all gone beside bare Pods', with its steps (the client's spread of the requests, the API's
answer and its own times, the command and the result in the log, the Pod gone, the row
Deleted). ``--profile DIR``: py-spy records ``up`` through each of
sandstream's bursts (raw collapsed stacks, one file a round; py-spy comes with the dev install).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.bench import cpu, peer_setup
from services.bench.api_rate import STEPS, Sums, sums
from services.bench.peer import Bench, Parties, orders
from services.bench.peer_kube import Kube
from services.bench.peer_report import CLUSTER_PARTIES, OWN_PARTIES, Plan
from services.bench.peer_stats import (
    BurstFigures,
    counts_delta,
    latencies,
    median,
    render_rows,
    summarize,
)
from services.bench.peer_systems import (
    CONNECTIONS,
    FLOOR,
    OURS,
    BarePods,
    SandstreamApi,
    System,
    Track,
    pod_spec,
    watch_pods,
)
from services.bench.peer_warm import kafka_line
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings

Offsets = dict[str, int]  # topic -> records so far (every partition)
TableStats = dict[str, int]  # "inserted", "updated", "deleted", "index scans", "seq scans",
# and the database's "transactions"
COLUMNS = ("ins", "upd", "del", "idx", "seq")


async def topic_records(settings: Settings) -> Offsets:
    """The records in each of the environment's topics so far (end offsets summed)."""
    consumer = AIOKafkaConsumer(**kafka_client_args(settings, "admin"))
    await consumer.start()
    try:
        parts = [TopicPartition(t, p) for t in settings.topics
                 for p in range(settings.kafka_partitions)]  # fmt: skip
        ends = await consumer.end_offsets(parts)
    finally:
        await consumer.stop()
    found: Offsets = {}
    for tp, end in ends.items():
        found[tp.topic] = found.get(tp.topic, 0) + end
    return found


async def table_stats(pg: asyncpg.Connection[asyncpg.Record], schema: str) -> TableStats:
    """Rows inserted, updated, deleted and scans made in ``schema``'s tables so far."""
    row = await pg.fetchrow(
        "SELECT sum(n_tup_ins) AS ins, sum(n_tup_upd) AS upd, sum(n_tup_del) AS del, "
        "sum(coalesce(idx_scan, 0)) AS idx, sum(seq_scan) AS seq "
        "FROM pg_stat_user_tables WHERE schemaname = $1",
        schema,
    )
    assert row is not None
    keys = ("inserted", "updated", "deleted", "index scans", "seq scans")
    return {k: int(row[c] or 0) for k, c in zip(keys, COLUMNS, strict=True)}


async def settled_stats(pg: asyncpg.Connection[asyncpg.Record], schema: str) -> TableStats:
    """The table statistics once the backends have flushed theirs (PostgreSQL reports a
    backend's counts when it goes idle, within a second): read until two reads agree."""
    last = await table_stats(pg, schema)
    for _ in range(10):
        await asyncio.sleep(1.0)
        now = await table_stats(pg, schema)
        if now == last:
            break
        last = now
    # Every client's statements outside a transaction block are a transaction each, so this
    # counts round trips (the database's: run the bench alone; these reads add about ten).
    return {**last, "transactions": await pg.fetchval(_TRANSACTIONS)}


_TRANSACTIONS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)


def per_sandbox(before: Mapping[str, int], after: Mapping[str, int], n: int) -> str:
    return ", ".join(f"{k} {(after[k] - before.get(k, 0)) / n:.1f}" for k in after)


class Profiler:
    """py-spy recording a process into ``path`` until stopped (nothing when ``path`` is None)."""

    def __init__(self, pid: int, path: Path | None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if path is not None:
            self.path = path
            self.proc = subprocess.Popen(
                [_py_spy(), "record", "--pid", str(pid), "--format", "raw", "--rate", "100",
                 "--nonblocking", "--output", str(path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip

    async def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        await asyncio.to_thread(self.proc.wait, 60)
        print(f"  py-spy samples of `up`: {self.path}", flush=True)


def from_request(track: Track, names: list[str], done: Mapping[str, float]) -> str:
    """p50 / p90 / max of ``names``' times from their delete request to ``done``."""
    s = summarize(latencies({n: track.deleting[n] for n in names}, done), len(names))
    return f"{s.p50:.2f} / {s.p90:.2f} / {s.max:.2f}"


def delete_line(track: Track, prefix: str) -> str:
    """Where a burst's deletes spent their time: the request answered, the Pod gone, the
    system reporting it gone (p50 / p90 from the delete request, seconds)."""
    names = [n for n in track.deleting if n.startswith(prefix)]

    def p(done: Mapping[str, float]) -> str:
        return from_request(track, names, done)

    sent = [track.deleting[n] for n in names]
    # The client sends CONNECTIONS at a time: the last delete leaves this long after the first.
    spread = max(sent) - min(sent) if sent else math.nan
    return (f"deletes: sent over {spread:.2f} s; answered {p(track.delete_answered)}, "
            f"Pod gone {p(track.pod_gone)}, reported gone {p(track.gone)} s "
            "(p50 / p90 / max from the request)")  # fmt: skip


def slowest(track: Track, prefix: str) -> str:
    """The sandbox whose delete took longest to all gone."""
    gone = track.gone_at()
    names = [n for n in track.deleting if n.startswith(prefix)]
    return max(names, key=lambda n: gone.get(n, math.inf) - track.deleting[n])


async def recorded_steps(api: SandstreamApi, track: Track, prefix: str) -> str:
    """The deletes' steps as each sandbox's history recorded them (p50 / p90 / max from the
    request, s): its ``DeleteSandbox`` in the log (the API's part), its delete's result in the
    log (the processor's event, the executor's call, the Pod's removal, the driver's cache),
    the row reported Deleted in the watch (the processor's fold and commit, the change feed)."""
    names = [n for n in track.deleting if n.startswith(prefix)]
    offset = time.time() - time.perf_counter()  # recorded_at is wall-clock
    command: dict[str, float] = {}
    result: dict[str, float] = {}
    gate = asyncio.Semaphore(CONNECTIONS)

    async def one(name: str) -> None:
        async with gate:
            response = await api.client.get(f"/v1/sandboxes/{name}/history", params={"limit": 100})
        for item in response.json().get("items", []) if response.status_code == 200 else []:
            at = datetime.fromisoformat(item["recorded_at"]).timestamp() - offset
            if item["message_type"] == "DeleteSandbox":
                command[name] = at
            elif "delete_" in item["reason"] and item["message_type"] == "DriverOperationResult":
                result[name] = at

    await asyncio.gather(*(one(n) for n in names))
    return (
        f"deletes, as recorded: command in the log {from_request(track, names, command)}, "
        f"result in the log {from_request(track, names, result)} s (p50 / p90 / max from "
        "the request)"
    )


DELETE_ROUTE = ("sandstream_api_request_seconds", "DELETE /v1/sandboxes/{name}")


async def api_sums(api: SandstreamApi) -> Sums:
    return sums((await api.send("GET", "/metrics", (200,))).text)


def api_steps(before: Sums, after: Sums) -> str:
    """The API's own times over the burst (creates and deletes together; its step histogram
    has no command type), beside the deletes' time in the app: is the wait in the app, for
    the pool, or before the app (the event loop, the server)?"""
    in_app, n = after.mean_since(before, DELETE_ROUTE)
    parts = [f"a delete in the app {in_app * 1000:.1f} (of {n:.0f})"]
    for step in STEPS:
        mean, _ = after.mean_since(before, ("sandstream_api_command_step_seconds", step))
        parts.append(f"{step.replace('_', ' ')} {mean * 1000:.1f}")
    return "the API's mean ms: " + ", ".join(parts) + " (steps: creates and deletes)"


async def history_lines(api: SandstreamApi, track: Track, name: str) -> list[str]:
    """The sandbox's history, each input at its recorded time from the delete request (s)."""
    response = await api.client.get(f"/v1/sandboxes/{name}/history", params={"limit": 100})
    if response.status_code != 200:
        return [f"history of {name}: HTTP {response.status_code}"]
    items = response.json()["items"]
    start = track.deleting[name]
    offset = time.time() - time.perf_counter()  # recorded_at is wall-clock
    lines = []
    for item in items:
        at = datetime.fromisoformat(item["recorded_at"]).timestamp() - offset - start
        lines.append(f"{at:+7.2f} s  {item['message_type']:<28} {item['disposition']:<8} "
                     f"{item['phase'] or '':<12} {item['reason'][:90]}")  # fmt: skip
    return lines


def _py_spy() -> str:
    """py-spy beside this interpreter (installed into its virtualenv), else on the PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else "py-spy"


async def warm_up(bench: Bench, api: SandstreamApi, n: int) -> None:
    """An untimed burst of ``n`` through sandstream first: a broker just booted spends its
    first minutes compiling (its JIT), which would count in the first round's figures."""
    print(f"warm-up: a burst of {n} through sandstream, not counted", flush=True)
    plan, bench.plan = bench.plan, dataclasses.replace(bench.plan, sandboxes=n)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            await bench.burst(api, "warm")
    finally:
        bench.plan = plan


def own_ms(f: BurstFigures, label: str) -> dict[str, float]:
    return {p: f.cpu.get(p, 0.0) * 1000 for p in OWN_PARTIES[label]}


def cluster_ms(f: BurstFigures) -> float:
    return sum(f.cpu.get(p, 0.0) for p in CLUSTER_PARTIES) * 1000


def summary(figures: Mapping[str, list[BurstFigures]]) -> str:
    """Each round's figures and the medians: sandstream beside bare Pods."""
    rows = [["round", "system", "p90 → Ready", "all Ready", "delete → all gone",
             "req/sandbox", "own CPU ms/sandbox", "cluster CPU ms/sandbox", "total"]]  # fmt: skip
    for label in (FLOOR, OURS):
        for i, f in enumerate(figures[label]):
            own = own_ms(f, label)
            rows.append([
                str(i + 1), label, f"{f.ready.p90:.2f} s", f"{f.all_ready:.2f} s",
                f"{f.all_gone:.2f} s", f"{f.requests:.1f}",
                f"{sum(own.values()):.1f} (" + ", ".join(f"{v:.1f}" for v in own.values()) + ")"
                if own else "—",
                f"{cluster_ms(f):.1f}", f"{sum(own.values()) + cluster_ms(f):.1f}",
            ])  # fmt: skip
    for label in (FLOOR, OURS):
        runs = figures[label]
        own_median = median(sum(own_ms(f, label).values()) for f in runs)
        rows.append([
            "median", label, f"{median(f.ready.p90 for f in runs):.2f} s",
            f"{median(f.all_ready for f in runs):.2f} s",
            f"{median(f.all_gone for f in runs):.2f} s",
            f"{median(f.requests for f in runs):.1f}", f"{own_median:.1f}" if own_median else "—",
            f"{median(cluster_ms(f) for f in runs):.1f}",
            f"{median(sum(own_ms(f, label).values()) + cluster_ms(f) for f in runs):.1f}",
        ])  # fmt: skip
    return render_rows(rows)


@dataclasses.dataclass
class Stage:
    """What a run on the burst's set-up works with: sandstream (its API, its settings and
    process) and bare Pods on a cluster and broker of their own, both watched."""

    bench: Bench
    api: SandstreamApi
    ours: Any
    pg: asyncpg.Connection[asyncpg.Record]
    tracks: dict[str, Track]


@contextlib.asynccontextmanager
async def stage(settings: Settings, plan: Plan, home: Path) -> AsyncIterator[Stage]:
    """A Kubernetes cluster and a Kafka broker of their own, ``sandstream up`` on them, bare
    Pods beside it and both systems watched, warmed up by an untimed burst."""
    spec = pod_spec(settings.sandbox_image)
    async with (
        peer_setup.private_kafka(settings, home / "kafka") as kafka,
        peer_setup.own_cluster(settings, home / "cluster") as cluster,
    ):
        token = await peer_setup.client_account(cluster, home)
        client = Kube(cluster.server, cluster.ca_file, token, CONNECTIONS)
        await cluster.admin.ensure_namespace("bench-pods")
        async with peer_setup.sandstream(kafka, cluster, home, "bench-sandstream") as ours:
            api = SandstreamApi(ours.url, ours.token, "bench-sandstream", settings.sandbox_image)
            systems: list[System] = [BarePods(client, "bench-pods", spec), api]
            pg = await asyncpg.connect(settings.pg_dsn)
            tracks = {s.label: Track() for s in systems}
            watches = [
                asyncio.ensure_future(w)
                for s in systems
                for w in (
                    s.watch(tracks[s.label]),
                    watch_pods(client, s, tracks[s.label], s.label == FLOOR),
                )
            ]
            try:
                fixed = {
                    **cluster.pids(),
                    # with its API's process when it runs one (SANDSTREAM_UP_API_PROCESS)
                    "sandstream up": [ours.proc.pid, *cpu.children(ours.proc.pid)],
                    "sandstream Kafka": [ours.broker],
                    "bench client": [os.getpid()],
                }
                bench = Bench(plan, cluster.admin, client,
                              Parties(fixed, ours.proc.pid, pg, settings.pg_port),
                              systems, tracks)  # fmt: skip
                await warm_up(bench, api, min(50, plan.sandboxes))
                yield Stage(bench, api, ours, pg, tracks)
            finally:
                for task in watches:
                    task.cancel()
                await asyncio.gather(*watches, return_exceptions=True)
                await pg.close()
                await api.close()
                await client.close()


async def main(settings: Settings, sandboxes: int, rounds: int, profile: Path | None) -> None:
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    home = settings.state_dir / "bench" / f"burst-{run_id}"
    home.mkdir(parents=True)
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
    plan = Plan(sandboxes=sandboxes, rounds=rounds, gap=5.0, timeout=300.0, idle=10.0)
    where = "a process of its own" if settings.up_api_process else "`up`'s process"
    print(f"sandstream beside bare Pods: {rounds} bursts of {sandboxes}, the API in {where}  "
          f"({os.cpu_count()} cores, load average {_load()} at the start)", flush=True)  # fmt: skip
    async with stage(settings, plan, home) as on:
        bench, api, ours, pg, tracks = on.bench, on.api, on.ours, on.pg, on.tracks
        await bench.measure_idle(plan.idle)
        figures: dict[str, list[BurstFigures]] = {FLOOR: [], OURS: []}
        for i, order in enumerate(orders(bench.systems, rounds)):
            print(f"round {i + 1} of {rounds}", flush=True)
            for system in order:
                if system.label == FLOOR:
                    figures[FLOOR].append(await bench.burst(system, f"b{i}"))
                    print(f"  {'':<14} {delete_line(tracks[FLOOR], f'b{i}-')}")
                    continue
                records = await topic_records(ours.settings)
                rows = await settled_stats(pg, ours.settings.pg_schema)
                requests = await api.kafka_requests()
                api_before = await api_sums(api)
                spy = Profiler(ours.proc.pid, profile and profile / f"up-{i + 1}.txt")
                try:
                    figures[OURS].append(await bench.burst(system, f"b{i}"))
                finally:
                    await spy.stop()
                # Before the reads below (the recorded steps read every history).
                now = await settled_stats(pg, ours.settings.pg_schema)
                print(f"  {'':<14} {delete_line(tracks[OURS], f'b{i}-')}")
                steps = await recorded_steps(api, tracks[OURS], f"b{i}-")
                print(f"  {'':<14} {steps}")
                print(f"  {'':<14} {api_steps(api_before, await api_sums(api))}")
                name = slowest(tracks[OURS], f"b{i}-")
                print(f"  {'':<14} the slowest delete's history ({name}):")
                for line in await history_lines(api, tracks[OURS], name):
                    print(f"  {'':<16} {line}")
                sent = counts_delta(requests, await api.kafka_requests())
                per = {k: v / sandboxes for k, v in sent.items()}
                print(f"  {'':<14} {kafka_line(per, 'sandbox')}")
                after = await topic_records(ours.settings)
                print(f"  {'':<14} Kafka records per sandbox: "
                      f"{per_sandbox(records, after, sandboxes)}")  # fmt: skip
                print(f"  {'':<14} PostgreSQL per sandbox (its schema's tables; "
                      "the database's transactions): "
                      f"{per_sandbox(rows, now, sandboxes)}", flush=True)  # fmt: skip
        print(f"\nbursts of {sandboxes} (CPU above each process's idle; own: `up`, its "
              "broker, its PostgreSQL backends)")  # fmt: skip
        print(summary(figures))
    print(f"(load average {_load()} at the end)")
    peer_setup.remove(home)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())
