"""``python -m services.bench peer [--quick] [--sandboxes N] [--rounds R]``: sandstream beside
kubernetes-sigs/agent-sandbox and bare Pods, on one Kubernetes cluster, in one run
(docs/benchmarks.md says what it measures and how to read it). The parts:

- ``peer_setup``: the cluster, broker, controller and ``sandstream up`` the run starts and stops;
- ``peer_systems``: the three systems as the load generator sees them, and the Track of each;
- ``peer_kube``: the Kubernetes client (creates, deletes, watches that resume, manifests);
- ``peer_stats``: readiness, latency figures, the apiserver's counter, the table (pure);
- ``peer_report``: the plan, each phase's line, the medians, the report and the goals (pure);
- this module: the CPU of every process, the phases (bursts, sustained rates) and the run.

Phases, each system in turn (the order reversed every other round, a pause before each, in
which every process's idle CPU is measured): a **burst** of N creates at once, then N deletes;
a **sustained** phase at 20, 30, 45, 60, 75, 90, 120, 150 and 180 creates a second (a step
of a third to a half: the highest rate with p90 under 1 s is known to that step), stopped for
a system once its p90 is over 1 s. On two shared cores the run is CPU-bound: latencies rank
the systems within one run; apiserver requests and CPU per sandbox are the sturdier figures.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import asyncpg

from services.bench import cpu, peer_setup, peer_warm
from services.bench.pacing import open_loop
from services.bench.peer_kube import Kube
from services.bench.peer_report import (
    SUSTAINED_P90,
    Plan,
    burst_line,
    checked,
    failures,
    kept_up,
    median_figures,
    plan,
    ready_line,
    report,
)
from services.bench.peer_stats import (
    BurstFigures,
    Summary,
    counts_delta,
    latencies,
    request_counts,
    span,
    summarize,
    top_requests,
)
from services.bench.peer_systems import (
    CONNECTIONS,
    FLOOR,
    AgentSandboxes,
    BarePods,
    SandstreamApi,
    System,
    Track,
    pod_spec,
    watch_pods,
)
from services.bench.peer_warm_systems import (
    AgentClaims,
    SandstreamClaims,
    WarmSystem,
    watch_claim_pods,
)
from services.common.settings import Settings
from services.localstack import agent_sandbox

__all__ = ["Plan", "plan", "run"]

T = TypeVar("T")


# ------------------------------------------------------------------------------ CPU


Marks = dict[str, dict[int, float]]


def mark(parties: Mapping[str, Iterable[int]]) -> Marks:
    found = {}
    for party, pids in parties.items():
        cpus = {pid: cpu.process_cpu(pid) for pid in pids}
        found[party] = {pid: c for pid, c in cpus.items() if not math.isnan(c)}
    return found


def above_idle(
    used: Mapping[str, float], idle: Mapping[str, float], seconds: float, sandboxes: int
) -> dict[str, float]:
    """CPU seconds per sandbox of each party above what it spends idle in as many seconds."""
    return {p: (c - idle.get(p, 0.0) * seconds) / sandboxes for p, c in used.items()}


def spent(before: Marks, after: Marks) -> dict[str, float]:
    """CPU seconds per party in between; a process that started in between counts whole."""
    return {
        party: sum(c - before.get(party, {}).get(pid, 0.0) for pid, c in pids.items())
        for party, pids in after.items()
    }


@dataclass
class Parties:
    """Every process whose CPU the bench reads, by party."""

    fixed: dict[str, list[int]]
    sandstream_pid: int
    pg: asyncpg.Connection[asyncpg.Record]
    pg_port: int

    async def now(self) -> dict[str, list[int]]:
        # `up` and its children (its API's process, when it runs one)
        pids = [self.sandstream_pid, *cpu.children(self.sandstream_pid)]
        ports = [port for pid in pids for port in cpu.connected_ports(pid, self.pg_port)]
        rows = await self.pg.fetch(
            "SELECT pid FROM pg_stat_activity WHERE client_port = ANY($1::int[])", ports
        )
        return {**self.fixed, "sandstream PostgreSQL": [r["pid"] for r in rows]}


# ------------------------------------------------------------------------------ phases


@dataclass
class Bench:
    plan: Plan
    admin: Kube
    client: Kube  # the load generator's account
    parties: Parties
    systems: list[System]
    tracks: dict[str, Track]
    idle: dict[str, float] = field(default_factory=dict)  # party -> CPU s per s, all idle

    async def measure_idle(self, seconds: float) -> None:
        """Every party's CPU per second while nothing is asked of anyone (both control planes
        running), measured in the pause before each phase: what the phase's CPU figures leave
        out, per second it lasted (an estimate taken once at the start ran high: a broker just
        booted is busier than one a few minutes old)."""
        before, began = mark(await self.parties.now()), time.perf_counter()
        await asyncio.sleep(seconds)
        after, lasted = mark(await self.parties.now()), time.perf_counter() - began
        self.idle = {party: cpu / lasted for party, cpu in spent(before, after).items()}
        shown = ", ".join(f"{p} {c * 1000:.0f}" for p, c in sorted(self.idle.items()) if c)
        print(f"  idle, CPU ms per second over {lasted:.0f} s: {shown}", flush=True)

    async def warm(self, system: System) -> None:
        """Open the client's connections again right before a phase (a server closes those
        left idle: uvicorn after 5 s)."""
        if isinstance(system, SandstreamApi):
            calls = [system.client.get("/v1/sandboxes", params={"limit": 1})
                     for _ in range(CONNECTIONS)]  # fmt: skip
            await asyncio.gather(*calls)
        else:
            path = f"/api/v1/namespaces/{system.namespace}/pods"
            await asyncio.gather(*(self.client.get(path, limit=1) for _ in range(CONNECTIONS)))

    async def cpu_mark(self) -> Marks:
        return mark(await self.parties.now())

    async def cpu_since(
        self, before: Marks, began: float, items: int
    ) -> tuple[dict[str, float], float]:
        """CPU seconds per item of each party since ``before`` (taken at ``began``), above
        idle; and the seconds it spans."""
        after, lasted = mark(await self.parties.now()), time.perf_counter() - began
        return above_idle(spent(before, after), self.idle, lasted, items), lasted

    async def all(self, calls: Iterable[Awaitable[None]]) -> None:
        limit = asyncio.Semaphore(CONNECTIONS)

        async def one(call: Awaitable[None]) -> None:
            async with limit:
                await call

        await asyncio.gather(*(one(c) for c in calls))

    async def request(
        self, track: Track, table: dict[str, float], call: Callable[[str], Awaitable[None]],
        name: str, answered: dict[str, float] | None = None,
    ) -> None:  # fmt: skip
        track.note(table, name)
        try:
            await call(name)
        except Exception as exc:  # noted, and the phase goes on: its figures say how many
            track.failed[name] = f"{type(exc).__name__}: {exc}"
        if answered is not None:
            answered[name] = time.perf_counter()

    def _create(self, track: Track, system: System, name: str) -> Awaitable[None]:
        return self.request(track, track.requested, system.create, name, track.answered)

    async def burst(self, system: System, tag: str) -> BurstFigures:
        track = self.tracks[system.label]
        await self.measure_idle(self.plan.gap)
        await self.warm(system)
        names = [f"{tag}-{i}" for i in range(self.plan.sandboxes)]
        requests_before = request_counts(await self.admin.metrics())
        cpu_before, began = mark(await self.parties.now()), time.perf_counter()
        await self.all(self._create(track, system, n) for n in names)
        await track.until(lambda: track.settled(names, track.ready), self.plan.timeout)
        await self.all(
            self.request(track, track.deleting, system.delete, n, track.delete_answered)
            for n in names
        )
        await track.until(lambda: track.all_gone(names), self.plan.timeout)
        cpu_after, lasted = mark(await self.parties.now()), time.perf_counter() - began
        delta = counts_delta(requests_before, request_counts(await self.admin.metrics()))
        n = len(names)
        requested = {k: track.requested[k] for k in names}
        ready = {k: track.ready[k] for k in names if k in track.ready}
        deleting = {k: track.deleting[k] for k in names}
        figures = BurstFigures(
            ready=summarize(latencies(requested, ready), n),
            all_ready=span(requested, ready),
            all_gone=span(deleting, track.gone_at()),
            requests=sum(delta.values()) / n,
            cpu=above_idle(spent(cpu_before, cpu_after), self.idle, lasted, n),
        )
        answers = summarize(latencies(requested, track.answered), n)
        print(f"  {system.label:<14} {burst_line(system.label, figures)}", flush=True)
        print(f"  {'':<14} creates answered p50 {answers.p50:.2f} p90 {answers.p90:.2f} s; "
              f"{checked(track, names)}; requests: {top_requests(delta, n, 8)}")  # fmt: skip
        return figures

    async def sustained(self, system: System, rate: int, tag: str) -> Summary:
        track = self.tracks[system.label]
        await asyncio.sleep(self.plan.gap)
        await self.warm(system)
        count = round(rate * self.plan.seconds)
        names = [f"{tag}-{i}" for i in range(count)]
        sent, tasks = await open_loop(
            rate, count, lambda i: self._create(track, system, names[i]), CONNECTIONS,
            due=lambda i: track.note(track.requested, names[i]),
        )  # fmt: skip
        await asyncio.gather(*tasks)
        await track.until(lambda: track.settled(names, track.ready), self.plan.settle)
        requested = {k: track.requested[k] for k in names}
        summary = summarize(latencies(requested, track.ready), count)
        answers = summarize(latencies(requested, track.answered), count)
        print(
            f"  {system.label:<14} {rate}/s (sent at {sent:.1f}/s; creates answered p90 "
            f"{answers.p90:.2f} s)  {ready_line(summary)}{failures(track, names)}",
            flush=True,
        )
        await self.all(self.request(track, track.deleting, system.delete, n) for n in names)
        await track.until(lambda: track.all_gone(names), self.plan.timeout)
        return summary


# ------------------------------------------------------------------------------ the run


def orders(systems: Sequence[T], rounds: int) -> list[list[T]]:
    """Each round's order: as given, then reversed, alternating."""
    return [list(systems) if i % 2 == 0 else list(reversed(systems)) for i in range(rounds)]


async def run(settings: Settings, plan: Plan) -> None:
    """The whole run; SIGTERM (and SIGINT) cancel it, and every process it started is stopped
    on the way out."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    await _run(settings, plan)


async def _run(settings: Settings, plan: Plan) -> None:
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    home = settings.state_dir / "bench" / f"peer-{run_id}"
    home.mkdir(parents=True)
    cold = (
        f"bare Pods; cold: bursts of {plan.sandboxes}, sustained "
        f"{', '.join(map(str, plan.rates))}/s"
        if "cold" in plan.phases
        else ""
    )
    warm = (
        f"; warm: pools of {plan.pool}, bursts of {plan.pool} claims, {plan.claim_rate} claims/s"
        if "warm" in plan.phases
        else ""
    )
    print(
        f"sandstream beside agent-sandbox {agent_sandbox.VERSION}{' and ' if cold else ''}"
        f"{cold}{warm}; {plan.rounds} rounds, {plan.seconds:.0f} s per rate  "
        f"({os.cpu_count()} cores, load average {_load()} at the start)",
        flush=True,
    )
    spec = pod_spec(settings.sandbox_image)
    async with (
        peer_setup.private_kafka(settings, home / "kafka") as kafka,  # boots meanwhile
        peer_setup.own_cluster(settings, home / "cluster") as cluster,
    ):
        client_token = await peer_setup.client_account(cluster, home)
        client = Kube(cluster.server, cluster.ca_file, client_token, CONNECTIONS)
        for namespace in ("bench-pods", "bench-agent"):
            await cluster.admin.ensure_namespace(namespace)
        async with (
            peer_setup.agent_controller(
                cluster, home, extensions="cold" not in plan.phases
            ) as controller,
            peer_setup.sandstream(kafka, cluster, home, "bench-sandstream") as ours,
        ):
            ours_api = SandstreamApi(
                ours.url, ours.token, "bench-sandstream", settings.sandbox_image
            )
            systems: list[System] = [
                BarePods(client, "bench-pods", spec),
                AgentSandboxes(client, "bench-agent", spec),
                ours_api,
            ]
            pg = await asyncpg.connect(settings.pg_dsn)
            watches: list[asyncio.Future[None]] = []
            try:
                fixed = {
                    **{name: pids for name, pids in cluster.pids().items()},
                    "agent-sandbox controller": [controller.pid],
                    "sandstream up": [ours.proc.pid],
                    "sandstream Kafka": [ours.broker],
                    "bench client": [os.getpid()],
                }
                parties = Parties(fixed, ours.proc.pid, pg, settings.pg_port)
                tracks = {s.label: Track() for s in systems}
                bench = Bench(plan, cluster.admin, client, parties, systems, tracks)
                pools: list[WarmSystem] = [
                    SandstreamClaims(ours_api),
                    AgentClaims(client, "bench-agent", spec),
                ]
                for s in systems if "cold" in plan.phases else []:
                    track = bench.tracks[s.label]
                    watches.append(asyncio.ensure_future(s.watch(track)))
                    watches.append(
                        asyncio.ensure_future(watch_pods(client, s, track, s.label == FLOOR))
                    )
                for w in pools if "warm" in plan.phases else []:
                    watches.append(asyncio.ensure_future(w.watch()))
                    watches.append(asyncio.ensure_future(watch_claim_pods(client, w)))
                await bench.measure_idle(plan.idle)
                if "cold" in plan.phases:
                    await _phases(bench, systems)
                if "warm" in plan.phases:
                    if not controller.extensions:  # the cold phases ran it as it ships
                        await controller.restart(extensions=True)
                        fixed["agent-sandbox controller"] = [controller.pid]
                    await _warm_phases(bench, pools)
            finally:
                for task in watches:
                    task.cancel()
                await asyncio.gather(*watches, return_exceptions=True)
                await pg.close()
                await ours_api.close()
                await client.close()
    print(f"(load average {_load()} at the end)")
    peer_setup.remove(home)


async def _phases(bench: Bench, systems: Sequence[System]) -> None:
    plan = bench.plan
    bursts: dict[str, list[BurstFigures]] = {s.label: [] for s in systems}
    for i, order in enumerate(orders(systems, plan.rounds)):
        print(f"burst round {i + 1} of {plan.rounds} ({plan.sandboxes} at once)", flush=True)
        for system in order:
            bursts[system.label].append(await bench.burst(system, f"b{i}"))
    sustained: dict[int, dict[str, Summary | None]] = {}
    for i, rate in enumerate(plan.rates):
        print(f"sustained {rate}/s for {plan.seconds:.0f} s", flush=True)
        sustained[rate] = {}
        for system in orders(systems, i + 1)[i]:
            if i and not kept_up(sustained[plan.rates[i - 1]][system.label]):
                print(f"  {system.label:<14} not run: p90 over {SUSTAINED_P90:.0f} s already at "
                      "a lower rate")  # fmt: skip
                sustained[rate][system.label] = None
                continue
            sustained[rate][system.label] = await bench.sustained(system, rate, f"s{rate}")
    print(report(plan, {k: median_figures(v) for k, v in bursts.items()}, sustained))


async def _warm_phases(bench: Bench, pools: Sequence[WarmSystem]) -> None:
    plan = bench.plan
    print(f"warm: pools of {plan.pool} (the same Pod), filled one after the other", flush=True)
    fills = {}
    for w in pools:
        fills[w.label] = await peer_warm.fill(bench, w)
    bursts: dict[str, list[peer_warm.WarmFigures]] = {w.label: [] for w in pools}
    for i, order in enumerate(orders(pools, plan.rounds)):
        print(f"warm burst round {i + 1} of {plan.rounds} ({plan.pool} claims at once)",
              flush=True)  # fmt: skip
        for w in order:
            bursts[w.label].append(await peer_warm.burst(bench, w, f"wb{i}"))
    print(f"warm sustained: {plan.claim_rate} claims/s for {plan.seconds:.0f} s", flush=True)
    steady = {}
    for w in pools:
        steady[w.label] = await peer_warm.sustained(bench, w, plan.claim_rate, "ws")
    for w in pools:
        await w.delete_pool()
    medians = {k: peer_warm.median_warm(v) for k, v in bursts.items()}
    print(peer_warm.warm_report(plan.pool, plan.rounds, medians, fills, plan.claim_rate, steady))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())
