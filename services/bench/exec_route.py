"""Where an exec's time goes through the HTTP API on Podman (``python -m services.bench exec
[--quick]``; figures printed, never asserted).

The control plane as ``sandstream up`` runs it in one process (the Podman driver: real
containers) and the HTTP API, on isolated topics and a schema of their own; a pool of one, one
warm claim. Then, one at a time and interleaved so each sees the same load:

- ``POST /v1/sandboxes/{name}/exec`` running ``true`` in the claimed sandbox (the JSON form,
  then the streamed form ``?stream=true``), each timed from the client's send to its answer
  read to the end, its steps marked in the process (the route's functions wrapped with timers
  for this run only), in ms from the send: the request at the app, auth and scope, the row
  read (name resolution), the wake check, the use recorded, the claim's env read, the
  driver's steps (the container looked up when not remembered; on the runtime path the
  container's process read, runc started, the command started), its first and last event,
  the answer's start and end sent, the answer at the client;
- the API's own exec driver called directly (``exec_stream`` of the same sandbox, read to the
  end): the floor the route adds to.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from contextlib import aclosing

import httpx

from drivers.podman import PodmanDriver
from events.publisher import CommandPublisher
from services.api import readmodel
from services.api.app import create_app
from services.api.deps import ApiState
from services.api.server import start_api
from services.bench.drivers import Figures
from services.bench.exec_marks import STEPS, AsgiMarks, Timeline, instrument
from services.bench.exec_steps import runtime_beside_bare
from services.bench.warm import TOKEN, line
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.common.tokens import SCOPES, TokenStore
from services.localstack.isolation import isolated
from services.up.control_plane import ControlPlane


async def main(settings: Settings, samples: int) -> None:
    from services.executor.backends import podman_driver

    print(f"\nan exec through the HTTP API on Podman, step by step ({samples} each)")
    print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    async with isolated(settings, "benche", kafka_partitions=4, pool_poll_seconds=0.5) as (
        s,
        pool,
    ):
        driver = podman_driver(s, stop_timeout=2)
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600, with_scheduler=True)
        await plane.start()
        publisher = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
        await publisher.__aenter__()
        app = create_app(s, pool, publisher, TokenStore.of(admin=(TOKEN, *SCOPES)))
        timeline = Timeline()
        app.add_middleware(AsgiMarks, timeline=timeline)
        server = await start_api(app, "127.0.0.1", 0, access_log=False)
        try:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as c:
                name = await _claimed(c, s.sandbox_image)
                figures = await _run(c, app.state.api, timeline, name, samples)
                await c.delete(f"/v1/sandboxes/{name}")
                await c.delete("/v1/pools/bench")
        finally:
            await server.stop()
            await publisher.__aexit__()
            await plane.stop()
            await driver.close()
    print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for f in figures:
        print(line(f))


async def _claimed(c: httpx.AsyncClient, image: str) -> str:
    """A warm claim's name, once the pool of one was Ready."""
    spec = {"image": image, "command": ["sleep", "3600"], "stop_timeout_seconds": 2}
    r = await c.post("/v1/templates", json={"name": "exec-agent", "spec": spec})
    assert r.status_code == 201, r.text
    r = await c.post("/v1/pools", json={"name": "bench", "template": "exec-agent", "size": 1})
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 120
    while (await c.get("/v1/pools/bench")).json().get("status", {}).get("ready", 0) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError("the pool did not fill")
        await asyncio.sleep(0.1)
    name = f"e-{uuid.uuid4().hex[:8]}"
    r = await c.post("/v1/sandboxes", json={"name": name, "template": {"name": "exec-agent"}})
    assert r.status_code == 201 and r.json()["claim"]["warm"], r.text
    return name


async def _run(
    c: httpx.AsyncClient, state: ApiState, timeline: Timeline, name: str, samples: int
) -> list[Figures]:
    driver = state.exec_driver
    assert driver is not None
    view = await readmodel.get_sandbox(state.pool, name)
    assert view is not None
    forms: dict[str, dict[str, list[float]]] = {
        form: {mark: [] for _, mark in STEPS} for form in ("JSON", "stream")
    }
    alone: list[float] = []
    runc_path: list[float] = []
    bare: list[float] = []
    assert isinstance(driver, PodmanDriver)  # the bench runs on Podman
    execs = driver.execs
    runc = await execs.runtime()
    undo = instrument(timeline, state)
    try:
        for i in range(samples + 2):  # the first two warm up, not counted
            for form, params in (("JSON", {}), ("stream", {"stream": "true"})):
                timeline.start()
                r = await c.post(
                    f"/v1/sandboxes/{name}/exec", params=params, json={"command": ["true"]}
                )
                timeline.mark("client")
                assert r.status_code == 200, r.text
                assert "exit_code" in r.text, r.text
                if i >= 2:
                    timeline.keep(forms[form])
            began = time.perf_counter()
            async with aclosing(
                driver.exec_stream(view.member_key, view.generation, ["true"])
            ) as events:
                async for _ in events:
                    pass
            if i >= 2:
                alone.append(time.perf_counter() - began)
            if runc is None:
                continue
            runtime_id = execs.ids[(view.member_key, view.generation)]
            through, by_hand = await runtime_beside_bare(runc, runtime_id)
            if i >= 2:
                runc_path.append(through)
                bare.append(by_hand)
    finally:
        undo()
    figures = [Figures("the API's exec driver alone", alone)]
    if runc_path:
        figures += [
            Figures("the runc path alone (podman_runc)", runc_path),
            Figures("bare `runc exec`", bare),
        ]
    for label, marks in forms.items():
        for step, mark in STEPS:
            values = [v / 1000 for v in marks[mark]]
            if values:
                figures.append(Figures(f"{label}: {step}", values))
    return figures
