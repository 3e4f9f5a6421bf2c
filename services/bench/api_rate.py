"""The HTTP API under creates at rising rates (``python -m services.bench api-rate``): is it the
bottleneck, and where does a create's time go?

``sandstream up --no-stack`` with the fake driver runs in a process of its own (the API, processor,
executor, watcher and scheduler in one event loop, as on a machine without a cluster), on the
shared broker and PostgreSQL with topics and a schema of the run's own. This process is the load
generator, sending as the peer bench's does (its client: 50 keep-alive connections; each create
``POST /v1/sandboxes`` with a command id of its own, no ``wait``), open loop: the i-th request
is due at i / rate, and its latency counts from then, so a lagging sender cannot hide a slow
server.

At each rate, in this order and for the same seconds: ``GET /healthz`` (the API's trivial
endpoint: what the server process and this client cost at that rate), Kafka's own produce (the
API's producer settings, acks=all, to a topic nothing consumes), then the creates, twice: from
the peer bench's client (httpx), then from aiohttp with as many connections (a client that costs
this process a fraction of the CPU per request: when httpx's creates fall behind and aiohttp's
do not, the load generator was the bottleneck, not the API). For the creates: the answers'
p50/p90/p99 and the rate they were answered at; from the API's own metrics
(``sandstream_api_command_step_seconds``, ``sandstream_api_request_seconds``) the mean time in
the app and in each step (the pool wait, the idempotency record, the publish until Kafka's
acknowledgement, the mark as published); ``up``'s CPU over the phase (a second per second is one
core: its one event loop cannot do more). Between rates the bench waits for every sandbox so far
to be Ready, so each rate starts from an idle control plane. A rate whose creates were answered
at under half of it by both clients is the last one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp
import asyncpg
import httpx
from prometheus_client.parser import text_string_to_metric_families

from events.commands import CreateSandbox
from events.common import SandboxSpec
from events.publisher import CommandPublisher, now
from services.bench import cpu
from services.bench.pacing import open_loop
from services.bench.peer_setup import _spawn, _stop, _until_ok, free_port, remove
from services.bench.peer_stats import Summary, summarize
from services.bench.peer_systems import COMMAND, CONNECTIONS, SandstreamApi
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack.isolation import isolated

RATES: Final = (50, 100, 200, 400, 800)  # creates a second
STEPS: Final = ("pool_wait", "record", "publish", "mark_published")
READY_TIMEOUT: Final = 120.0  # s the control plane may take to make every sandbox Ready


@dataclass(frozen=True)
class Paced:
    """One open-loop phase: latencies from each request's due time to its answer (s)."""

    summary: Summary
    failed: int
    sent: float  # requests sent a second (the due times kept)
    answered: float  # answers a second, from the first due time to the last answer
    example: str | None = None  # one failure's text


async def paced(rate: int, seconds: float, one: Callable[[int], Awaitable[None]]) -> Paced:
    """``one(i)`` due at i / rate for ``seconds``, open loop, as many at once as the peer
    bench's client has connections (``pacing.open_loop``)."""
    count = round(rate * seconds)
    done: list[float] = []
    errors: list[str] = []
    begin = time.perf_counter()

    async def timed(i: int) -> None:
        try:
            await one(i)
        except Exception as exc:  # counted: the figures say how many failed
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        done.append(time.perf_counter() - (begin + i / rate))

    sent, tasks = await open_loop(rate, count, timed, CONNECTIONS)
    await asyncio.gather(*tasks)
    lasted = time.perf_counter() - begin
    return Paced(
        summarize(done, count), len(errors), sent, len(done) / lasted,
        errors[0] if errors else None,
    )  # fmt: skip


# ------------------------------------------------------------------------------ the API's metrics


@dataclass(frozen=True)
class Sums:
    """Sums and counts of the histograms read: (name, label value) -> (sum, count)."""

    values: Mapping[tuple[str, str], tuple[float, float]]

    def mean_since(self, before: Sums, key: tuple[str, str]) -> tuple[float, float]:
        """The mean (s) of what was observed since ``before``, and how many."""
        total, count = self.values.get(key, (0.0, 0.0))
        total0, count0 = before.values.get(key, (0.0, 0.0))
        n = count - count0
        return ((total - total0) / n if n else math.nan), n


CREATE: Final = ("sandstream_api_request_seconds", "POST /v1/sandboxes")


def sums(metrics_text: str) -> Sums:
    """The step histogram by step, and the request histogram by method and route."""
    found: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in ("sandstream_api_command_step_seconds", CREATE[0]):
            continue
        for sample in family.samples:
            suffix = sample.name.removeprefix(family.name)
            if suffix not in ("_sum", "_count"):
                continue
            labels = sample.labels
            label = labels.get("step") or f"{labels.get('method')} {labels.get('route')}"
            slot = found.setdefault((family.name, label), [0.0, 0.0])
            slot[0 if suffix == "_sum" else 1] = sample.value
    return Sums({k: (v[0], v[1]) for k, v in found.items()})


def where_it_went(before: Sums, after: Sums) -> str:
    """The mean time in the app and in each step, in ms."""
    in_app, n = after.mean_since(before, CREATE)
    parts = [f"in the app {in_app * 1000:.1f}"]
    for step in STEPS:
        mean, _ = after.mean_since(before, ("sandstream_api_command_step_seconds", step))
        parts.append(f"{step.replace('_', ' ')} {mean * 1000:.1f}")
    return f"mean ms over {n:.0f} creates: " + ", ".join(parts)


# ------------------------------------------------------------------------------ the run


@dataclass
class Up:
    url: str
    token: str
    pid: int


@contextlib.asynccontextmanager
async def sandstream_up(s: Settings, home: Path) -> AsyncIterator[Up]:
    """``sandstream up --no-stack --driver fake`` in the isolated environment ``s``."""
    port = free_port()
    run_dir = home / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **s.model_copy(update={"driver": "fake"}).as_env(),
           "SANDSTREAM_RUN_DIR": str(run_dir)}  # fmt: skip
    cmd = [sys.executable, "-m", "services.cli", "up", "--no-stack", "--port", str(port),
           "--no-openshell"]  # fmt: skip
    log = home / "sandstream-up.log"
    proc = _spawn(cmd, log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        await _until_ok(f"{url}/readyz", proc, "sandstream up", log)
        yield Up(url, (run_dir / "admin.token").read_text().strip(), proc.pid)
    finally:
        await _stop(proc)


async def ready(pool: asyncpg.Pool[asyncpg.Record], expected: int) -> int:
    """Wait until ``expected`` sandboxes are Ready (or READY_TIMEOUT passes); how many are."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        count: int = await pool.fetchval("SELECT count(*) FROM sandboxes WHERE phase = 'Ready'")
        if count >= expected or time.monotonic() > deadline:
            return count
        await asyncio.sleep(0.2)


def line(label: str, p: Paced) -> str:
    s = p.summary
    failed = f"  {p.failed} failed, e.g. {p.example}" if p.failed else ""
    return (
        f"    {label:<10} p50 {s.p50 * 1000:7.1f}  p90 {s.p90 * 1000:7.1f}  "
        f"p99 {s.p99 * 1000:7.1f} ms  answered {p.answered:6.1f}/s (sent {p.sent:6.1f}/s)"
        f"{failed}"
    )


async def api_rate_figures(settings: Settings, quick: bool) -> None:
    seconds = 4.0 if quick else 10.0
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"api-rate    creates through `sandstream up --driver fake` at {RATES}/s, "
          f"{seconds:.0f} s each, open loop (load {load})", flush=True)  # fmt: skip
    home = settings.state_dir / "bench" / f"api-rate-{os.getpid()}"
    async with isolated(settings, "bench") as (s, pool), sandstream_up(s, home) as up:
        api = SandstreamApi(up.url, up.token, "", s.sandbox_image)
        publisher = CommandPublisher(
            kafka_client_args(s, "processor"), topic=s.topic_deadletter
        )  # the API's producer settings, to a topic nothing here consumes
        light = LightClient(up.url, up.token, s.sandbox_image)
        await publisher.__aenter__()
        try:
            await _rates(s, pool, up, api, light, publisher, seconds)
        finally:
            await publisher.__aexit__()
            await api.close()
            await light.close()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"            (load {load} at the end)")
    remove(home)  # `up`'s log and token (kept when the run failed)


async def _rates(
    s: Settings,
    pool: asyncpg.Pool[asyncpg.Record],
    up: Up,
    api: SandstreamApi,
    light: LightClient,
    publisher: CommandPublisher,
    seconds: float,
) -> None:
    client = api.client
    spec = SandboxSpec(image=s.sandbox_image, command=COMMAND)
    created = 0
    await asyncio.gather(*(client.get("/healthz") for _ in range(50)))  # the connections

    async def healthz(_: int) -> None:
        (await client.get("/healthz")).raise_for_status()

    for rate in RATES:
        await asyncio.gather(*(client.get("/healthz") for _ in range(50)))  # open again
        health_cpu = cpu.process_cpu(up.pid)
        health = await paced(rate, seconds, healthz)
        health_cpu = (cpu.process_cpu(up.pid) - health_cpu) / max(health.summary.count, 1)

        async def produce(i: int, rate: int = rate) -> None:
            command = CreateSandbox(
                type="CreateSandbox", command_id=f"kafka-{rate}-{i}", key=f"kafka-{rate}-{i}",
                occurred_at=now(), actor="bench", spec=spec,
            )  # fmt: skip
            await publisher.publish(command)

        kafka = await paced(rate, seconds, produce)
        print(f"  {rate}/s", flush=True)
        print(line("healthz", health) + f"  `up` CPU {health_cpu * 1000:.2f} ms each")
        print(line("Kafka", kafka) + "  (produce, acks=all)")
        kept = False
        for label, create in (("creates", api.create), ("  aiohttp", light.create)):
            answered, created = await _creates(
                up, pool, client, label, create, rate, seconds, created
            )
            kept = kept or answered >= rate / 2
        if not kept:
            print("               (answered at under half the rate: no higher rate run)")
            return


async def _creates(
    up: Up,
    pool: asyncpg.Pool[asyncpg.Record],
    client: httpx.AsyncClient,
    label: str,
    create: Callable[[str], Awaitable[None]],
    rate: int,
    seconds: float,
    created: int,
) -> tuple[float, int]:
    """One client's creates at ``rate``, printed; then every sandbox so far waited for to be
    Ready. The rate they were answered at, and how many sandboxes there are now."""
    metrics_before = sums(await _metrics(client))
    cpu_before, began = cpu.process_cpu(up.pid), time.perf_counter()
    own_before = time.process_time()
    tag = label.strip()[0]
    creates = await paced(rate, seconds, lambda i: create(f"{tag}{rate}-{i}"))
    lasted = time.perf_counter() - began
    up_used = cpu.process_cpu(up.pid) - cpu_before
    own_cpu = (time.process_time() - own_before) / lasted
    metrics_after = sums(await _metrics(client))
    created += creates.summary.count
    per_create = up_used / max(creates.summary.count, 1)
    print(line(label, creates) + f"  `up` CPU {per_create * 1000:.2f} ms each (the API's, "
          "the processor's and the executor's over the phase)")  # fmt: skip
    print(f"               {where_it_went(metrics_before, metrics_after)}; CPU s/s: "
          f"`up` {up_used / lasted:.2f}, the load generator {own_cpu:.2f}", flush=True)  # fmt: skip
    count = await ready(pool, created)
    if count < created:
        print(f"               only {count} of {created} Ready after {READY_TIMEOUT:.0f} s")
    return creates.answered, created


class LightClient:
    """The same creates through aiohttp (its C parser): a load generator that costs its
    process a fraction of httpx's CPU per request, as many connections, kept alive 2 s."""

    def __init__(self, url: str, token: str, image: str) -> None:
        self.image = image
        self.session = aiohttp.ClientSession(
            url,
            headers={"Authorization": f"Bearer {token}"},
            connector=aiohttp.TCPConnector(limit=CONNECTIONS, keepalive_timeout=2.0),
        )

    async def create(self, name: str) -> None:
        body = {"name": name, "command_id": f"create-{name}",
                "spec": {"image": self.image, "command": COMMAND}}  # fmt: skip
        async with self.session.post("/v1/sandboxes", json=body) as response:
            await response.read()
            if response.status not in (200, 201, 202):
                raise RuntimeError(f"HTTP {response.status}")

    async def close(self) -> None:
        await self.session.close()


async def _metrics(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    response.raise_for_status()
    return response.text
