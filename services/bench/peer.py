"""``python -m services.bench peer [--quick] [--sandboxes N] [--rounds R]``: sandstream beside
kubernetes-sigs/agent-sandbox and bare Pods, on one Kubernetes cluster, in one run.

Three systems turn "I want a sandbox" into a Pod on the same cluster (services/bench/
peer_setup.py starts it, with both control planes running throughout):

- **bare Pods**: the load generator creates the Pods itself: the cluster's own floor;
- **agent-sandbox**: it creates Sandbox objects; its controller makes the Pods;
- **sandstream**: it creates sandboxes through sandstream's HTTP API; the processor, executor
  and watcher (``sandstream up --driver kubernetes``) make the Pods.

Every system gets the same Pod (the one sandstream's Kubernetes driver makes for the same
spec, with an emptyDir workspace) and the same client: one httpx connection pool of 50
warmed connections, as a ServiceAccount of its own. "Ready" means one thing: the Pod Running
and Ready with an IP, reported so through the system's own API (the Pod itself for bare Pods,
the Sandbox's Ready condition, sandstream's watch showing the row Ready); the bench watches the
Pods too and says how many were Running and Ready when reported. Gone means the system says so
and the Pod is gone.

Phases, each system in turn (the order reversed every other round, a pause between them):

- a **burst** of N creates at once (N = 300): per sandbox request → Ready (p50, p90, p99,
  max), time until all N are Ready; then N deletes at once → time until all are gone; the CPU
  each process spent from the first create to the last gone (from /proc), and the apiserver's
  requests (``apiserver_request_total``), per sandbox;
- a **sustained** phase: creates at a fixed rate (20, 45 and 90 a second for 60 s; 10 s with
  ``--quick``), p90 request → Ready at each rate; then everything deleted.

It prints a table of the bursts' medians with the ratios sandstream/agent-sandbox and
sandstream/bare Pods, the sustained p90s and which of issue 28's goals are met. On two shared
cores the run is CPU-bound: latencies rank the systems within one run; apiserver requests
and CPU per sandbox are the sturdier figures.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

import asyncpg
import httpx

from drivers.kube_objects import PodSettings, pod_manifest
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.bench import cpu, peer_setup
from services.bench.peer_kube import REQUEST_TIMEOUT, Kube
from services.bench.peer_stats import (
    BurstFigures,
    Summary,
    counts_delta,
    latencies,
    median,
    pod_ready,
    render_rows,
    request_counts,
    row_phase,
    sandbox_ready,
    span,
    sse_events,
    summarize,
    top_requests,
)
from services.common.settings import Settings
from services.localstack import agent_sandbox

CONNECTIONS = 50
Sustained = Mapping[
    int, Mapping[str, "Summary | None"]
]  # rate -> system -> figures (None: not run)
COMMAND = ["sleep", "3600"]
FLOOR, PEER, OURS = "bare Pods", "agent-sandbox", "sandstream"
GOAL_FLOOR_FACTOR = 1.5  # sandstream's p90 within 1.5 x the floor's (issue 28)
SUSTAINED_P90 = 1.0  # s: the sustained goal's bound


@dataclass(frozen=True)
class Plan:
    sandboxes: int = 300
    rounds: int = 3
    rates: tuple[int, ...] = (20, 45, 90)
    seconds: float = 60.0
    gap: float = 10.0  # s between phases
    timeout: float = 300.0  # s a phase may take to be all Ready, or all gone
    settle: float = 60.0  # s a sustained phase waits, after its last create, for the rest
    idle: float = 30.0  # s of idle measured first (each party's background CPU)


def pod_spec(image: str) -> dict[str, Any]:
    """The Pod spec sandstream's driver makes for a sandbox of ``image`` running ``sleep``
    (without its per-sandbox hostname and identity variables): what all three systems get."""
    launch = LaunchSpec(
        key="template",
        sandbox_id=UUID(int=0),
        generation=1,
        identity="rid-template",
        spec=SandboxSpec(image=image, command=COMMAND),
    )
    spec: dict[str, Any] = dict(pod_manifest(launch, PodSettings())["spec"])
    spec.pop("hostname", None)
    spec["containers"] = [{k: v for k, v in c.items() if k != "env"} for c in spec["containers"]]
    return spec


# ------------------------------------------------------------------------------ tracking


@dataclass
class Track:
    """When each sandbox was asked for, reported Ready, seen Ready as a Pod, asked to go,
    reported gone, seen gone as a Pod (perf_counter seconds)."""

    requested: dict[str, float] = field(default_factory=dict)
    answered: dict[str, float] = field(default_factory=dict)  # the create request's answer
    ready: dict[str, float] = field(default_factory=dict)
    pod_ready: dict[str, float] = field(default_factory=dict)
    deleting: dict[str, float] = field(default_factory=dict)
    gone: dict[str, float] = field(default_factory=dict)
    pod_gone: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def note(self, table: dict[str, float], name: str) -> None:
        if name not in table:
            table[name] = time.perf_counter()
            self.changed.set()

    def listed(
        self, *tables: str | None, name_of: Callable[[str], str | None] = lambda n: n
    ) -> Callable[[list[dict[str, Any]]], None]:
        """For a watch listed again: what is asked to go and is not in the list is gone (its
        deletion fell in the gap); noted in the ``tables`` named."""

        def gone(items: list[dict[str, Any]]) -> None:
            present = {name_of(i["metadata"]["name"]) for i in items}
            for name in [n for n in self.deleting if n not in present]:
                for table in tables:
                    if table is not None:
                        self.note(getattr(self, table), name)

        return gone

    def settled(self, names: Iterable[str], table: Mapping[str, float]) -> bool:
        """Every one of ``names`` is in ``table``, or its request failed."""
        return all(n in table or n in self.failed for n in names)

    def gone_at(self) -> dict[str, float]:
        """Gone: reported so and the Pod gone, whichever came last."""
        return {n: max(t, self.pod_gone[n]) for n, t in self.gone.items() if n in self.pod_gone}

    async def until(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while not done():
            self.changed.clear()
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except TimeoutError:
                return done()
        return True


class System(Protocol):
    label: str
    namespace: str

    def item_of(self, pod_name: str) -> str | None: ...
    async def create(self, name: str) -> None: ...
    async def delete(self, name: str) -> None: ...
    async def watch(self, track: Track) -> None: ...


class BarePods:
    """The load generator creates the Pods itself: the Pod's own state is the report."""

    label = FLOOR

    def __init__(self, kube: Kube, namespace: str, spec: dict[str, Any]) -> None:
        self.kube, self.namespace, self.spec = kube, namespace, spec
        self.path = f"/api/v1/namespaces/{namespace}/pods"

    def item_of(self, pod_name: str) -> str | None:
        return pod_name

    async def create(self, name: str) -> None:
        await self.kube.create(
            self.path, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                        "spec": self.spec}
        )  # fmt: skip

    async def delete(self, name: str) -> None:
        await self.kube.delete(f"{self.path}/{name}")

    async def watch(self, track: Track) -> None:
        return  # the Pod watch every system has notes Ready and gone for this one


class AgentSandboxes:
    """Sandbox objects; agent-sandbox's controller makes a Pod of the same name for each."""

    label = PEER

    def __init__(self, kube: Kube, namespace: str, spec: dict[str, Any]) -> None:
        self.kube, self.namespace, self.spec = kube, namespace, spec
        api = f"{agent_sandbox.GROUP}/{agent_sandbox.API_VERSION}"
        self.api_version = api
        self.path = f"/apis/{api}/namespaces/{namespace}/sandboxes"

    def item_of(self, pod_name: str) -> str | None:
        return pod_name

    async def create(self, name: str) -> None:
        await self.kube.create(
            self.path,
            {"apiVersion": self.api_version, "kind": "Sandbox", "metadata": {"name": name},
             "spec": {"podTemplate": {"spec": self.spec}}},
        )  # fmt: skip

    async def delete(self, name: str) -> None:
        await self.kube.delete(f"{self.path}/{name}")

    async def watch(self, track: Track) -> None:
        def seen(kind: str, sandbox: dict[str, Any]) -> None:
            name = sandbox["metadata"]["name"]
            if kind == "DELETED":
                track.note(track.gone, name)
            elif sandbox_ready(sandbox):
                track.note(track.ready, name)

        await self.kube.watch(
            self.path, seen, await self.kube.resource_version(self.path), track.listed("gone")
        )


class SandstreamApi:
    """Sandboxes created and deleted through sandstream's HTTP API; Ready and gone as its
    watch (server-sent events) shows the rows."""

    label = OURS

    def __init__(self, url: str, token: str, namespace: str, image: str) -> None:
        self.namespace, self.image = namespace, image
        self.client = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            limits=httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS),
            timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10.0),
        )

    def item_of(self, pod_name: str) -> str | None:
        # drivers/kube_objects.pod_name: sandstream-<key>-g<generation>
        if not pod_name.startswith("sandstream-"):
            return None
        return pod_name.removeprefix("sandstream-").rpartition("-g")[0] or None

    async def create(self, name: str) -> None:
        # A command id of its own: a request sent again after a dropped connection (one the
        # server closed while it sat idle) is the same command, not a second one.
        body = {"name": name, "command_id": f"create-{name}",
                "spec": {"image": self.image, "command": COMMAND}}  # fmt: skip
        for attempt in (1, 2):
            try:
                response = await self.client.post("/v1/sandboxes", json=body)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
                if attempt == 2:
                    raise
        if response.status_code not in (200, 201, 202):
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")

    async def delete(self, name: str) -> None:
        response = await self.client.delete(f"/v1/sandboxes/{name}")
        if response.status_code not in (200, 202, 404):
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")

    async def watch(self, track: Track) -> None:
        import json

        last_id: str | None = None
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                async with self.client.stream(
                    "GET", "/v1/watch", headers=headers, timeout=httpx.Timeout(None, connect=10)
                ) as response:
                    buffer = ""
                    async for text in response.aiter_text():
                        events, buffer = sse_events(buffer + text)
                        for event, data in events:
                            if event != "sandbox":
                                continue
                            row = json.loads(data)
                            last_id = str(row.get("change_seq", last_id))
                            phase = row_phase(row)
                            if phase == "Ready":
                                track.note(track.ready, row["name"])
                            elif phase == "Deleted":
                                track.note(track.gone, row["name"])
            except (httpx.TransportError, httpx.StreamError):
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        await self.client.aclose()


async def watch_pods(kube: Kube, system: System, track: Track, reports: bool) -> None:
    """The Pods of the system's namespace: Running+Ready with an IP, and gone (``reports``:
    these are the system's own reports too)."""
    path = f"/api/v1/namespaces/{system.namespace}/pods"

    def seen(kind: str, pod: dict[str, Any]) -> None:
        name = system.item_of(pod["metadata"]["name"])
        if name is None:
            return
        if kind == "DELETED":
            track.note(track.pod_gone, name)
            if reports:
                track.note(track.gone, name)
        elif pod_ready(pod):
            track.note(track.pod_ready, name)
            if reports:
                track.note(track.ready, name)

    listed = track.listed("pod_gone", "gone" if reports else None, name_of=system.item_of)
    await kube.watch(path, seen, await kube.resource_version(path), listed)


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
        ports = cpu.connected_ports(self.sandstream_pid, self.pg_port)
        rows = await self.pg.fetch(
            "SELECT pid FROM pg_stat_activity WHERE client_port = ANY($1::int[])", ports
        )
        return {**self.fixed, "sandstream PostgreSQL": [r["pid"] for r in rows]}


OWN_PARTIES = {
    FLOOR: (),
    PEER: ("agent-sandbox controller",),
    OURS: ("sandstream up", "sandstream Kafka", "sandstream PostgreSQL"),
}
CLUSTER_PARTIES = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager", "kwok")


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

    async def measure_idle(self, seconds: float, say: bool = False) -> None:
        """Every party's CPU per second while nothing is asked of anyone (both control planes
        running), measured in the pause before each phase: what the phase's CPU figures leave
        out, per second it lasted (an estimate taken once at the start ran high: a broker just
        booted is busier than one a few minutes old)."""
        before, began = mark(await self.parties.now()), time.perf_counter()
        await asyncio.sleep(seconds)
        after, lasted = mark(await self.parties.now()), time.perf_counter() - began
        self.idle = {party: cpu / lasted for party, cpu in spent(before, after).items()}
        if say:
            shown = ", ".join(f"{p} {c * 1000:.0f}" for p, c in sorted(self.idle.items()))
            print(f"idle, CPU ms per second over {lasted:.0f} s: {shown}", flush=True)

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

    async def _all(self, calls: Iterable[Awaitable[None]]) -> None:
        limit = asyncio.Semaphore(CONNECTIONS)

        async def one(call: Awaitable[None]) -> None:
            async with limit:
                await call

        await asyncio.gather(*(one(c) for c in calls))

    async def _request(
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
        return self._request(track, track.requested, system.create, name, track.answered)

    async def burst(self, system: System, tag: str) -> BurstFigures:
        track = self.tracks[system.label]
        await self.measure_idle(self.plan.gap)
        await self.warm(system)
        names = [f"{tag}-{i}" for i in range(self.plan.sandboxes)]
        requests_before = request_counts(await self.admin.metrics())
        cpu_before, began = mark(await self.parties.now()), time.perf_counter()
        await self._all(self._create(track, system, n) for n in names)
        await track.until(lambda: track.settled(names, track.ready), self.plan.timeout)
        await self._all(self._request(track, track.deleting, system.delete, n) for n in names)
        await track.until(lambda: all(n in track.gone_at() for n in names), self.plan.timeout)
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
        print(f"  {system.label:<14} {_burst_line(system.label, figures)}", flush=True)
        print(f"  {'':<14} creates answered p50 {answers.p50:.2f} p90 {answers.p90:.2f} s; "
              f"{_checked(track, names)}; requests: {top_requests(delta, n, 8)}")  # fmt: skip
        return figures

    async def sustained(self, system: System, rate: int, tag: str) -> Summary:
        track = self.tracks[system.label]
        await asyncio.sleep(self.plan.gap)
        await self.warm(system)
        count = round(rate * self.plan.seconds)
        names = [f"{tag}-{i}" for i in range(count)]
        tasks = []
        begin = time.perf_counter()
        for i, name in enumerate(names):
            delay = begin + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self._create(track, system, name)))
        sent = count / max(time.perf_counter() - begin, 1e-9) * (count - 1) / count
        await asyncio.gather(*tasks)
        await track.until(lambda: track.settled(names, track.ready), self.plan.settle)
        requested = {k: track.requested[k] for k in names}
        summary = summarize(latencies(requested, track.ready), count)
        answers = summarize(latencies(requested, track.answered), count)
        print(
            f"  {system.label:<14} {rate}/s (sent at {sent:.1f}/s; creates answered p90 "
            f"{answers.p90:.2f} s)  {_ready_line(summary)}{_failures(track, names)}",
            flush=True,
        )
        await self._all(self._request(track, track.deleting, system.delete, n) for n in names)
        await track.until(lambda: all(n in track.gone_at() for n in names), self.plan.timeout)
        return summary


def _ready_line(s: Summary) -> str:
    done = "" if s.complete else f"  ONLY {s.count}/{s.expected} Ready"
    return (
        f"request→Ready p50 {s.p50:.2f}  p90 {s.p90:.2f}  p99 {s.p99:.2f}  max {s.max:.2f} s{done}"
    )


def _burst_line(label: str, f: BurstFigures) -> str:
    own = sum(f.cpu.get(p, 0.0) for p in OWN_PARTIES[label])
    cluster = sum(f.cpu.get(p, 0.0) for p in CLUSTER_PARTIES)
    return (
        f"{_ready_line(f.ready)}  all Ready {f.all_ready:.2f} s  all gone {f.all_gone:.2f} s  "
        f"apiserver {f.requests:.1f} req/sandbox  CPU/sandbox: its control plane "
        f"{own * 1000:.1f} ms, cluster {cluster * 1000:.1f} ms"
    )


def _failures(track: Track, names: Sequence[str]) -> str:
    failed = [track.failed[n] for n in names if n in track.failed]
    return f"; {len(failed)} requests failed, e.g. {failed[0]}" if failed else ""


def _checked(track: Track, names: Sequence[str]) -> str:
    """How many sandboxes had their Pod seen Running+Ready (with an IP) no later than the
    system reported them Ready, and how many requests failed."""
    both = [n for n in names if n in track.ready and n in track.pod_ready]
    before = sum(track.pod_ready[n] <= track.ready[n] for n in both)
    return (
        f"Pods seen Running+Ready with an IP: {len(both)}/{len(names)} of those reported "
        f"Ready ({before} seen before the report)" + _failures(track, names)
    )


# ------------------------------------------------------------------------------ the run


def median_figures(runs: Sequence[BurstFigures]) -> BurstFigures:
    def med(get: Callable[[BurstFigures], float]) -> float:
        return median(get(r) for r in runs)

    parties = {p for r in runs for p in r.cpu}
    return BurstFigures(
        ready=Summary(
            min(r.ready.count for r in runs),
            runs[0].ready.expected,
            med(lambda r: r.ready.p50),
            med(lambda r: r.ready.p90),
            med(lambda r: r.ready.p99),
            med(lambda r: r.ready.max),
        ),
        all_ready=med(lambda r: r.all_ready),
        all_gone=med(lambda r: r.all_gone),
        requests=med(lambda r: r.requests),
        cpu={p: median(r.cpu.get(p, math.nan) for r in runs) for p in parties},
    )


def orders(systems: Sequence[System], rounds: int) -> list[list[System]]:
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
    print(
        f"sandstream beside agent-sandbox {agent_sandbox.VERSION} and bare Pods: bursts of "
        f"{plan.sandboxes}, {plan.rounds} rounds; sustained {', '.join(map(str, plan.rates))}/s "
        f"for {plan.seconds:.0f} s each  ({os.cpu_count()} cores, load average "
        f"{_load()} at the start)",
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
            peer_setup.agent_controller(cluster, home) as controller,
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
                    "agent-sandbox controller": [controller.proc.pid],
                    "sandstream up": [ours.proc.pid],
                    "sandstream Kafka": [ours.broker],
                    "bench client": [os.getpid()],
                }
                parties = Parties(fixed, ours.proc.pid, pg, settings.pg_port)
                tracks = {s.label: Track() for s in systems}
                bench = Bench(plan, cluster.admin, client, parties, systems, tracks)
                for s in systems:
                    track = bench.tracks[s.label]
                    watches.append(asyncio.ensure_future(s.watch(track)))
                    watches.append(
                        asyncio.ensure_future(watch_pods(client, s, track, s.label == FLOOR))
                    )
                await bench.measure_idle(plan.idle, say=True)
                await _phases(bench, systems)
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
            if i and not _kept_up(sustained[plan.rates[i - 1]][system.label]):
                print(f"  {system.label:<14} not run: p90 over {SUSTAINED_P90:.0f} s already at "
                      "a lower rate")  # fmt: skip
                sustained[rate][system.label] = None
                continue
            sustained[rate][system.label] = await bench.sustained(system, rate, f"s{rate}")
    print(report(plan, {k: median_figures(v) for k, v in bursts.items()}, sustained))


def report(plan: Plan, bursts: Mapping[str, BurstFigures], sustained: Sustained) -> str:
    """The table of the bursts' medians, the sustained p90s and the goals."""
    from services.bench.peer_stats import burst_table

    lines = [
        f"\nbursts of {plan.sandboxes}: medians of {plan.rounds} rounds (CPU: ms per sandbox "
        "from the first create to the last gone, above each process's idle CPU; a system's "
        "column shows the others' processes too)",
        burst_table(bursts, OURS, PEER, FLOOR),
        f"\nsustained: request → Ready p90 (s) at each rate for {plan.seconds:.0f} s",
    ]
    names = list(bursts)
    rows = [["rate", *names]]
    for rate, by_system in sustained.items():
        rows.append([f"{rate}/s", *(_p90(by_system[n]) for n in names)])
    lines.append(render_rows(rows))
    lines.append("\ngoals (issue 28):")
    lines.extend(goals(bursts, sustained))
    return "\n".join(lines)


def _p90(s: Summary | None) -> str:
    if s is None:
        return "not run"
    text = "n/a" if math.isnan(s.p90) else f"{s.p90:.2f}"
    return text if s.complete else f"{text} ({s.count}/{s.expected})"


def _kept_up(s: Summary | None) -> bool:
    """Every sandbox got Ready, with p90 under SUSTAINED_P90."""
    return s is not None and s.complete and s.p90 < SUSTAINED_P90


def highest_rate(sustained: Sustained, system: str) -> int | None:
    """The highest rate at which the system kept up (higher rates are not run once a lower
    one failed: they cannot be the answer)."""
    good = [rate for rate, by_system in sustained.items() if _kept_up(by_system[system])]
    return max(good) if good else None


def goals(bursts: Mapping[str, BurstFigures], sustained: Sustained) -> list[str]:
    ours, peer, floor = bursts[OURS], bursts[PEER], bursts[FLOOR]

    def line(met: bool, text: str) -> str:
        return f"  {'MET    ' if met else 'NOT MET'}  {text}"

    ours_rate, peer_rate = highest_rate(sustained, OURS), highest_rate(sustained, PEER)
    return [
        line(ours.ready.p90 <= peer.ready.p90,
             f"burst p90 {ours.ready.p90:.2f} s <= agent-sandbox's {peer.ready.p90:.2f} s"),
        line(ours.ready.p90 <= GOAL_FLOOR_FACTOR * floor.ready.p90,
             f"burst p90 {ours.ready.p90:.2f} s <= 1.5 x bare Pods' {floor.ready.p90:.2f} s"),
        line(ours.all_ready <= peer.all_ready,
             f"all Ready {ours.all_ready:.2f} s <= agent-sandbox's {peer.all_ready:.2f} s"),
        line(ours.all_ready <= GOAL_FLOOR_FACTOR * floor.all_ready,
             f"all Ready {ours.all_ready:.2f} s <= 1.5 x bare Pods' {floor.all_ready:.2f} s"),
        line((ours_rate or 0) >= (peer_rate or 0) and ours_rate is not None,
             f"highest sustained rate with p90 < {SUSTAINED_P90:.0f} s: {ours_rate or 'none'}/s "
             f">= agent-sandbox's {peer_rate or 'none'}/s (none: not at the lowest rate)"),
        line(ours.requests <= peer.requests,
             f"apiserver requests per sandbox {ours.requests:.1f} <= agent-sandbox's "
             f"{peer.requests:.1f}"),
    ]  # fmt: skip


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def plan(quick: bool, sandboxes: int = 300, rounds: int | None = None) -> Plan:
    """The full run, or ``quick``: one round of bursts, sustained phases of 10 s."""
    return Plan(
        sandboxes=sandboxes,
        rounds=rounds or (1 if quick else 3),
        seconds=10.0 if quick else 60.0,
        gap=3.0 if quick else 10.0,
        settle=30.0 if quick else 60.0,
        idle=10.0 if quick else 30.0,
    )
