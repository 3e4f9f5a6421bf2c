"""A warm claim beside a cold create on Podman (``python -m services.bench warm``; figures
printed, never asserted).

The control plane as ``sandstream up`` runs it in one process (processor, executor, watcher,
scheduler with the pool controller; the Podman driver: real containers) and the HTTP API, on
isolated topics and a schema of their own. Two templates of the same spec (the sandbox image,
``sleep``): one served by a warm pool, one not. Each sample is timed from the create request
to the first answer of an exec in the sandbox (``true``, exit code 0):

- warm: ``POST /v1/sandboxes`` naming the pooled template (a Ready member adopted), then the
  exec; before each sample the pool is back at its size, all Ready (the refill is not timed);
- cold: the same request naming the other template, ``wait``-ed for its outcome, then the
  sandbox polled until Ready, then the exec.

Also printed: the warm claim's answer alone (request → ``claim.warm``), the figure the pool's
status reports as its warm latency, and a second exec in the same sandbox (what an exec costs by
itself, while the refill the claim started creates a member beside it), then a third once the
pool is full again (with nothing else running). ``python -m services.bench exec`` breaks the
HTTP exec into its steps. p50 and p90 as the issue asks, and the worst. Then where an exec's
time goes (services/bench/exec_steps.py: the Podman driver's calls for one exec through
Podman's exec API, timed one by one, beside ``podman exec``, the driver's runtime path and a
bare ``runc exec``). ``SANDSTREAM_PODMAN_EXEC=api`` times the sandbox execs through Podman's
exec API.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx

from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.server import start_api
from services.bench.drivers import Figures, percentile
from services.bench.exec_steps import exec_steps
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.common.tokens import SCOPES, TokenStore
from services.localstack.isolation import isolated
from services.up.control_plane import ControlPlane

TOKEN = "sst_bench-admin"
POOL_SIZE = 3


async def main(settings: Settings, samples: int) -> None:
    from services.executor.backends import podman_driver

    print(f"\nwarm claims beside cold creates on Podman ({samples} each, pool of {POOL_SIZE})")
    async with isolated(settings, "benchw", kafka_partitions=4, pool_poll_seconds=0.5) as (
        s,
        pool,
    ):
        driver = podman_driver(s, stop_timeout=2)
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600, with_scheduler=True)
        await plane.start()
        publisher = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
        await publisher.__aenter__()
        app = create_app(s, pool, publisher, TokenStore.of(admin=(TOKEN, *SCOPES)))
        server = await start_api(app, "127.0.0.1", 0, access_log=False)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        try:
            await driver.execs.runtime()
            print(f"  the driver's exec path: {driver.execs.path} (SANDSTREAM_PODMAN_EXEC)")
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as c:
                figures = await _run(c, pool, s.sandbox_image, samples)
        finally:
            await server.stop()
            await publisher.__aexit__()
            await plane.stop()
            await driver.close()
    for f in figures:
        print(line(f))
    print("where an exec's time goes: the Podman driver's calls, one by one, without sandstream")
    print("(Podman's exec API step by step, `podman exec`, then the runtime path and bare runc)")
    for f in await exec_steps(settings, samples):
        print(line(f))


def line(f: Figures) -> str:
    """p50 and p90 (the issue's figures) and the worst, in milliseconds."""
    s = sorted(f.samples)
    return (
        f"  {f.label:<44} n={len(s):<4} p50 {percentile(s, 50) * 1000:6.1f} ms  "
        f"p90 {percentile(s, 90) * 1000:6.1f} ms  max {s[-1] * 1000:6.1f} ms"
    )


async def _run(c: httpx.AsyncClient, db: Any, image: str, samples: int) -> list[Figures]:
    spec = {"image": image, "command": ["sleep", "3600"], "stop_timeout_seconds": 2}
    for name in ("warm-agent", "cold-agent"):
        r = await c.post("/v1/templates", json={"name": name, "spec": spec})
        assert r.status_code == 201, r.text
    r = await c.post("/v1/pools", json={"name": "bench", "template": "warm-agent",
                                        "size": POOL_SIZE})  # fmt: skip
    assert r.status_code == 201, r.text
    warm, claimed, cold, alone, quiet = [], [], [], [], []
    names = []
    for i in range(samples + 1):  # the first of each is a warm-up, not counted
        await _pool_full(db)
        name = f"w-{uuid.uuid4().hex[:8]}"
        began = time.perf_counter()
        r = await c.post("/v1/sandboxes", json={"name": name, "template": {"name": "warm-agent"}})
        answered = time.perf_counter()
        assert r.status_code == 201 and r.json()["claim"]["warm"], r.text
        await _exec(c, name)
        if i:
            warm.append(time.perf_counter() - began)
            claimed.append(answered - began)
        began = time.perf_counter()
        await _exec(c, name)  # again: what the exec alone costs
        if i:
            alone.append(time.perf_counter() - began)
        await _pool_full(db)  # the refill this claim started is over: nothing else runs
        began = time.perf_counter()
        await _exec(c, name)
        if i:
            quiet.append(time.perf_counter() - began)
        cname = f"c-{uuid.uuid4().hex[:8]}"
        began = time.perf_counter()
        body = {"name": cname, "template": {"name": "cold-agent"}}
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
        await _ready(c, cname)
        await _exec(c, cname)
        if i:
            cold.append(time.perf_counter() - began)
        names += [name, cname]
    for name in names:
        await c.delete(f"/v1/sandboxes/{name}")
    await c.delete("/v1/pools/bench")
    return [
        Figures("warm: claim → exec answered", warm),
        Figures("warm: claim → answered (adopted)", claimed),
        Figures("cold: create → Ready → exec answered", cold),
        Figures("an exec alone (a Ready sandbox)", alone),
        Figures("an exec alone, the pool refilled", quiet),
    ]


async def _pool_full(db: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    query = (
        "SELECT count(*) FROM sandboxes WHERE pool = 'bench' AND adopted_as IS NULL "
        "AND phase = 'Ready'"
    )
    while await db.fetchval(query) < POOL_SIZE:
        if time.monotonic() > deadline:
            raise TimeoutError("the pool did not refill")
        await asyncio.sleep(0.05)


async def _ready(c: httpx.AsyncClient, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (await c.get(f"/v1/sandboxes/{name}")).json().get("phase") != "Ready":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not become Ready")
        await asyncio.sleep(0.01)


async def _exec(c: httpx.AsyncClient, name: str) -> None:
    r = await c.post(f"/v1/sandboxes/{name}/exec", json={"command": ["true"]})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
