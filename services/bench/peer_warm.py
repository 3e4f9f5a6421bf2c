"""The peer benchmark's warm phase (``python -m services.bench peer --phases warm``, and after
the cold phases in ``make bench-peer``): agent-sandbox's SandboxWarmPool beside a sandstream
pool of the same size and the same Pod, on the same cluster, in the same run
(services/bench/peer_warm_systems.py says how each is driven and what each reports).

- **fill**: each pool created and timed until its system reports every member Ready;
- **burst** (each round, the order alternating): as many claims at once as the pool has
  members; request → Ready (each system's own report) p50/p90/p99, how many were served warm,
  the Pods of the claims verified Running+Ready; the **refill** (from the first claim to the
  pool reporting every member Ready again); apiserver requests and CPU per claim over the
  same span (claims and refill; the releases after it are not counted);
- **sustained**: claims at a steady rate for the phase's seconds, the pool refilling as they
  come: request → Ready p50/p90/p99 and the share served warm.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.bench.peer_kube import Kube
from services.bench.peer_report import CLUSTER_PARTIES, OWN_PARTIES, Plan, ready_line
from services.bench.peer_stats import (
    Summary,
    counts_delta,
    latencies,
    median,
    render_rows,
    request_counts,
    summarize,
    top_requests,
)
from services.bench.peer_systems import CONNECTIONS, OURS, PEER, Track
from services.bench.peer_warm_systems import AgentClaims, ClaimTrack, WarmSystem

GOAL_P50 = 0.050  # s: sandstream's warm claim p50 (issue 38)


class Bench(Protocol):
    """What the warm phase uses of the run (services/bench/peer.py's Bench)."""

    plan: Plan
    admin: Kube

    async def measure_idle(self, seconds: float) -> None: ...
    async def cpu_mark(self) -> Any: ...
    async def cpu_since(
        self, before: Any, began: float, items: int
    ) -> tuple[dict[str, float], float]: ...
    async def all(self, calls: Iterable[Awaitable[None]]) -> None: ...
    def request(
        self, track: Track, table: dict[str, float], call: Callable[[str], Awaitable[None]],
        name: str, answered: dict[str, float] | None = None,
    ) -> Awaitable[None]: ...  # fmt: skip


@dataclass(frozen=True)
class WarmFigures:
    ready: Summary  # request → Ready
    warm: int  # claims served warm
    refill: float  # s from the first claim to the pool full again (NaN: never emptied / not)
    requests: float  # apiserver requests per claim
    cpu: dict[str, float]  # party -> CPU s per claim above idle
    # (client, request type) -> Kafka requests per claim (sandstream's `up`; none for the peer)
    kafka: dict[tuple[str, str], float] = field(default_factory=dict)


def warm_count(system: WarmSystem, names: Sequence[str]) -> int:
    if isinstance(system, AgentClaims):
        return sum(bool(system.warm_of(n)) for n in names)
    return sum(system.track.warm.get(n, False) for n in names)


def verified(track: ClaimTrack, names: Sequence[str]) -> str:
    """How many claims reported Ready had their Pod seen Running+Ready with an IP, and how
    many of those before the report (a warm claim's Pod is Ready before it is claimed)."""
    ready = [n for n in names if n in track.ready]
    seen = [n for n in ready if track.pod.get(n) in track.pod_ready_at]
    before = sum(track.pod_ready_at[track.pod[n]] <= track.ready[n] for n in seen)
    failed = [track.failed[n] for n in names if n in track.failed]
    more = f"; {len(failed)} requests failed, e.g. {failed[0]}" if failed else ""
    return (
        f"Pods seen Running+Ready with an IP: {len(seen)}/{len(ready)} of those reported Ready "
        f"({before} seen before the report){more}"
    )


async def _until_full(system: WarmSystem, size: int, timeout: float) -> bool:
    return await system.track.until(lambda: system.track.pool_ready >= size, timeout)


async def fill(bench: Bench, system: WarmSystem) -> float:
    """Create the system's pool; the seconds until it reports every member Ready."""
    size, began = bench.plan.pool, time.perf_counter()
    await system.create_pool(size)
    if not await _until_full(system, size, bench.plan.timeout):
        print(f"  {system.label:<14} pool of {size}: ONLY {system.track.pool_ready} Ready after "
              f"{bench.plan.timeout:.0f} s")  # fmt: skip
        return math.nan
    took = time.perf_counter() - began
    print(f"  {system.label:<14} pool of {size} filled (all Ready) in {took:.2f} s", flush=True)
    return took


async def _claims(bench: Bench, system: WarmSystem, names: Sequence[str]) -> None:
    track = system.track
    calls = (bench.request(track, track.requested, system.claim, n, track.answered) for n in names)
    await bench.all(calls)


async def _release(bench: Bench, system: WarmSystem, names: Sequence[str]) -> None:
    track = system.track
    await bench.all(bench.request(track, track.deleting, system.release, n) for n in names)
    await track.until(lambda: track.settled(names, track.gone), bench.plan.timeout)


async def burst(bench: Bench, system: WarmSystem, tag: str) -> WarmFigures:
    plan, track = bench.plan, system.track
    await _until_full(system, plan.pool, plan.timeout)
    await bench.measure_idle(plan.gap)
    await system.warm_up(CONNECTIONS)
    names = [f"{tag}-{i}" for i in range(plan.pool)]
    requests_before = request_counts(await bench.admin.metrics())
    kafka_before = await system.kafka_requests()
    cpu_before, began = await bench.cpu_mark(), time.perf_counter()
    await _claims(bench, system, names)
    await track.until(lambda: track.settled(names, track.ready), plan.timeout)
    await track.until(lambda: track.refilled_at(began, plan.pool) is not None, plan.timeout)
    cpu, _ = await bench.cpu_since(cpu_before, began, len(names))
    delta = counts_delta(requests_before, request_counts(await bench.admin.metrics()))
    kafka = counts_delta(kafka_before, await system.kafka_requests())
    refilled = track.refilled_at(began, plan.pool)
    requested = {n: track.requested[n] for n in names}
    figures = WarmFigures(
        ready=summarize(latencies(requested, track.ready), len(names)),
        warm=warm_count(system, names),
        refill=math.nan if refilled is None else refilled - began,
        requests=sum(delta.values()) / len(names),
        cpu=cpu,
        kafka={k: v / len(names) for k, v in kafka.items()},
    )
    print(f"  {system.label:<14} {burst_line(system.label, figures)}", flush=True)
    print(f"  {'':<14} {verified(track, names)}; requests: {top_requests(delta, len(names), 6)}")
    if kafka:
        print(f"  {'':<14} {kafka_line(figures.kafka)}")
    await _release(bench, system, names)
    return figures


async def sustained(bench: Bench, system: WarmSystem, rate: int, tag: str) -> Summary:
    plan, track = bench.plan, system.track
    await _until_full(system, plan.pool, plan.timeout)
    await asyncio.sleep(plan.gap)
    await system.warm_up(CONNECTIONS)
    count = round(rate * plan.seconds)
    names = [f"{tag}-{i}" for i in range(count)]
    tasks, begin = [], time.perf_counter()
    for i, name in enumerate(names):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(_claims(bench, system, [name])))
    await asyncio.gather(*tasks)
    await track.until(lambda: track.settled(names, track.ready), plan.settle)
    requested = {n: track.requested[n] for n in names}
    summary = summarize(latencies(requested, track.ready), count)
    print(f"  {system.label:<14} {rate}/s  {ready_line(summary)}  warm "
          f"{warm_count(system, names)}/{count}; {verified(track, names)}", flush=True)  # fmt: skip
    await _release(bench, system, names)
    return summary


# ------------------------------------------------------------------------------ report (pure)


def burst_line(label: str, f: WarmFigures) -> str:
    own = sum(f.cpu.get(p, 0.0) for p in OWN_PARTIES[label])
    cluster = sum(f.cpu.get(p, 0.0) for p in CLUSTER_PARTIES)
    return (
        f"{_ms_line(f.ready)}  warm {f.warm}/{f.ready.expected}  refill {f.refill:.2f} s  "
        f"apiserver {f.requests:.1f} req/claim  CPU/claim: its control plane "
        f"{own * 1000:.1f} ms, cluster {cluster * 1000:.1f} ms"
    )


def kafka_line(per_claim: Mapping[tuple[str, str], float], item: str = "claim") -> str:
    """Kafka requests per claim (or ``item``): the total, by type, and the largest by client
    and type."""
    by_type: dict[str, float] = {}
    for (_, request), n in per_claim.items():
        by_type[request] = by_type.get(request, 0.0) + n
    types = ", ".join(f"{t} {n:.1f}" for t, n in sorted(by_type.items(), key=lambda kv: -kv[1]))
    return (
        f"Kafka requests / {item} {sum(per_claim.values()):.1f} ({types}); by client: "
        f"{top_requests(per_claim, 1, 8)}"
    )


def _ms_line(s: Summary) -> str:
    done = "" if s.complete else f"  ONLY {s.count}/{s.expected} Ready"
    return (
        f"request→Ready p50 {s.p50 * 1000:.0f}  p90 {s.p90 * 1000:.0f}  p99 {s.p99 * 1000:.0f}"
        f"  max {s.max * 1000:.0f} ms{done}"
    )


def median_warm(runs: Sequence[WarmFigures]) -> WarmFigures:
    def med(get: Callable[[WarmFigures], float]) -> float:
        return median(get(r) for r in runs)

    parties = {p for r in runs for p in r.cpu}
    return WarmFigures(
        ready=Summary(
            min(r.ready.count for r in runs),
            runs[0].ready.expected,
            med(lambda r: r.ready.p50),
            med(lambda r: r.ready.p90),
            med(lambda r: r.ready.p99),
            med(lambda r: r.ready.max),
        ),
        warm=min(r.warm for r in runs),
        refill=med(lambda r: r.refill),
        requests=med(lambda r: r.requests),
        cpu={p: median(r.cpu.get(p, math.nan) for r in runs) for p in parties},
        kafka={
            k: median(r.kafka.get(k, 0.0) for r in runs) for k in {k for r in runs for k in r.kafka}
        },
    )


def warm_report(
    pool: int,
    rounds: int,
    bursts: Mapping[str, WarmFigures],
    fills: Mapping[str, float],
    rate: int,
    sustained_figures: Mapping[str, Summary],
) -> str:
    """The warm phase's table (medians of the rounds), the sustained line and the goals."""
    rows = [["", OURS, PEER]]

    def row(label: str, show: Callable[[WarmFigures], str]) -> None:
        rows.append([label, *(show(bursts[s]) for s in (OURS, PEER))])

    row("request → Ready p50 (ms)", lambda f: f"{f.ready.p50 * 1000:.0f}")
    row("p90 (ms)", lambda f: f"{f.ready.p90 * 1000:.0f}")
    row("p99 (ms)", lambda f: f"{f.ready.p99 * 1000:.0f}")
    row("served warm", lambda f: f"{f.warm}/{f.ready.expected}")
    row("refill (s)", lambda f: f"{f.refill:.2f}")
    row("apiserver requests / claim", lambda f: f"{f.requests:.1f}")
    row("Kafka requests / claim", lambda f: f"{sum(f.kafka.values()):.1f}" if f.kafka else "")
    for party in (*OWN_PARTIES[OURS], *OWN_PARTIES[PEER], *CLUSTER_PARTIES):
        row(f"CPU ms / claim: {party}", _cpu_ms(party))
    rows.append(["pool filled from empty (s)", *(f"{fills[s]:.2f}" for s in (OURS, PEER))])
    rows.append([f"sustained {rate}/s: p50 / p90 / p99 (ms)",
                 *(_triple(sustained_figures.get(s)) for s in (OURS, PEER))])  # fmt: skip
    ours, peer = bursts[OURS].ready, bursts[PEER].ready
    met = "MET    " if ours.p50 <= GOAL_P50 else "NOT MET"
    met90 = "MET    " if ours.p90 <= peer.p90 else "NOT MET"
    return "\n".join([
        f"\nwarm: bursts of {pool} claims from pools of {pool}: medians of {rounds} rounds "
        "(CPU: per claim from the first claim to the pool full again, above idle)",
        render_rows(rows),
        "\ngoals (issue 38):",
        f"  {met}  warm claim p50 {ours.p50 * 1000:.0f} ms <= {GOAL_P50 * 1000:.0f} ms",
        f"  {met90}  warm claim p90 {ours.p90 * 1000:.0f} ms <= agent-sandbox's "
        f"{peer.p90 * 1000:.0f} ms",
    ])  # fmt: skip


def _cpu_ms(party: str) -> Callable[[WarmFigures], str]:
    return lambda f: f"{f.cpu.get(party, math.nan) * 1000:.1f}"


def _triple(s: Summary | None) -> str:
    if s is None:
        return "not run"
    text = f"{s.p50 * 1000:.0f} / {s.p90 * 1000:.0f} / {s.p99 * 1000:.0f}"
    return text if s.complete else f"{text} ({s.count}/{s.expected})"
