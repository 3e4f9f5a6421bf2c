"""The reconcile loop: the pure ``reconcile()`` and, on real Podman, Kafka and PostgreSQL, a
runtime removed behind sandstream's back and an orphan runtime with our marker.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import factories as f
import pytest
from aiokafka import AIOKafkaProducer
from harness import eventually, isolated_env
from pipeline_support import (
    SLEEPER,
    command,
    containers_of,
    history,
    observations_of,
    podman_env,
    produce_raw,
    remove_now,
    running_plane,
    sandbox_spec,
    volumes_of,
    wait_history_at,
    wait_phase,
)
from podman import PodmanClient

from drivers.fake import FakeDriver
from drivers.podman import PodmanDriver, container_name
from drivers.protocol import LaunchSpec, RuntimeInfo, WatchObservation
from events.codec import encode
from events.common import Phase
from events.observations import RuntimeRemoved, RuntimeSnapshot
from services.common.kafka_clients import kafka_client_args
from services.executor.reconcile import (
    LiveRow,
    Reconciler,
    reconcile,
    stale_runtimes,
    stray_runtimes,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SID = uuid.UUID("00000000-0000-4000-8000-0000000000aa")
OTHER = uuid.UUID("00000000-0000-4000-8000-0000000000bb")


def live(key: str, generation: int, phase: Phase, sandbox_id: uuid.UUID = SID) -> LiveRow:
    return LiveRow(key, sandbox_id, generation, phase, version=1)


def runtime(
    key: str,
    generation: int,
    state: str = "running",
    sandbox_id: uuid.UUID = SID,
    since: datetime | None = None,
) -> RuntimeInfo:
    return RuntimeInfo(
        key=key,
        sandbox_id=sandbox_id,
        generation=generation,
        state=state,  # type: ignore[arg-type]
        exit_code=143 if state == "exited" else None,
        runtime_id=f"rt-{key}-{generation}-{sandbox_id.hex[-2:]}",
        identity=None,
        since=since,
    )


def kinds(observations: list[Any]) -> list[tuple[str, str, int]]:
    return [
        ("vanished" if isinstance(o, RuntimeRemoved) else "orphan", o.key, o.generation)
        for o in observations
    ]


# -- the pure function ----------------------------------------------------------------------------


def test_nothing_to_report_when_rows_and_runtimes_agree() -> None:
    rows = [live("a", 1, Phase.READY), live("b", 3, Phase.STOPPED), live("c", 2, Phase.STOPPING)]
    runtimes = [runtime("a", 1), runtime("b", 3, "exited"), runtime("c", 2)]
    assert reconcile(rows, runtimes, NOW) == []


@pytest.mark.parametrize("phase", [Phase.READY, Phase.STOPPING])
def test_a_runtime_that_vanished_is_reported_removed(phase: Phase) -> None:
    [observation] = reconcile([live("a", 2, phase)], [], NOW)
    assert isinstance(observation, RuntimeRemoved)
    assert (observation.key, observation.generation, observation.source) == ("a", 2, "reconcile")
    assert observation.actor == "reconciler" and observation.occurred_at == NOW
    assert observation.observation_id == f"reconcile:vanished:{SID}:2"  # deterministic


@pytest.mark.parametrize(
    "phase",
    [
        Phase.PROVISIONING,
        Phase.STARTING,
        Phase.STOPPED,
        Phase.COMPLETED,
        Phase.ERROR,
        Phase.DELETING,
    ],
)
def test_no_runtime_is_news_only_where_one_is_needed(phase: Phase) -> None:
    # Launching: not created yet. Stopped/Completed/Error: not needed. Deleting: on its way out.
    assert reconcile([live("a", 1, phase)], [], NOW) == []


def test_a_runtime_of_another_generation_does_not_count_as_present() -> None:
    # The row is Ready at generation 3, the only runtime is generation 2 (a leftover).
    found = reconcile([live("a", 3, Phase.READY)], [runtime("a", 2)], NOW)
    assert sorted(kinds(found)) == [("orphan", "a", 2), ("vanished", "a", 3)]


def test_orphans_are_reported_as_snapshots() -> None:
    rows = [live("b", 5, Phase.READY), live("c", 4, Phase.STARTING)]
    runtimes = [
        runtime("a", 1),  # no row at all
        runtime("b", 5),  # current: fine
        runtime("b", 2, "exited", sandbox_id=OTHER),  # an older incarnation's leftover
        runtime("c", 3),  # older generation, but a launch (which removes it) is in flight
        runtime("c", 4),
    ]
    found = reconcile(rows, runtimes, NOW)
    assert kinds(found) == [("orphan", "a", 1), ("orphan", "b", 2)]
    snapshot = found[1]
    assert isinstance(snapshot, RuntimeSnapshot)
    assert (snapshot.state, snapshot.exit_code, snapshot.source) == ("exited", 143, "reconcile")
    assert snapshot.runtime_id == runtime("b", 2, sandbox_id=OTHER).runtime_id
    # Same listing, same ids: a repeated pass is recognisable.
    assert [o.observation_id for o in reconcile(rows, runtimes, NOW)] == [
        o.observation_id for o in found
    ]


def test_an_old_generation_of_a_settled_row_is_an_orphan() -> None:
    found = reconcile(
        [live("a", 3, Phase.STOPPED)], [runtime("a", 2), runtime("a", 3, "exited")], NOW
    )
    assert kinds(found) == [("orphan", "a", 2)]


def test_an_older_generation_still_running_under_its_row_is_stale() -> None:
    """Only an older generation of the row's own incarnation that has not exited, while the
    row is neither launching (its launch removes it) nor deleting, is handed to stop_stale."""
    rows = [
        live("stopped", 3, Phase.STOPPED),
        live("ready", 2, Phase.READY),
        live("starting", 2, Phase.STARTING),
        live("deleting", 2, Phase.DELETING),
        live("other", 2, Phase.STOPPED, sandbox_id=OTHER),
    ]
    runtimes = [
        runtime("stopped", 2),
        runtime("stopped", 1, "exited"),
        runtime("stopped", 3, "exited"),
        runtime("ready", 1, "created"),
        runtime("ready", 2),
        runtime("starting", 1),
        runtime("deleting", 1),
        runtime("other", 1),  # another incarnation: an orphan, not a stale generation
        runtime("gone", 1),  # no live row
    ]
    stale = stale_runtimes(rows, runtimes)
    assert [(r.key, r.generation) for r in stale] == [("stopped", 2), ("ready", 1)]


def test_a_current_generation_running_under_a_stopped_row_is_reported_and_handed_over() -> None:
    """Scenario 5 the other way round: the row says Stopped, yet its own generation runs (it
    was started behind sandstream's back, or a stop was lost). The pass reports it (a
    snapshot the processor records as ignored) and hands it to the executor to stop. One
    still stopping, one exited, and other phases are left alone."""
    rows = [
        live("s", 3, Phase.STOPPED),
        live("going", 2, Phase.STOPPED),
        live("done", 2, Phase.STOPPED),
        live("other", 2, Phase.STOPPED, sandbox_id=OTHER),
        live("ready", 2, Phase.READY),
        live("completed", 2, Phase.COMPLETED),
    ]
    runtimes = [
        runtime("s", 3),
        runtime("going", 2, "stopping"),
        runtime("done", 2, "exited"),
        runtime("other", 2),  # another incarnation: an orphan
        runtime("ready", 2),
        runtime("completed", 2),
    ]
    found = [o for o in reconcile(rows, runtimes, NOW) if o.key != "other"]
    [report] = found
    assert isinstance(report, RuntimeSnapshot)
    assert (report.key, report.generation, report.state, report.source) == (
        "s",
        3,
        "running",
        "reconcile",
    )
    assert report.observation_id == f"reconcile:stray:{runtime('s', 3).runtime_id}:running"
    assert [(r.key, r.generation) for r in stray_runtimes(rows, runtimes)] == [("s", 3)]


def test_an_exited_runtime_under_a_ready_row_is_reported_as_its_exit() -> None:
    """A Ready row's runtime runs: when the listing shows it exited, the watch lost or
    misordered its exit (Podman 4.3 replays old events after rotating its log). The pass
    reports the exit; other phases, generations and incarnations are left alone."""
    rows = [
        live("ready", 2, Phase.READY),
        live("older", 3, Phase.READY),
        live("other", 2, Phase.READY, sandbox_id=OTHER),
        live("running", 2, Phase.READY),
        *(live(p.value, 2, p) for p in (Phase.ERROR, Phase.COMPLETED, Phase.STOPPED)),
        live("stopping", 2, Phase.STOPPING),
        live("starting", 2, Phase.STARTING),
    ]
    runtimes = [
        runtime("ready", 2, "exited"),
        runtime("older", 3),
        runtime("older", 2, "exited"),  # an older generation's exit: no news
        runtime("other", 2, "exited", sandbox_id=SID),  # another incarnation: an orphan
        runtime("running", 2),
        *(runtime(p.value, 2, "exited") for p in (Phase.ERROR, Phase.COMPLETED, Phase.STOPPED)),
        runtime("stopping", 2, "exited"),
        runtime("starting", 2, "exited"),
    ]
    exits = [
        o for o in reconcile(rows, runtimes, NOW) if o.observation_id.startswith("reconcile:exited")
    ]
    [report] = exits
    assert isinstance(report, RuntimeSnapshot)
    assert (report.key, report.generation, report.state, report.exit_code, report.source) == (
        "ready", 2, "exited", 143, "reconcile"
    )  # fmt: skip
    assert report.observation_id == f"reconcile:exited:{runtime('ready', 2).runtime_id}:exited"
    assert reconcile(rows, runtimes, NOW).count(report) == 1
    assert report.occurred_at == NOW  # the backend gave no exit time


def test_a_reported_exit_carries_the_exit_time_not_the_pass_time() -> None:
    """The restart policy schedules from the exit's occurred_at and resets its back-off by the
    run's length: a missed exit found by a later pass must carry when it exited, whether it is
    the row's own runtime or an orphan (a pass that read the rows before the create and
    listed after the exit: found in a CI run); a backend clock ahead of ours is taken as now."""
    rows = [live("early", 2, Phase.READY), live("ahead", 2, Phase.READY)]
    exited_at = NOW - timedelta(seconds=25)
    runtimes = [
        runtime("early", 2, "exited", since=exited_at),
        runtime("ahead", 2, "exited", since=NOW + timedelta(seconds=5)),
        runtime("unread", 1, "exited", since=exited_at),  # its row came after the read
    ]
    at = {o.observation_id.split(":")[1] + " " + o.key: o.occurred_at
          for o in reconcile(rows, runtimes, NOW)}  # fmt: skip
    assert at == {"exited early": exited_at, "exited ahead": NOW, "orphan unread": exited_at}


# -- on the pipeline ------------------------------------------------------------------------------


class Unwatched:
    """A driver whose watch reports nothing; everything else is the driver's."""

    def __init__(self, driver: PodmanDriver) -> None:
        self._driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    async def watch(self) -> AsyncIterator[WatchObservation]:
        await asyncio.Event().wait()  # until the plane stops it
        yield  # type: ignore[misc]  # never reached: an async generator that yields nothing


async def test_a_container_removed_while_no_watcher_ran_is_found_by_the_reconcile_loop(
    podman: PodmanClient,
) -> None:
    async with podman_env(podman, "recon") as (env, driver, keys), await env.publisher() as pub:
        key = keys()
        async with running_plane(env, driver, reconcile_interval=3600):
            spec = sandbox_spec(env.settings, SLEEPER)
            await command(env, pub, f.create(key, sandbox_spec=spec))
            await wait_phase(env, key, "Ready")

        # Behind sandstream's back, while nothing of it runs: `podman rm -f`.
        [container] = containers_of(podman, key)
        await asyncio.to_thread(remove_now, podman, container["id"])

        # A new control plane whose watch reports nothing (a real one lists nothing of the
        # key, but Podman 4.3 may send the kill's events again when it rotates its event log,
        # and the watch would report that exit first: a stress run): the reconcile loop
        # notices the Ready row without a runtime.
        async with running_plane(env, Unwatched(driver), reconcile_interval=0.5):
            failed = await wait_phase(env, key, "Error")
            assert failed["reason"] == "runtime removed outside sandstream"
            removals = [
                (h["message"]["source"], h["message"]["actor"], h["disposition"])
                for h in await history(env, key)
                if h["message_type"] == "RuntimeRemoved"
            ]
            assert removals == [("reconcile", "reconciler", "applied")]

            # The reconciler only reported it; recovering is a user's command.
            await command(env, pub, f.delete(key))
            await wait_phase(env, key, "Deleted")
            assert volumes_of(podman, key) == []


async def test_a_replayed_start_lifts_nothing_and_the_reconcile_loop_undoes_ready_over_an_exit(
    podman: PodmanClient,
) -> None:
    """Found in a suite run: Podman 4.3 replays old events after rotating its event log, so
    the watch reported a sandbox's start again after its exit; the row went back to Ready over
    an exited container and stayed so (its restart policy never ran). A running dated before
    the exit now lifts nothing (tests/test_late_running.py). Whatever else shows the row Ready
    over an exited runtime (here a running dated after the exit, as a backend clock ahead of
    the exit's would), the reconcile loop reports the exit it sees in the listing: the row is
    Error again within a pass."""
    async with podman_env(podman, "replay") as (env, driver, keys), await env.publisher() as pub:
        key = keys()
        async with running_plane(env, driver, reconcile_interval=0.5, removing=keys):
            spec = sandbox_spec(env.settings, ["sh", "-c", "exit 3"])
            await command(env, pub, f.create(key, sandbox_spec=spec))
            exited = await wait_phase(env, key, "Error")
            assert exited["exit_code"] == 3
            [(start, raw)] = [
                (o, raw)
                for o, raw in await observations_of(env, key)
                if isinstance(o, RuntimeSnapshot) and o.state == "running" and o.source == "watch"
            ]
            placed = await produce_raw(env, [(key.encode(), raw)])  # the replay
            [replayed] = await wait_history_at(env, placed)
            assert (replayed["disposition"], replayed["phase"]) == ("ignored", "Error")
            assert replayed["reason"].startswith("late: ")

            lifted_at = datetime.now(UTC)
            newer = start.model_copy(update={"observation_id": "newer", "occurred_at": lifted_at})
            placed = await produce_raw(env, [(key.encode(), encode(newer))])
            [lifted] = await wait_history_at(env, placed)
            assert (lifted["disposition"], lifted["phase"]) == ("applied", "Ready")
            again = await wait_phase(env, key, "Error")
            assert (again["generation"], again["exit_code"]) == (1, 3)
            entries = await history(env, key)
            at = next(i for i, h in enumerate(entries) if h["offset"] == placed[0][1])
            message = [h["message"] for h in entries[at + 1 :]]
            after = [
                (m.get("source"), m.get("state"), h["disposition"], h["phase"])
                for m, h in zip(message, entries[at + 1 :], strict=True)
            ]
            assert after[0] == ("reconcile", "exited", "applied", "Error"), after
            # It carries the container's exit time, not the pass's: a listing's, which is whole
            # seconds, taken as the end of its second (drivers.podman_objects.latest_in_second).
            first_exit = next(h["message"] for h in entries if h["phase"] == "Error")
            exit_second = datetime.fromisoformat(first_exit["occurred_at"]).replace(microsecond=0)
            assert datetime.fromisoformat(message[0]["occurred_at"]) < exit_second + timedelta(
                seconds=1
            )


async def test_an_orphan_runtime_is_reported_and_recorded_but_never_removed(
    podman: PodmanClient,
) -> None:
    async with podman_env(podman, "orphan") as (env, driver, keys):
        orphan = keys()
        # Our labels, no row: e.g. left behind by a lost database or another install.
        await driver.launch(
            LaunchSpec(
                key=orphan,
                sandbox_id=uuid.uuid4(),
                generation=7,
                identity="rid-orphan",
                spec=sandbox_spec(env.settings, SLEEPER),
            )
        )
        async with running_plane(env, driver, reconcile_interval=0.3) as plane:
            reconciler = plane.reconciler
            assert reconciler is not None

            def from_reconciler(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
                return [r for r in rows if r["message"]["source"] == "reconcile"]

            rows = await eventually(
                lambda: history(env, orphan),
                lambda rows: len(from_reconciler(rows)) == 1,
                what="the orphan reported by the reconcile loop",
            )
            [reported] = from_reconciler(rows)
            assert reported["message_type"] == "RuntimeSnapshot"
            assert reported["message"]["generation"] == 7
            assert reported["disposition"] == "ignored"
            assert reported["reason"].startswith("unknown sandbox")
            # The watcher's listing of it was ignored the same way.
            assert {r["disposition"] for r in rows} == {"ignored"}

            # Two more passes: still there, still running, reported once only.
            passes = reconciler.passes
            await eventually(
                lambda: reconciler.passes,
                lambda n: n >= passes + 2,
                what="two more reconcile passes",
            )
            [container] = containers_of(podman, orphan)
            assert (container["name"], container["status"]) == (
                container_name(orphan, 7),
                "running",
            )
            assert len(from_reconciler(await history(env, orphan))) == 1


async def test_a_difference_is_reported_once_while_it_lasts_and_again_when_it_returns() -> None:
    """The reconciler remembers only the latest pass's differences: bounded memory, and a
    runtime that vanishes, comes back and vanishes again is news again."""
    async with isolated_env() as env:
        driver = FakeDriver()
        launch = LaunchSpec(key="gone", sandbox_id=SID, generation=1, identity="rid-1",
                            spec=sandbox_spec(env.settings, SLEEPER))  # fmt: skip
        await env.pool.execute(
            "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, "
            "providers, identity, created_at, updated_at, partition, change_seq) "
            "VALUES ('gone', $1, 'Ready', 1, 2, $2, '{}', 'rid-1', now(), now(), 0, 1)",
            SID,
            launch.spec.model_dump_json(),
        )
        producer = AIOKafkaProducer(**kafka_client_args(env.settings, "watcher"))
        await producer.start()
        try:
            reconciler = Reconciler(driver, env.pool, producer, env.settings, interval=3600)
            first = await reconciler.run_once()  # no runtime for a Ready row: vanished
            assert [o.type for o in first] == ["RuntimeRemoved"]
            assert await reconciler.run_once() == []  # still gone: not news
            await driver.launch(launch)
            assert await reconciler.run_once() == []  # back: nothing to report
            assert reconciler.reported == set()  # and nothing remembered
            await driver.delete("gone")
            again = await reconciler.run_once()  # gone again: news again
            assert [o.observation_id for o in again] == [o.observation_id for o in first]
        finally:
            await producer.stop()


async def test_a_difference_that_lasts_while_its_row_changed_is_reported_again() -> None:
    """Regression (a suite run): the reconciler remembered a difference by observation id
    alone. A Ready row's missing runtime was reported; the row went Error and, before the next
    pass, a running dated after it lifted it Ready again: the same difference, the same id, so
    it was never reported again and the row stayed Ready over nothing. A row's new version
    makes it news again; the same version does not."""
    async with isolated_env() as env:
        spec = sandbox_spec(env.settings, SLEEPER)
        await env.pool.execute(
            "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, "
            "providers, identity, created_at, updated_at, partition, change_seq) "
            "VALUES ('gone', $1, 'Ready', 1, 2, $2, '{}', 'rid-1', now(), now(), 0, 1)",
            SID,
            spec.model_dump_json(),
        )
        producer = AIOKafkaProducer(**kafka_client_args(env.settings, "watcher"))
        await producer.start()
        try:
            reconciler = Reconciler(FakeDriver(), env.pool, producer, env.settings, interval=3600)
            first = await reconciler.run_once()
            assert [o.type for o in first] == ["RuntimeRemoved"]
            assert await reconciler.run_once() == []  # the same row: not news
            # Decided Error, then lifted Ready (versions 3 and 4), both between two passes.
            await env.pool.execute("UPDATE sandboxes SET version = 4 WHERE key = 'gone'")
            again = await reconciler.run_once()
            assert [o.observation_id for o in again] == [o.observation_id for o in first]
            assert await reconciler.run_once() == []
        finally:
            await producer.stop()


async def test_a_runtime_started_behind_a_stopped_row_is_reported_and_stopped_again(
    podman: PodmanClient,
) -> None:
    async with podman_env(podman, "stray") as (env, driver, keys), await env.publisher() as pub:
        key = keys()
        async with running_plane(env, driver, reconcile_interval=0.3):
            spec = sandbox_spec(env.settings, SLEEPER)
            await command(env, pub, f.create(key, sandbox_spec=spec))
            await wait_phase(env, key, "Ready")
            await command(env, pub, f.stop(key))
            stopped = await wait_phase(env, key, "Stopped")

            # Behind sandstream's back: `podman start` of the stopped sandbox's container.
            [container] = containers_of(podman, key)
            await asyncio.to_thread(lambda: podman.containers.get(container["id"]).start())

            # The reconcile loop reports it and the executor stops it again.
            rows = await eventually(
                lambda: history(env, key),
                lambda rows: any(
                    r["message"].get("observation_id", "").startswith("reconcile:stray:")
                    for r in rows
                ),
                what="the runtime running under a Stopped row reported",
            )
            # The loop may report it more than once before the stop lands; each is ignored.
            reports = [r for r in rows if r["message"].get("source") == "reconcile"]
            assert reports
            assert {(r["message_type"], r["disposition"]) for r in reports} == {
                ("RuntimeSnapshot", "ignored")
            }
            await eventually(
                lambda: asyncio.to_thread(containers_of, podman, key),
                lambda found: [c["status"] for c in found] == ["exited"],
                what="the runtime stopped again",
            )
            row = await wait_phase(env, key, "Stopped")
            assert (row["generation"], row["version"]) == (
                stopped["generation"],
                stopped["version"],
            )
