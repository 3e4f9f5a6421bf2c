"""Replayed and redelivered intents have no side effects on real Podman, Kafka and PostgreSQL.

The executor checks every intent against the sandbox's current row before it calls the
driver. An executor whose group's committed offset is old (a crash before it committed, or a
restart long after) reads ``[launch, stop]``, ``[launch, delete]``, a ``delete`` after the
tombstone and an old incarnation's intents again: no container runs again, nothing is
re-created, and the new incarnation of a re-created name is left alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import factories as f
from harness import Env, eventually
from pipeline_support import (
    SLEEPER,
    caught_up,
    command,
    containers_of,
    history,
    podman_env,
    processor_caught_up,
    rewind_group,
    running_plane,
    sandbox_spec,
    volumes_of,
    wait_phase,
)
from podman import PodmanClient

from drivers.protocol import LABEL_KEY


async def driver_results(env: Env, key: str) -> list[dict[str, Any]]:
    return [h for h in await history(env, key) if h["message_type"] == "DriverOperationResult"]


def started_at(podman: PodmanClient, key: str) -> list[tuple[str, str, str]]:
    """(name, status, StartedAt) of each container of ``key``."""
    found = []
    for c in containers_of(podman, key):
        state = podman.containers.get(c["id"]).attrs["State"]
        found.append((c["name"], state["Status"], state["StartedAt"]))
    return found


def lifecycle_events(podman: PodmanClient, keys: list[str], since: float) -> list[Any]:
    """Podman's create/start/remove events of ``keys``' containers since ``since``."""
    events = podman.events(
        since=int(since) - 1, until=int(time.time()) + 1, decode=True, filters={"type": "container"}
    )
    return [
        (e["Actor"]["Attributes"].get(LABEL_KEY), e["Action"])
        for e in events
        if e.get("Action") in ("create", "init", "start", "remove")
        and e["Actor"]["Attributes"].get(LABEL_KEY) in keys
        and e["timeNano"] > since * 1e9
    ]


async def test_a_replayed_log_never_runs_or_recreates_anything_on_podman(
    podman: PodmanClient,
) -> None:
    async with podman_env(podman, "replay") as (env, driver, keys):
        stopped, deleted, renamed = keys(), keys(), keys()
        spec = sandbox_spec(env.settings, SLEEPER)
        async with (
            running_plane(env, driver, reconcile_interval=3600),
            await env.publisher() as pub,
        ):
            # [launch, stop]
            await command(env, pub, f.create(stopped, sandbox_spec=spec))
            await wait_phase(env, stopped, "Ready")
            await command(env, pub, f.stop(stopped))
            await wait_phase(env, stopped, "Stopped")
            # [launch, delete], then the tombstone
            await command(env, pub, f.create(deleted, sandbox_spec=spec))
            await wait_phase(env, deleted, "Ready")
            await command(env, pub, f.delete(deleted))
            await wait_phase(env, deleted, "Deleted")
            # an old incarnation's [launch, delete] before a new incarnation of the name
            await command(env, pub, f.create(renamed, sandbox_spec=spec))
            await wait_phase(env, renamed, "Ready")
            await command(env, pub, f.delete(renamed))
            await wait_phase(env, renamed, "Deleted")
            await command(env, pub, f.create(renamed, sandbox_spec=spec))
            await wait_phase(env, renamed, "Ready", generation=2)
            await eventually(
                lambda: caught_up(env.settings, env.settings.executor_group),
                bool,
                what="the first executor committed everything",
            )
            # Its results were sent before it committed; the rows may have moved on the
            # watcher's events before they were applied.
            await eventually(lambda: processor_caught_up(env), bool, what="its results applied")
        before = {k: await asyncio.to_thread(started_at, podman, k) for k in keys.made}
        assert [s for _, s, _ in before[stopped]] == ["exited"]
        assert before[deleted] == [] and volumes_of(podman, deleted) == []
        assert [s for _, s, _ in before[renamed]] == ["running"]
        results = {k: await driver_results(env, k) for k in keys.made}

        # The same group restarts with its committed offset rewound to the beginning.
        await rewind_group(env.settings, env.settings.executor_group)
        since = time.time()
        async with running_plane(env, driver, reconcile_interval=3600) as plane:
            await eventually(
                lambda: caught_up(env.settings, env.settings.executor_group),
                bool,
                what="the restarted executor committed the replayed log",
            )
            await eventually(lambda: processor_caught_up(env), bool, what="the log applied")
            assert plane.executor is not None
            # Seven intents: launch+stop, launch+delete, and the re-created name's launch,
            # delete, launch; each dropped (its row moved past it) or skipped (superseded).
            assert plane.executor.dropped + plane.executor.skipped == 7

        after = {k: await asyncio.to_thread(started_at, podman, k) for k in keys.made}
        assert after == before  # not started again (same StartedAt), nothing re-created
        assert volumes_of(podman, deleted) == []
        assert len(volumes_of(podman, renamed)) == 1
        assert await asyncio.to_thread(lifecycle_events, podman, keys.made, since) == []
        assert {k: await driver_results(env, k) for k in keys.made} == results  # none reported
