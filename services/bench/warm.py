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

The HTTP API's exec driver is the control plane's own, as in ``sandstream up`` (the executor's
Podman driver serves both doors' execs there).

Also printed: the warm claim's answer alone (request → ``claim.warm``), the figure the pool's
status reports as its warm latency, and a second exec in the same sandbox (what an exec costs by
itself, while the refill the claim started creates a member beside it), then a third once the
pool is full again (with nothing else running), then the driver's runtime path and a bare
``runc exec`` in the same container at that moment. The three execs' steps are marked in the
process (services/bench/exec_marks.py's timers: the route's steps, the container looked up,
runc started, the command started; p50 in ms from the request's send), so the first exec in a
member is seen beside the later ones of the same run. ``python -m services.bench exec`` breaks
the HTTP exec into its steps. p50 and p90 as the issue asks, and the worst. Then where an exec's
time goes (services/bench/exec_steps.py: the Podman driver's calls for one exec through
Podman's exec API, timed one by one, beside ``podman exec``, the driver's runtime path and a
bare ``runc exec``). ``SANDSTREAM_PODMAN_EXEC=api`` times the sandbox execs through Podman's
exec API.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import defaultdict
from typing import Any

import httpx

from drivers.podman import PodmanDriver
from events.publisher import CommandPublisher
from services.api import readmodel
from services.api.app import create_app
from services.api.server import start_api
from services.bench.drivers import Figures, percentile
from services.bench.exec_marks import STEPS, AsgiMarks, Timeline, instrument
from services.bench.exec_steps import exec_steps, runtime_beside_bare
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
        tokens = TokenStore.of(admin=(TOKEN, *SCOPES))
        app = create_app(s, pool, publisher, tokens, exec_driver=driver)  # as `up` does
        timeline = Timeline()
        app.add_middleware(AsgiMarks, timeline=timeline)
        server = await start_api(app, "127.0.0.1", 0, access_log=False)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        print(f"  load average {_load()}")
        try:
            await driver.execs.runtime()
            print(f"  the driver's exec path: {driver.execs.path} (SANDSTREAM_PODMAN_EXEC)")
            undo = instrument(timeline, app.state.api)
            try:
                async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as c:
                    run = Run(c, pool, driver, timeline)
                    figures = await run.samples(s.sandbox_image, samples)
            finally:
                undo()
        finally:
            await server.stop()
            await publisher.__aexit__()
            await plane.stop()
            await driver.close()
    print(f"  load average {_load()}")
    for f in figures:
        print(line(f))
    print("  each exec's steps, p50 in ms from its send (first: right after the claim; second:")
    print("  at once after it; third: once the pool refilled)")
    print(f"  {'step':<48}{'first':>9}{'second':>9}{'third':>9}")
    for step, mark in STEPS:
        cells = [_p50_ms(run.marks[which][mark]) for which in EXECS]
        if any(cells):
            print(f"  {step:<48}" + "".join(f"{c:>9}" for c in cells))
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


EXECS = ("first", "second", "third")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _p50_ms(values: list[float]) -> str:
    return f"{percentile(sorted(values), 50):.1f}" if values else ""


class Run:
    """The samples of one run, and each exec's marks (``EXECS``: by mark, ms from its send)."""

    def __init__(
        self, c: httpx.AsyncClient, db: Any, driver: PodmanDriver, timeline: Timeline
    ) -> None:
        self.c, self.db, self.driver, self.timeline = c, db, driver, timeline
        self.marks: dict[str, dict[str, list[float]]] = {
            which: defaultdict(list) for which in EXECS
        }

    async def samples(self, image: str, samples: int) -> list[Figures]:
        c = self.c
        spec = {"image": image, "command": ["sleep", "3600"], "stop_timeout_seconds": 2}
        for name in ("warm-agent", "cold-agent"):
            r = await c.post("/v1/templates", json={"name": name, "spec": spec})
            assert r.status_code == 201, r.text
        r = await c.post("/v1/pools", json={"name": "bench", "template": "warm-agent",
                                            "size": POOL_SIZE})  # fmt: skip
        assert r.status_code == 201, r.text
        warm, claimed, cold, alone, quiet, runc_path, bare = [], [], [], [], [], [], []
        names = []
        for i in range(samples + 1):  # the first of each is a warm-up, not counted
            counted = i > 0
            await _pool_full(self.db)
            name = f"w-{uuid.uuid4().hex[:8]}"
            began = time.perf_counter()
            r = await c.post(
                "/v1/sandboxes", json={"name": name, "template": {"name": "warm-agent"}}
            )
            answered = time.perf_counter()
            assert r.status_code == 201 and r.json()["claim"]["warm"], r.text
            await self._exec(name, "first" if counted else None)
            if counted:
                warm.append(time.perf_counter() - began)
                claimed.append(answered - began)
            began = time.perf_counter()
            await self._exec(name, "second" if counted else None)  # what the exec alone costs
            if counted:
                alone.append(time.perf_counter() - began)
            await _pool_full(self.db)  # the refill this claim started is over: nothing else runs
            began = time.perf_counter()
            await self._exec(name, "third" if counted else None)
            if counted:
                quiet.append(time.perf_counter() - began)
                runc_path_took, bare_took = await self._runc(name)
                runc_path.append(runc_path_took)
                bare.append(bare_took)
            cname = f"c-{uuid.uuid4().hex[:8]}"
            began = time.perf_counter()
            body = {"name": cname, "template": {"name": "cold-agent"}}
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await _ready(c, cname)
            await self._exec(cname, None)
            if counted:
                cold.append(time.perf_counter() - began)
            names += [name, cname]
        for name in names:
            await c.delete(f"/v1/sandboxes/{name}")
        await c.delete("/v1/pools/bench")
        figures = [
            Figures("warm: claim → exec answered", warm),
            Figures("warm: claim → answered (adopted)", claimed),
            Figures("cold: create → Ready → exec answered", cold),
            Figures("an exec alone (a Ready sandbox)", alone),
            Figures("an exec alone, the pool refilled", quiet),
        ]
        if runc_path:
            figures += [
                Figures("then the driver's runtime path alone", runc_path),
                Figures("then bare `runc exec`", bare),
            ]
        return figures

    async def _exec(self, name: str, which: str | None) -> None:
        """``true`` through the API; its steps kept as ``which`` exec's (None: not kept)."""
        self.timeline.start()
        await _exec(self.c, name)
        self.timeline.mark("client")
        if which is not None:
            self.timeline.keep(self.marks[which])

    async def _runc(self, name: str) -> tuple[float, float]:
        """The driver's runtime path, then a bare ``runc exec``, in ``name``'s container now
        (both 0 where the driver takes Podman's exec API)."""
        runc = await self.driver.execs.runtime()
        view = await readmodel.get_sandbox(self.db, name)
        assert view is not None
        runtime_id = self.driver.execs.ids.get((view.member_key, view.generation))
        if runc is None or runtime_id is None:
            return 0.0, 0.0
        return await runtime_beside_bare(runc, runtime_id)


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
