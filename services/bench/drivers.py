"""Driver benchmarks (part of ``make bench``): figures printed, never asserted.

(a) Stop latency on real Podman, from the StopSandbox command being published to the row
    being Stopped, for an entrypoint that ignores SIGTERM *as PID 1* (a plain ``sleep``: the
    kernel applies no default action to PID 1): with an init process (catatonit forwards the
    signal to ``sleep``, which dies) against without one (nothing happens until SIGKILL at the
    end of the stop timeout). Target: < 1.5 s with init.
(b) Unrelated-sandbox delay: while sandbox A's delete is held in the (fake) driver for 30 s,
    sandbox B is stopped and started over and over; each command is timed from publish to the
    row reaching its phase. Target: p99 < 100 ms.

(d) Resume against a cold create on real Podman: the same sandboxes created (command published
    → Ready: a new volume, a new container), suspended (→ Suspended: the container removed, the
    volume kept) and resumed (→ Ready: a new container on the kept volume), in one run.

(c) Starvation: one caller deletes 100 sandboxes that ignore SIGTERM, each with an hour of
    grace (fake driver with real timing); while all 100 are stuck, another caller's creates
    (to Ready) and stops (to Stopped) are timed. Same target as (b).

All run the whole pipeline (processor + executor + watcher) on the real Kafka and PostgreSQL,
with their own topics and schema, removed afterwards. ``main(settings)`` prints a small table;
``python -m services.bench drivers`` runs it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from drivers.fake import IGNORES_SIGTERM, FakeDriver
from drivers.protocol import LABEL_KEY
from drivers.routing import RoutingDriver
from events.commands import (
    Command,
    CreateSandbox,
    DeleteSandbox,
    ResumeSandbox,
    StartSandbox,
    StopSandbox,
    SuspendSandbox,
)
from events.common import SandboxSpec
from events.publisher import CommandPublisher
from events.topics import CHANGES_CHANNEL
from services.common.kafka_clients import kafka_client_args
from services.common.notify_channels import listen
from services.common.settings import Settings
from services.localstack.isolation import isolated
from services.up.control_plane import ControlPlane

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PID1_IGNORES_TERM = ["sleep", "3600"]  # no SIGTERM handler: as PID 1 the signal is ignored


@dataclass(frozen=True)
class Figures:
    label: str
    samples: list[float]  # seconds

    def line(self, unit: str = "s", target: str = "") -> str:
        scale, fmt = (1.0, "{:6.2f} s ") if unit == "s" else (1000.0, "{:6.1f} ms")
        s = sorted(self.samples)
        if not s:
            return f"  {self.label:<44} no samples"
        parts = [
            f"n={len(s):<4}",
            "p50 " + fmt.format(statistics.median(s) * scale),
            "p95 " + fmt.format(percentile(s, 95) * scale),
            "p99 " + fmt.format(percentile(s, 99) * scale),
            "max " + fmt.format(s[-1] * scale),
        ]
        return f"  {self.label:<44} " + "  ".join(parts) + (f"   {target}" if target else "")


def percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


# -- plumbing ---------------------------------------------------------------------------------


class Rows:
    """Waits for rows to reach a phase, woken by the processor's per-batch NOTIFY."""

    def __init__(self, conn: asyncpg.Connection, pool: asyncpg.Pool[asyncpg.Record]) -> None:
        self.conn = conn
        self.pool = pool
        self.changed = asyncio.Event()  # replaced on every notification (a broadcast)

    @classmethod
    async def open(cls, settings: Settings, pool: asyncpg.Pool[asyncpg.Record]) -> Rows:
        conn = await asyncpg.connect(
            settings.pg_dsn, server_settings={"search_path": settings.pg_schema}
        )
        rows = cls(conn, pool)
        await listen(conn, CHANGES_CHANNEL, rows._notified)
        return rows

    def _notified(self, *_: object) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def close(self) -> None:
        await self.conn.close()

    async def phase(self, key: str) -> tuple[str, int] | None:
        found = await self.pool.fetchrow(
            "SELECT phase, generation FROM sandboxes WHERE key = $1", key
        )
        return (found["phase"], found["generation"]) if found else None

    async def until(self, key: str, phase: str, timeout: float = 60.0) -> float:
        """Wait until ``key`` is in ``phase``; returns the perf_counter time it was seen."""
        deadline = time.perf_counter() + timeout
        while True:
            changed = self.changed
            found = await self.phase(key)
            if found is not None and found[0] == phase:
                return time.perf_counter()
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError(f"{key} not {phase} within {timeout}s (is {found})")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(remaining, 0.5))


def _cmd(kind: type[Command], key: str, actor: str = "bench", **extra: object) -> Command:
    return kind(
        type=kind.__name__,
        command_id=uuid.uuid4().hex,
        key=key,
        occurred_at=T0,
        actor=actor,
        **extra,
    )


async def timed(pub: CommandPublisher, rows: Rows, command: Command, phase: str) -> float:
    began = time.perf_counter()
    await pub.publish(command)
    return await rows.until(command.key, phase) - began


# -- (a) stop latency with and without init ----------------------------------------------------


async def stop_latency(
    settings: Settings, with_init: int = 5, without_init: int = 3, stop_timeout: int = 3
) -> list[Figures]:
    from services.executor.backends import podman_driver

    suffix = uuid.uuid4().hex[:6]
    init_keys = [f"bench-init-{suffix}-{i}" for i in range(with_init)]
    bare_keys = [f"noinit-{suffix}-{i}" for i in range(without_init)]
    spec = SandboxSpec(
        image=settings.sandbox_image,
        command=PID1_IGNORES_TERM,
        stop_timeout_seconds=stop_timeout,
    )
    async with isolated(settings, "benchd", kafka_partitions=4) as (s, pool):
        # Keys starting with ``noinit-`` are launched without an init process.
        driver = RoutingDriver(
            podman_driver(s, stop_timeout=stop_timeout),
            podman_driver(s, stop_timeout=stop_timeout, init=False),
            prefix="noinit-",
        )
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600)
        rows = await Rows.open(s, pool)
        await plane.start()
        try:
            async with CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands) as pub:
                for key in init_keys + bare_keys:
                    await pub.publish(_cmd(CreateSandbox, key, spec=spec))
                for key in init_keys + bare_keys:
                    await rows.until(key, "Ready")
                fast = [await timed(pub, rows, _cmd(StopSandbox, k), "Stopped") for k in init_keys]
                slow = await asyncio.gather(
                    *(timed(pub, rows, _cmd(StopSandbox, k), "Stopped") for k in bare_keys)
                )
                for key in init_keys + bare_keys:
                    await pub.publish(_cmd(DeleteSandbox, key))
                for key in init_keys + bare_keys:
                    await rows.until(key, "Deleted")
        finally:
            await plane.stop()
            await rows.close()
            await driver.close()
            await asyncio.to_thread(_force_remove, s, init_keys + bare_keys)
    return [
        Figures("with init (catatonit as PID 1)", fast),
        Figures(f"without init (stop timeout {stop_timeout} s)", list(slow)),
    ]


# -- (d) resume beside a cold create --------------------------------------------------------


async def resume_latency(settings: Settings, n: int = 5) -> list[Figures]:
    from services.executor.backends import podman_driver

    keys = [f"bench-resume-{uuid.uuid4().hex[:6]}-{i}" for i in range(n)]
    spec = SandboxSpec(image=settings.sandbox_image, command=["sleep", "3600"])
    created, suspended, resumed = [], [], []
    async with isolated(settings, "benchr", kafka_partitions=4) as (s, pool):
        driver = podman_driver(s)
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600)
        rows = await Rows.open(s, pool)
        await plane.start()
        try:
            async with CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands) as pub:
                for key in keys:  # one at a time: each figure is one sandbox's alone
                    created.append(
                        await timed(pub, rows, _cmd(CreateSandbox, key, spec=spec), "Ready")
                    )
                    suspended.append(await timed(pub, rows, _cmd(SuspendSandbox, key), "Suspended"))
                    resumed.append(await timed(pub, rows, _cmd(ResumeSandbox, key), "Ready"))
                    await pub.publish(_cmd(DeleteSandbox, key))
                for key in keys:
                    await rows.until(key, "Deleted")
        finally:
            await plane.stop()
            await rows.close()
            await driver.close()
            await asyncio.to_thread(_force_remove, s, keys)
    return [
        Figures("cold create → Ready", created),
        Figures("suspend → Suspended (container removed)", suspended),
        Figures("resume → Ready (same volume)", resumed),
    ]


def _force_remove(settings: Settings, keys: Sequence[str]) -> None:
    """Leftovers of a failed run: SIGKILL and remove at once."""
    from podman import PodmanClient

    with PodmanClient(base_url=settings.podman_url, timeout=60) as client:
        for key in keys:
            for c in client.containers.list(all=True, filters=[f"label={LABEL_KEY}={key}"]):
                client.api.delete(f"/containers/{c.id}", params={"force": True, "timeout": 0})
            for v in client.volumes.list(filters=[f"label={LABEL_KEY}={key}"]):
                client.volumes.remove(v.name, force=True)


# -- (b) unrelated-sandbox delay while a delete is held ----------------------------------------


async def unrelated_delay(settings: Settings, held_for: float = 30.0) -> tuple[Figures, float]:
    driver = FakeDriver()
    spec = SandboxSpec(image=settings.sandbox_image, command=["sleep", "3600"])
    async with isolated(settings, "benchd", kafka_partitions=4) as (s, pool):
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600)
        rows = await Rows.open(s, pool)
        await plane.start()
        try:
            async with CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands) as pub:
                for key in ("a", "b"):
                    await pub.publish(_cmd(CreateSandbox, key, spec=spec))
                for key in ("a", "b"):
                    await rows.until(key, "Ready")
                # Warm-up: one round trip of B before measuring.
                await timed(pub, rows, _cmd(StopSandbox, "b"), "Stopped")
                await timed(pub, rows, _cmd(StartSandbox, "b"), "Ready")

                held = driver.block("delete", "a")
                await pub.publish(_cmd(DeleteSandbox, "a"))
                await held.entered(timeout=30)
                began = time.perf_counter()
                samples: list[float] = []
                while time.perf_counter() - began < held_for:
                    samples.append(await timed(pub, rows, _cmd(StopSandbox, "b"), "Stopped"))
                    samples.append(await timed(pub, rows, _cmd(StartSandbox, "b"), "Ready"))
                state = await rows.phase("a")
                if state is None or state[0] != "Deleting":
                    raise RuntimeError(f"A should still be Deleting, is {state}")
                released = time.perf_counter()
                held.release()
                a_after = await rows.until("a", "Deleted") - released
        finally:
            await plane.stop()
            await rows.close()
            await driver.close()
    return Figures(f"B stop/start while A's delete is held {held_for:.0f} s", samples), a_after


# -- (c) another caller's latency while 100 sandboxes are stuck in their grace period --------


async def starvation(settings: Settings, stuck: int = 100, rounds: int = 20) -> list[Figures]:
    driver = FakeDriver(real_grace=True)
    stubborn = SandboxSpec(
        image=settings.sandbox_image, labels={IGNORES_SIGTERM: "true"}, stop_timeout_seconds=3600
    )
    plain = SandboxSpec(image=settings.sandbox_image, command=["sleep", "3600"])
    keys = [f"stuck-{i}" for i in range(stuck)]
    async with isolated(settings, "benchd", kafka_partitions=4) as (s, pool):
        plane = ControlPlane(s, driver, pool, reconcile_interval=3600)
        rows = await Rows.open(s, pool)
        await plane.start()
        creates: list[float] = []
        stops: list[float] = []
        try:
            async with CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands) as pub:
                for key in keys:
                    await pub.publish(_cmd(CreateSandbox, key, "hostile", spec=stubborn))
                for key in keys:
                    await rows.until(key, "Ready")
                for key in keys:
                    await pub.publish(_cmd(DeleteSandbox, key, "hostile"))
                for key in keys:
                    await rows.until(key, "Deleting")
                for i in range(rounds):
                    key = f"other-{i}"
                    create = _cmd(CreateSandbox, key, "alice", spec=plain)
                    creates.append(await timed(pub, rows, create, "Ready"))
                    stops.append(await timed(pub, rows, _cmd(StopSandbox, key, "alice"), "Stopped"))
                still = await pool.fetchval(
                    "SELECT count(*) FROM sandboxes WHERE phase = 'Deleting'"
                )
                if still != stuck:
                    raise RuntimeError(f"all {stuck} should still be Deleting, {still} are")
        finally:
            if plane.executor is not None:
                plane.executor.shutdown_grace = 0.5
            await plane.stop()
            await rows.close()
            await driver.close()
    return [
        Figures(f"create→Ready while {stuck} deletes are stuck", creates),
        Figures(f"stop→Stopped while {stuck} deletes are stuck", stops),
    ]


# -- entry points ------------------------------------------------------------------------------


async def main(settings: Settings, held_for: float = 30.0) -> None:
    print("driver benchmarks (whole pipeline: command published → row in its phase)")
    print("(a) stop latency, real Podman, entrypoint `sleep` (ignores SIGTERM as PID 1)")
    for figures, target in zip(
        await stop_latency(settings), ("target < 1.5 s", "the full stop timeout"), strict=True
    ):
        print(figures.line("s", target))
    print("(b) unrelated-sandbox delay, fake driver holding A's delete")
    figures, a_after = await unrelated_delay(settings, held_for)
    print(figures.line("ms", "target p99 < 100 ms"))
    print(f"  {'A tombstoned after its delete was released':<44} {a_after * 1000:6.1f} ms")
    print("(d) resume beside a cold create, real Podman, one sandbox at a time")
    for figures in await resume_latency(settings):
        print(figures.line("s"))
    print("(c) another caller while one caller's 100 SIGTERM-ignoring deletes wait out 1 h")
    for figures in await starvation(settings):
        print(figures.line("ms", "target p99 < 100 ms"))
