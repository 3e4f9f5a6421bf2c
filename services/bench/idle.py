"""An idle control plane's cost to its broker (``python -m services.bench idle``).

A Kafka broker of its own (the shared one serves others: its CPU could not be attributed), its
CPU time per second from /proc over a window with no client connected (the reference), then
with the control plane as ``sandstream up`` runs it in one process (processor, executor and
watcher with the fake driver, the HTTP API) idle on it, then with no client again. A first,
uncounted run of the control plane takes the broker past its first groups' set-up (the offsets
topic, 50 partitions) and warms its JIT, which would otherwise be counted against whatever
runs first.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from drivers.fake import FakeDriver
from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.server import start_api
from services.common.kafka_clients import kafka_client_args
from services.common.metrics import KAFKA_REQUESTS
from services.common.settings import Settings
from services.common.tokens import TokenStore
from services.localstack import private_broker
from services.localstack.isolation import isolated
from services.up.control_plane import ControlPlane

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def cpu_ms_per_second(pid: int, seconds: float) -> float:
    began, used = time.monotonic(), cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - used) / (time.monotonic() - began) * 1000


def kafka_requests() -> dict[tuple[str, str], float]:
    """The Kafka requests this process's clients sent so far, by (client, request type)."""
    counts: dict[tuple[str, str], float] = {}
    for metric in KAFKA_REQUESTS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = (sample.labels["client"], sample.labels["request"])
                counts[key] = sample.value
    return counts


def requests_line(before: dict[tuple[str, str], float], seconds: float) -> str:
    """Requests a second since ``before``, the total and the largest by client and type."""
    after = kafka_requests()
    delta = {k: (v - before.get(k, 0.0)) / seconds for k, v in after.items()}
    ranked = sorted(((k, v) for k, v in delta.items() if v > 0), key=lambda kv: -kv[1])
    top = ", ".join(f"{client} {request} {v:.1f}" for (client, request), v in ranked[:8])
    return f"{sum(delta.values()):.1f}/s ({top})"


async def with_control_plane(settings: Settings, pid: int, seconds: float) -> tuple[float, str]:
    """The broker's CPU ms a second while the control plane runs idle on it, and the
    control plane's Kafka requests a second."""
    async with isolated(settings, "bench") as (s, pool):
        plane = ControlPlane(s, FakeDriver(), pool, reconcile_interval=3600)
        await plane.start()
        publisher = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
        await publisher.__aenter__()
        server = await start_api(create_app(s, pool, publisher, TokenStore.of()), "127.0.0.1", 0)
        try:
            await asyncio.sleep(10)  # joined, first fetches and metadata done
            before = kafka_requests()
            cpu = await cpu_ms_per_second(pid, seconds)
            return cpu, requests_line(before, seconds)
        finally:
            await server.stop()
            await publisher.__aexit__()
            await plane.stop()


async def idle_figures(settings: Settings, seconds: float) -> None:
    with tempfile.TemporaryDirectory(prefix="sandstream-bench-idle-") as state:
        await _idle_figures(settings, Path(state), seconds)


async def _idle_figures(settings: Settings, state: Path, seconds: float) -> None:
    broker_settings = private_broker.private_settings(
        settings,
        state / "kafka",
        pg_password_file=settings.pg_password_path,
        podman_socket=settings.podman_socket_path,
    )
    broker = private_broker.start(broker_settings)
    try:
        await asyncio.to_thread(private_broker.wait_ready, broker_settings, broker)
        # Not counted: the first groups' set-up, and the broker's JIT warming up (its CPU at
        # rest falls by half over its first minutes here).
        await with_control_plane(broker_settings, broker.pid, 2 * seconds)
        await asyncio.sleep(5)
        before = await cpu_ms_per_second(broker.pid, seconds)
        idle, requests = await with_control_plane(broker_settings, broker.pid, seconds)
        await asyncio.sleep(5)
        after = await cpu_ms_per_second(broker.pid, seconds)
    finally:
        await asyncio.to_thread(private_broker.stop, broker)
    print(
        f"idle        the broker's CPU over {seconds:.0f} s, a broker of its own\n"
        f"            no client (before)      {before:6.1f} ms/s\n"
        f"            control plane idle      {idle:6.1f} ms/s\n"
        f"            no client (after)       {after:6.1f} ms/s\n"
        f"            the control plane's share {idle - (before + after) / 2:6.1f} ms/s\n"
        f"            its Kafka requests      {requests}"
    )
