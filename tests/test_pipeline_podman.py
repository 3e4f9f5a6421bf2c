"""The whole pipeline on real Podman, Kafka and PostgreSQL (no mocks):
command → processor → executor → Podman → watcher → processor.

These fail (never skip) without the local stack: `make stack` first. Every test uses its own
topics, schema and sandbox names, and removes its containers and volumes afterwards.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import factories as f
import pytest
from harness import Env, eventually, isolated_env
from pipeline_support import (
    DRIVER_STOP_TIMEOUT,
    IGNORE_TERM,
    PodmanKeys,
    await_podman,
    command,
    containers_of,
    group_started,
    history,
    observations_of,
    phase,
    podman_env,
    produce_raw,
    row,
    running_plane,
    sandbox_spec,
    status_of,
    trap_set,
    volumes_of,
    wait_history_at,
    wait_phase,
)
from podman import PodmanClient

from drivers.fake import FakeDriver
from drivers.podman import PodmanDriver, container_name
from events.codec import OBSERVATIONS, decode
from events.observations import Observation, RuntimeRemoved, RuntimeSnapshot
from events.publisher import CommandPublisher
from services.common.settings import PROJECT_ROOT, Settings
from services.executor.backends import podman_driver
from services.up.control_plane import ControlPlane

# Writes the identity of the generation that first ran into the workspace, once; then idles.
FIRST_BORN = [
    "sh",
    "-c",
    'test -e /workspace/born || echo "$SANDSTREAM_IDENTITY" > /workspace/born; exec sleep 3600',
]


@dataclass
class Pipeline:
    env: Env
    plane: ControlPlane
    driver: PodmanDriver
    pub: CommandPublisher
    podman: PodmanClient
    keys: PodmanKeys

    @property
    def settings(self) -> Settings:
        return self.env.settings


@asynccontextmanager
async def podman_pipeline(
    podman: PodmanClient, prefix: str, **plane_args: Any
) -> AsyncIterator[Pipeline]:
    plane_args.setdefault("reconcile_interval", 3600)
    async with (
        podman_env(podman, prefix) as (env, driver, keys),
        running_plane(env, driver, removing=keys, **plane_args) as plane,
        await env.publisher() as pub,
    ):
        yield Pipeline(env, plane, driver, pub, podman, keys)


def names(client: PodmanClient, key: str) -> list[str]:
    return [c["name"] for c in containers_of(client, key)]


# -- the full lifecycle ---------------------------------------------------------------------------


async def test_full_lifecycle_on_podman(podman: PodmanClient) -> None:
    async with podman_pipeline(podman, "life") as p:
        env, key = p.env, p.keys()
        spec = sandbox_spec(p.settings, FIRST_BORN)

        # create → Ready (generation 1): one container, one workspace
        await command(env, p.pub, f.create(key, sandbox_spec=spec))
        first = await wait_phase(env, key, "Ready", generation=1)
        assert names(podman, key) == [container_name(key, 1)]
        assert len(volumes_of(podman, key)) == 1
        born = await wait_file(p.driver, key, 1)
        assert born == first["identity"]

        # stop → Stopped: the container is kept (exited), the workspace too
        await command(env, p.pub, f.stop(key))
        stopped = await wait_phase(env, key, "Stopped", generation=1)
        assert stopped["sandbox_id"] == first["sandbox_id"]
        [container] = containers_of(podman, key)
        assert container["status"] == "exited"

        # start → Ready with a new generation, on the same workspace
        await command(env, p.pub, f.start(key))
        second = await wait_phase(env, key, "Ready", generation=2)
        assert second["identity"] != first["identity"]
        assert names(podman, key) == [container_name(key, 2)]
        assert await p.driver.exec(key, 2, ["cat", "/workspace/born"]) == (0, born + "\n")

        # restart → Ready at generation 3, workspace still there
        await command(env, p.pub, f.restart(key))
        await wait_phase(env, key, "Ready", generation=3)
        assert names(podman, key) == [container_name(key, 3)]
        assert await p.driver.exec(key, 3, ["cat", "/workspace/born"]) == (0, born + "\n")

        # delete → tombstone; nothing of it left in Podman
        await command(env, p.pub, f.delete(key))
        tomb = await wait_phase(env, key, "Deleted")
        assert (tomb["generation"], tomb["sandbox_id"]) == (3, first["sandbox_id"])
        await await_podman(
            podman,
            lambda c: (names(c, key), volumes_of(c, key)),
            lambda found: found == ([], []),
            "no container and no volume left",
        )

        # re-create of the same name: a higher generation, a new id, a fresh workspace
        await command(env, p.pub, f.create(key, sandbox_spec=spec))
        again = await wait_phase(env, key, "Ready", generation=4)
        assert again["sandbox_id"] != first["sandbox_id"]
        assert names(podman, key) == [container_name(key, 4)]
        assert await wait_file(p.driver, key, 4) == again["identity"]  # not the old one

        # the history of the key tells the whole story, in order
        applied = [
            h["message_type"]
            for h in await history(env, key)
            if h["disposition"] == "applied" and h["topic"] == env.settings.topic_commands
        ]
        assert applied == [
            "CreateSandbox",
            "StopSandbox",
            "StartSandbox",
            "RestartSandbox",
            "DeleteSandbox",
            "CreateSandbox",
        ]


async def wait_file(driver: PodmanDriver, key: str, generation: int) -> str:
    """The content of /workspace/born once the entrypoint wrote it."""
    _, out = await eventually(
        lambda: driver.exec(key, generation, ["cat", "/workspace/born"]),
        lambda result: result[0] == 0 and bool(result[1].strip()),
        timeout=15,
        what=f"/workspace/born of {key} g{generation}",
    )
    return str(out).strip()


# -- scenario 3: delete head-of-line -------------------------------------------------------------


async def test_slow_delete_of_a_does_not_delay_b_on_podman(podman: PodmanClient) -> None:
    """A and B ignore SIGTERM (even under catatonit); A's grace period is 600 s, B's 1 s.
    Deleting A, then B: B is tombstoned while A's delete is still in flight, Podman still
    stopping A; A's delete ends when A is killed."""
    a_timeout, b_timeout = 600, 1
    async with podman_pipeline(podman, "hol") as p:
        env, a, b = p.env, p.keys(), p.keys()
        await command(
            env, p.pub, f.create(a, sandbox_spec=sandbox_spec(p.settings, IGNORE_TERM, a_timeout))
        )
        await command(
            env, p.pub, f.create(b, sandbox_spec=sandbox_spec(p.settings, IGNORE_TERM, b_timeout))
        )
        await wait_phase(env, a, "Ready")
        await wait_phase(env, b, "Ready")
        await trap_set(p.driver, a, 1)

        await command(env, p.pub, f.delete(a))
        await command(env, p.pub, f.delete(b))
        await wait_phase(env, b, "Deleted")
        a_now = await row(env, a)
        assert a_now is not None and a_now["phase"] == "Deleting", a_now
        # A is really still being stopped by Podman: its delete is in flight.
        assert status_of(podman, container_name(a, 1)) == "stopping"

        # Only SIGKILL ends A (instead of waiting out its 600 s): then its delete finishes.
        kill = f"/containers/{container_name(a, 1)}/kill"
        await asyncio.to_thread(podman.api.post, kill, params={"signal": "SIGKILL"})
        await wait_phase(env, a, "Deleted")
        # (The watcher may report the death after the delete's own result: wait for it.)
        watched = await wait_watched(env, a, lambda o: o.actor == "podman-watcher", {"exited"})
        died = [o for o in map(decode_observation, watched) if is_exit(o)]
        assert [(o.source, o.exit_code) for o in died] == [("watch", 137)]
        for key in (a, b):
            assert names(podman, key) == []
        await await_podman(
            podman,
            lambda c: volumes_of(c, a) + volumes_of(c, b),
            lambda v: v == [],
            "both workspaces removed",
        )


async def test_the_plane_stops_even_when_removing_the_tests_sandboxes_fails(
    podman: PodmanClient,
) -> None:
    """The harness: a test's control plane is stopped after its containers are removed, and
    also when removing them fails (else it would run on, consuming, until the session ends)."""

    class Unremovable(PodmanKeys):
        def cleanup(self) -> None:
            raise RuntimeError("podman refused")

    async with isolated_env() as env:
        with pytest.raises(RuntimeError, match="podman refused"):
            async with running_plane(
                env, FakeDriver(), removing=Unremovable(podman, "unrm")
            ) as plane:
                assert not plane.stopping.is_set()
        assert plane.stopping.is_set()


# -- late and duplicate events -------------------------------------------------------------------


async def test_late_and_duplicate_podman_events_do_not_move_rows(podman: PodmanClient) -> None:
    async with podman_pipeline(podman, "late") as p:
        env, key = p.env, p.keys()
        await command(env, p.pub, f.create(key, sandbox_spec=sandbox_spec(p.settings, FIRST_BORN)))
        await wait_phase(env, key, "Ready", generation=1)
        await command(env, p.pub, f.stop(key))
        await wait_phase(env, key, "Stopped", generation=1)

        # What the watcher really reported about generation 1: created, running, exited (143).
        def from_watcher(generation: int) -> Callable[[Any], bool]:
            return lambda o: o.actor == "podman-watcher" and o.generation == generation

        gen1 = await wait_watched(env, key, from_watcher(1), {"created", "running", "exited"})

        async def replay(recorded: list[bytes], reason: str) -> None:
            before = await row(env, key)
            placed = await produce_raw(env, [(key.encode(), raw) for raw in recorded])
            rows = await wait_history_at(env, placed)
            assert {r["disposition"] for r in rows} == {"ignored"}, rows
            assert all(reason in r["reason"] for r in rows), [r["reason"] for r in rows]
            after = await row(env, key)
            assert after == before  # phase, generation, version: nothing moved

        # 1. After the stop: the stop's own events and the ones before it change nothing.
        await replay(gen1, "no effect in phase Stopped")

        # 2. After a start: generation 1 is stale.
        await command(env, p.pub, f.start(key))
        await wait_phase(env, key, "Ready", generation=2)
        await replay(gen1, "stale")

        # 3. After the delete: everything recorded, removals included, hits the tombstone.
        await command(env, p.pub, f.delete(key))
        await wait_phase(env, key, "Deleted")
        everything = await wait_watched(
            env, key, lambda o: o.actor == "podman-watcher", {"removed"}, generation=2
        )
        assert len(everything) > len(gen1)
        await replay(everything, "tombstoned at generation 2")


async def wait_watched(
    env: Env,
    key: str,
    keep: Callable[[Any], bool],
    kinds: set[str],
    generation: int | None = None,
) -> list[bytes]:
    """The recorded observations ``keep`` selects, once they include each of ``kinds``
    (for ``generation``, if given)."""

    async def chosen() -> list[tuple[Any, bytes]]:
        return [(o, raw) for o, raw in await observations_of(env, key) if keep(o)]

    def seen(found: list[tuple[Any, bytes]]) -> set[str]:
        return {
            "removed" if isinstance(o, RuntimeRemoved) else o.state
            for o, _ in found
            if generation in (None, o.generation)
        }

    found = await eventually(
        chosen, lambda found: kinds <= seen(found), timeout=20, what=f"{kinds} for {key}"
    )
    return [raw for _, raw in found]


def decode_observation(raw: bytes) -> Observation:
    return decode(OBSERVATIONS, raw)


def is_exit(o: Observation) -> TypeGuard[RuntimeSnapshot]:
    return isinstance(o, RuntimeSnapshot) and o.state == "exited"


# -- executor crash ------------------------------------------------------------------------------


class ExecutorProcess:
    """``python -m services.executor`` on the isolated environment's topics and schema."""

    def __init__(self, env: Env, log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self) -> None:
        self.runs += 1
        variables = {
            **self.env.env_vars(),
            "SANDSTREAM_STOP_TIMEOUT_SECONDS": str(int(DRIVER_STOP_TIMEOUT)),
            "SANDSTREAM_RECONCILE_INTERVAL_SECONDS": "3600",
            "SANDSTREAM_EXECUTOR_RETRY_SECONDS": "30",
        }
        log = (self.log_dir / f"executor-{self.runs}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.executor"],
            cwd=PROJECT_ROOT,
            env=variables,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace")[-3000:] for p in sorted(self.log_dir.glob("*.log"))
        )


async def test_executor_crash_mid_operation_leaks_and_duplicates_nothing(
    podman: PodmanClient, tmp_path: Path
) -> None:
    """SIGKILL the executor while a launch (a restart removing a SIGTERM-ignoring runtime),
    a burst of creates, and a delete are in flight; after a restart everything converges
    with exactly one container per live generation and none after the delete."""
    keys = PodmanKeys(podman, "crash")
    executor: ExecutorProcess | None = None
    try:
        async with isolated_env() as env, await env.publisher() as pub:
            await env.start_processor()
            executor = ExecutorProcess(env, tmp_path)
            executor.start()
            # A new group starts at the end of the events topic: wait until it has joined
            # (committed its starting offsets) before deciding anything for it.
            await eventually(
                lambda: group_started(env.settings, env.settings.executor_group),
                bool,
                timeout=60,
                what="the executor group's starting offsets",
            )
            driver = podman_driver(env.settings)  # only to look inside the sandboxes
            try:
                await crash_scenarios(env, pub, podman, driver, keys, executor)
            except BaseException:
                print(executor.logs())
                raise
            finally:
                await driver.close()
            assert executor.terminate() == 0, executor.logs()  # a clean SIGTERM shutdown
    finally:
        if executor is not None and executor.alive():
            executor.kill()
        await asyncio.to_thread(keys.cleanup)


async def crash_scenarios(
    env: Env,
    pub: CommandPublisher,
    podman: PodmanClient,
    driver: PodmanDriver,
    keys: PodmanKeys,
    executor: ExecutorProcess,
) -> None:
    a = keys()
    slow = sandbox_spec(env.settings, IGNORE_TERM, stop_timeout=4)
    await command(env, pub, f.create(a, sandbox_spec=slow))
    await wait_phase(env, a, "Ready", generation=1, timeout=60)
    await trap_set(driver, a, 1)  # else the restart's stop ends it at once: no "stopping"

    # 1. A launch in flight: the restart's launch is stopping generation 1 (4 s of grace).
    await command(env, pub, f.restart(a))
    await await_podman(
        podman,
        lambda c: status_of(c, container_name(a, 1)),
        lambda s: s == "stopping",
        "generation 1 being stopped by the launch of generation 2",
    )
    executor.kill()
    assert await phase(env, a) == "Starting"  # nothing was reported
    executor.start()
    await wait_phase(env, a, "Ready", generation=2, timeout=60)
    await await_podman(
        podman,
        lambda c: [(x["name"], x["status"]) for x in containers_of(c, a)],
        lambda found: found == [(container_name(a, 2), "running")],
        "exactly one container, of generation 2",
    )

    # 2. A burst of creates, killed as soon as the first container exists.
    burst = [keys() for _ in range(3)]
    plain = sandbox_spec(env.settings, ["sh", "-c", "exec sleep 3600"])
    for key in burst:
        await pub.publish(f.create(key, sandbox_spec=plain))
    await await_podman(
        podman,
        lambda c: sum(len(containers_of(c, k)) for k in burst),
        lambda n: n >= 1,
        "the first container of the burst",
    )
    executor.kill()
    executor.start()
    for key in burst:
        await wait_phase(env, key, "Ready", generation=1, timeout=60)
    for key in burst:
        found = [(x["name"], x["status"]) for x in containers_of(podman, key)]
        assert found == [(container_name(key, 1), "running")], (key, found)
        assert len(volumes_of(podman, key)) == 1

    # 3. A delete in flight: generation 2 is being stopped (4 s of grace).
    await trap_set(driver, a, 2)
    await command(env, pub, f.delete(a))
    await await_podman(
        podman,
        lambda c: status_of(c, container_name(a, 2)),
        lambda s: s == "stopping",
        "generation 2 being stopped by the delete",
    )
    executor.kill()
    assert await phase(env, a) == "Deleting"
    executor.start()
    await wait_phase(env, a, "Deleted", timeout=60)
    await await_podman(
        podman,
        lambda c: (containers_of(c, a), volumes_of(c, a)),
        lambda found: found == ([], []),
        "nothing of the deleted sandbox left",
    )
    # The burst is untouched by all this.
    for key in burst:
        assert [x["status"] for x in containers_of(podman, key)] == ["running"]
