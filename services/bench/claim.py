"""A warm claim at low load, step by step (``python -m services.bench claim [--quick]``).

The control plane as ``sandstream up`` runs it in one process (processor, executor and watcher
with the fake driver, the scheduler with the pool controller) and the HTTP API, on isolated
topics and a schema of their own. A template with a pool; claims (``POST /v1/sandboxes``
naming the template) sent one at a time, each timed from send to the answer (warm: adopted,
name bound), the pool back at its size before each (the refill is not timed, but the refill
the claim itself starts runs beside it, as it would). Every claim's steps are timed in the
process (the functions of the claim path and the processor's poll and write wrapped with
timers for this run only), as milliseconds from the request's send: the API's reads, the
adoption published, polled, committed and its outcome seen, ``BindSandboxName`` handed to the
producer, polled, committed, the name seen bound, the answer.

Beside it, in the same run: ``decided``'s figure (a row-only ``:hold``/``:release`` with
``wait``, one at a time, through the same API; services/bench/decided.py) and Kafka's own
round trip. A claim is two such round trips plus its reads: the ratio of the claim's p50 to
the decided one says what the claim path costs beyond them.
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg
import httpx

from drivers.fake import FakeDriver
from events.publisher import CommandPublisher
from services.api import claims, pool_claims
from services.api.app import create_app
from services.api.routes import commands
from services.api.server import start_api
from services.bench.decided import figures, kafka_round_trips
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.common.tokens import SCOPES, TokenStore
from services.localstack.isolation import isolated
from services.processor.consumer import Processor
from services.processor.publish import Publisher
from services.processor.write import Writer
from services.up.control_plane import ControlPlane

TOKEN = "sst_bench-admin"
POOL_SIZE = 3

# The steps, in the order a claim meets them (the label printed, the mark's name).
STEPS = (
    ("route: handler entered", "handler"),
    ("route: template resolved", "made_from"),
    ("route: pool found", "claim_first"),
    ("claim: name, earlier adoption (and members) read", "settled"),
    ("claim: Ready members read (apart)", "candidates"),
    ("AdoptSandbox acknowledged by Kafka", "adopt_published"),
    ("AdoptSandbox polled by the processor", "adopt_polled"),
    ("AdoptSandbox committed", "adopt_committed"),
    ("AdoptSandbox's outcome read", "adopted"),
    ("BindSandboxName handed to the producer", "bind_sent"),
    ("BindSandboxName acknowledged by Kafka", "bind_acked"),
    ("the refill's CreateSandbox polled", "create_polled"),
    ("BindSandboxName polled by the processor", "bind_polled"),
    ("the refill's CreateSandbox committed", "create_committed"),
    ("BindSandboxName committed", "bind_committed"),
    ("the name seen bound", "bound"),
    ("the answer's row read", "warm"),
    ("the claim counted", "counted"),
    ("the answer at the client", "answered"),
)


class Timeline:
    """The current claim's steps: the first time each is reached, in ms from its send."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.marks: dict[str, float] = {}
        self.runs: list[dict[str, float]] = []

    def mark(self, name: str) -> None:
        if self.began is not None and name not in self.marks:
            self.marks[name] = (time.perf_counter() - self.began) * 1000

    @contextmanager
    def claim(self) -> Iterator[None]:
        self.began, self.marks = time.perf_counter(), {}
        try:
            yield
        finally:
            self.mark("answered")
            self.runs.append(self.marks)
            self.began = None

    def medians(self) -> list[tuple[str, float | None]]:
        out = []
        for label, name in STEPS:
            seen = [run[name] for run in self.runs if name in run]
            out.append((label, statistics.median(seen) if seen else None))
        return out


def _after_call(target: Any, attr: str, done: Callable[[Any, tuple[Any, ...]], None]) -> None:
    """Wrap the coroutine function ``target.attr`` to call ``done(result, args)`` on return."""
    original = getattr(target, attr)

    @functools.wraps(original)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        done(result, args)
        return result

    setattr(target, attr, wrapped)


def _holds(records: Any, kind: bytes) -> bool:
    return any(kind in (getattr(r, "value", None) or b"") for r in records)


@contextmanager
def instrumented(t: Timeline) -> Iterator[None]:
    """The claim path's and the processor's steps marked on ``t`` (restored after)."""
    # (module, function, mark); a function the code at hand lacks is skipped (the bench runs
    # against the claim path before and after a change).
    steps = [
        (claims, "_settled", "settled"),  # the name and an earlier adoption read
        (claims, "_first", "settled"),  # the same, with the candidates, in one statement
        (claims, "_candidates", "candidates"),
        (claims, "_adopt", "adopted"),
        (claims, "_bound", "bound"),
        (pool_claims, "_warm", "warm"),
        (pool_claims, "count", "counted"),
        (pool_claims, "count_on", "counted"),
    ]
    saved: list[tuple[Any, str, Any]] = [
        (Publisher, "publish", Publisher.publish),
        (Writer, "apply", Writer.apply),
    ]
    for module, attr, name in steps:
        if hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
            _after_call(module, attr, lambda *_, name=name: t.mark(name))
    original_claim = claims.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        t.mark("claim_first")
        return await original_claim(*args, **kwargs)

    saved.append((claims, "claim", original_claim))
    claims.claim = claim

    def published(_: Any, args: tuple[Any, ...]) -> None:
        if _holds((rec for _, rec in args[1]), b"BindSandboxName"):
            t.mark("bind_sent")

    def committed(_: Any, args: tuple[Any, ...]) -> None:
        records = args[1]
        if _holds(records, b"AdoptSandbox"):
            t.mark("adopt_committed")
        if _holds(records, b"BindSandboxName"):
            t.mark("bind_committed")
        if _holds(records, b"CreateSandbox"):
            t.mark("create_committed")

    _after_call(Publisher, "publish", published)
    _after_call(Writer, "apply", committed)
    original_made_from = commands.made_from

    async def made_from(*args: Any, **kwargs: Any) -> Any:
        t.mark("handler")
        made = await original_made_from(*args, **kwargs)
        t.mark("made_from")
        return made

    saved.append((commands, "made_from", original_made_from))
    commands.made_from = made_from
    try:
        yield
    finally:
        for target, attr, original in saved:
            setattr(target, attr, original)


def watch_polls(t: Timeline, processor: Processor, publisher: CommandPublisher) -> None:
    """Mark the processor's polls holding a claim's commands, and the API's publish acked."""
    consumer = processor.polls.consumer
    assert consumer is not None
    getmany = consumer.getmany

    async def polled(*args: Any, **kwargs: Any) -> Any:
        batch = await getmany(*args, **kwargs)
        records = [r for rs in batch.values() for r in rs]
        if _holds(records, b"AdoptSandbox"):
            t.mark("adopt_polled")
        if _holds(records, b"BindSandboxName"):
            t.mark("bind_polled")
        if _holds(records, b"CreateSandbox"):
            t.mark("create_polled")
        return batch

    consumer.getmany = polled
    producer = processor.publisher.producer
    assert producer is not None
    send = producer.send

    async def sent(*args: Any, **kwargs: Any) -> Any:
        future = await send(*args, **kwargs)
        if b"BindSandboxName" in (kwargs.get("value") or b""):
            future.add_done_callback(lambda _: t.mark("bind_acked"))
        return future

    producer.send = sent
    publish = publisher.publish

    async def acked(command: Any, encoded: bytes | None = None) -> Any:
        result = await publish(command, encoded)
        if command.type == "AdoptSandbox":
            t.mark("adopt_published")
        return result

    publisher.publish = acked  # type: ignore[method-assign]


async def claim_round_trips(
    s: Settings, pool: asyncpg.Pool[asyncpg.Record], n: int, t: Timeline
) -> tuple[list[float], list[float], int]:
    """``n`` warm claims one at a time, each until its answer, each followed by a row-only
    command (``:hold`` or ``:release`` with ``wait``) through the same API: the milliseconds of
    each, and the adoptions the claims sent."""
    plane = ControlPlane(s, FakeDriver(), pool, reconcile_interval=3600, with_scheduler=True)
    await plane.start()
    publisher = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
    await publisher.__aenter__()
    app = create_app(s, pool, publisher, TokenStore.of(admin=(TOKEN, *SCOPES)))
    server = await start_api(app, "127.0.0.1", 0, access_log=False)
    assert plane.processor is not None
    watch_polls(t, plane.processor, publisher)
    try:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as c:
            await _pool_and_sandbox(c)

            async def claim_one() -> float:
                await pool_full(pool)
                body = {"name": f"c-{uuid.uuid4().hex[:8]}", "template": {"name": "agent"}}
                began = time.perf_counter()
                with t.claim():
                    r = await c.post("/v1/sandboxes", json=body)
                ms = (time.perf_counter() - began) * 1000
                assert r.status_code == 201 and r.json()["claim"]["warm"], r.text
                return ms

            async def decided_one(i: int) -> float:
                verb, body = ("hold", {"reason": "bench"}) if i % 2 == 0 else ("release", {})
                began = time.perf_counter()
                r = await c.post(f"/v1/sandboxes/bench:{verb}", params={"wait": 10}, json=body)
                ms = (time.perf_counter() - began) * 1000
                assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
                return ms

            for i in range(10):  # warm-up: connections, plans, caches
                await claim_one()
                await decided_one(i)
            t.runs.clear()
            claimed, decided = [], []
            for i in range(n):
                claimed.append(await claim_one())
                decided.append(await decided_one(i))
        adoptions = await pool.fetchval(
            "SELECT count(*) FROM command_outcomes WHERE command_type = 'AdoptSandbox'"
        )
        return claimed, decided, int(adoptions or 0)
    finally:
        await server.stop()
        await publisher.__aexit__()
        await plane.stop()


async def _pool_and_sandbox(c: httpx.AsyncClient) -> None:
    """The template and its pool; a sandbox of the same spec for the row-only commands."""
    spec = {"image": "registry.example/agent:1"}
    r = await c.post("/v1/templates", json={"name": "agent", "spec": spec})
    assert r.status_code == 201, r.text
    r = await c.post("/v1/pools", json={"name": "bench", "template": "agent", "size": POOL_SIZE})
    assert r.status_code == 201, r.text
    body = {"name": "bench", "spec": spec}
    r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
    assert r.status_code == 201, r.text


async def pool_full(db: asyncpg.Pool[asyncpg.Record], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    query = (
        "SELECT count(*) FROM sandboxes WHERE pool = 'bench' AND claim_id IS NULL "
        "AND phase = 'Ready'"
    )
    while await db.fetchval(query) < POOL_SIZE:
        if time.monotonic() > deadline:
            raise TimeoutError("the pool did not refill")
        await asyncio.sleep(0.005)


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


async def claim_figures(settings: Settings, n: int) -> None:
    print(f"claim       load {load()} (1/5/15 min) at the start")
    steps = Timeline()
    async with isolated(settings, "benchc", pool_poll_seconds=0.5) as (s, pool):
        with instrumented(steps):
            claimed, decided, adoptions = await claim_round_trips(s, pool, n, steps)
        kafka = await kafka_round_trips(s, n)
    ratio = statistics.median(claimed) / statistics.median(decided)
    print(
        f"claim       {n} warm claims one at a time (pool of {POOL_SIZE}), each followed by a "
        "row-only command\n"
        f"            claim          {figures(claimed)}   (request -> warm answer)\n"
        f"            decided        {figures(decided)}   (:hold/:release with wait)\n"
        f"            Kafka alone    {figures(kafka)}   (produce acks=all -> consume)\n"
        f"            p50 ratio to decided's {ratio:.1f}; AdoptSandbox decided "
        f"{adoptions} times for {n + 10} claims\n"
        "            steps (p50 ms from the request's send):"
    )
    for label, ms in steps.medians():
        print(f"              {label:<50} {'-' if ms is None else f'{ms:6.1f}'}")
    print(f"claim       load {load()} at the end")
