"""The Podman driver against the real Podman API service of the local stack (no mocks).

These tests fail (never skip) when the service or the sandbox image is missing: run
`make stack` (or `.venv/bin/python -m services.localstack.stack up`) first. Every test uses its own
sandbox names and removes what it created.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import factories as f
import harness
import pytest
from pipeline_support import IGNORE_TERM, trap_set
from podman import PodmanClient
from podman.errors import APIError

from drivers.labels import runtime_labels
from drivers.podman import (
    DEFAULT_LIMITS,
    PodmanDriver,
    container_name,
    remove_volume,
    volume_name,
)
from drivers.podman_events import observation_from_event, snapshot_from_list
from drivers.podman_objects import read_container
from drivers.protocol import (
    IDENTITY_ENV,
    LABEL_GENERATION,
    LABEL_KEY,
    LABEL_MANAGED_BY,
    LABEL_STOP_TIMEOUT,
    Driver,
    DriverError,
    LaunchSpec,
    RuntimeInfo,
    WatchObservation,
)
from events.common import Phase, SandboxResources, SandboxSpec
from events.observations import RuntimeRemoved, RuntimeSnapshot
from services.common.settings import PROJECT_ROOT, Settings
from services.executor.reconcile import LiveRow, reconcile, stray_runtimes

STOP_TIMEOUT = 10.0
WAIT = 20.0  # deadline of every wait on the backend
# A grace period no test waits out: a stop given it ends only when the runtime is killed.
LONG_GRACE = 600


# -- helpers ------------------------------------------------------------------------------------


async def eventually(
    probe: Callable[[], Any], check: Callable[[Any], bool], what: str, timeout: float = WAIT
) -> Any:
    return await harness.eventually(probe, check, timeout=timeout, what=what)


class Watcher:
    """Runs ``driver.watch()`` in a task and keeps everything it yields.

    Create it with ``await Watcher.started(driver)``: it returns once the event stream is
    open, so every later change of the backend is seen as an event.
    """

    def __init__(self, driver: PodmanDriver) -> None:
        self.seen: list[WatchObservation] = []
        self._task = asyncio.create_task(self._run(driver))

    @classmethod
    async def started(cls, driver: PodmanDriver) -> Watcher:
        before = driver.connected_watchers
        watcher = cls(driver)
        await eventually(lambda: driver.connected_watchers, lambda n: n > before, "event stream")
        return watcher

    async def _run(self, driver: PodmanDriver) -> None:
        async for observation in driver.watch():
            self.seen.append(observation)

    def of(self, key: str) -> list[WatchObservation]:
        return [o for o in self.seen if o.key == key]

    async def wait_for(
        self, predicate: Callable[[WatchObservation], bool], what: str, start: int = 0
    ) -> WatchObservation:
        """The first observation from index ``start`` on that matches, within the deadline."""

        def probe() -> list[WatchObservation]:
            if self._task.done():
                self._task.result()  # surface the watcher's crash
                raise AssertionError("the watcher ended")
            return [o for o in self.seen[start:] if predicate(o)]

        found: list[WatchObservation] = await eventually(probe, bool, what)
        return found[0]

    async def wait_snapshot(
        self, key: str, generation: int, state: str, source: str = "watch", start: int = 0
    ) -> RuntimeSnapshot:
        found = await self.wait_for(
            snapshot(key, generation, state, source), f"{key} g{generation} {state}", start
        )
        assert isinstance(found, RuntimeSnapshot)
        return found

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def snapshot(key: str, generation: int, state: str, source: str = "watch") -> Any:
    def match(o: WatchObservation) -> bool:
        return isinstance(o, RuntimeSnapshot) and (o.key, o.generation, o.state, o.source) == (
            key,
            generation,
            state,
            source,
        )

    return match


def removed(key: str, generation: int) -> Any:
    def match(o: WatchObservation) -> bool:
        return isinstance(o, RuntimeRemoved) and (o.key, o.generation) == (key, generation)

    return match


def spec_for(
    settings: Settings,
    key: str,
    generation: int,
    command: list[str],
    sandbox_id: uuid.UUID | None = None,
) -> LaunchSpec:
    return LaunchSpec(
        key=key,
        sandbox_id=sandbox_id or uuid.uuid5(uuid.NAMESPACE_DNS, key),
        generation=generation,
        identity=f"rid-{key}-{generation}",
        spec=SandboxSpec(image=settings.sandbox_image, command=command, env={"GREETING": "hi"}),
    )


SLEEPER = ["sh", "-c", "echo hi > /workspace/f; sleep 3600"]


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
async def driver(settings: Settings, podman: PodmanClient) -> AsyncIterator[PodmanDriver]:
    drv = PodmanDriver(settings.podman_url, stop_timeout=STOP_TIMEOUT)
    yield drv
    await drv.close()


@pytest.fixture
async def keys(driver: PodmanDriver) -> AsyncIterator[Callable[[], str]]:
    """Fresh sandbox names; everything of them is killed and deleted afterwards (killed
    first: a delete waits out the grace period, which may be LONG_GRACE)."""
    made: list[str] = []

    def new_key() -> str:
        made.append(f"drv-{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield new_key
    failures = []
    for key in made:
        try:
            for runtime in await driver.get(key):
                if runtime.state in ("running", "stopping"):
                    await driver.kill(key, runtime.generation)
            await driver.delete(key)
        except DriverError as exc:
            failures.append(f"{key}: {exc}")
    assert not failures, f"cleanup failed: {failures}"


def containers_of(podman: PodmanClient, key: str) -> list[str]:
    found = podman.containers.list(all=True, filters=[f"label={LABEL_KEY}={key}"])
    return sorted(c.name for c in found)


def volumes_of(podman: PodmanClient, key: str) -> list[str]:
    # One label filter: Podman 4.3 ORs several on volumes.
    return sorted(v.name for v in podman.volumes.list(filters=[f"label={LABEL_KEY}={key}"]))


# -- the tests ----------------------------------------------------------------------------------


def test_podman_driver_implements_the_protocol(driver: PodmanDriver) -> None:
    assert isinstance(driver, Driver)


async def test_sandbox_lifecycle_launch_stop_relaunch_delete(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    watcher = await Watcher.started(driver)
    try:
        # launch generation 1: running, labelled, with the identity in env and label
        spec1 = spec_for(settings, key, 1, SLEEPER)
        launched_at = datetime.now(UTC).replace(microsecond=0)  # Podman's times: to the second
        result = await driver.launch(spec1)
        assert result.started and result.generation == 1 and result.identity == spec1.identity
        [info] = await eventually(lambda: driver.get(key), lambda r: len(r) == 1, "gen 1 listed")
        # Since when it runs: its start, as Podman recorded it.
        assert info.since is not None and launched_at <= info.since <= datetime.now(UTC)
        assert info == RuntimeInfo(
            since=info.since,
            key=key,
            sandbox_id=spec1.sandbox_id,
            generation=1,
            state="running",
            exit_code=None,
            runtime_id=result.runtime_id,
            identity=spec1.identity,
        )
        assert info in await driver.list()
        assert containers_of(podman, key) == [container_name(key, 1)]
        code, out = await driver.exec(key, 1, ["sh", "-c", f"echo ${IDENTITY_ENV} $GREETING"])
        assert (code, out.strip()) == (0, f"{spec1.identity} hi")

        created = await watcher.wait_for(snapshot(key, 1, "created"), "created gen 1")
        running = await watcher.wait_for(snapshot(key, 1, "running"), "running gen 1")
        assert created.runtime_id == running.runtime_id == result.runtime_id
        assert running.actor == "podman-watcher" and running.occurred_at.tzinfo is not None

        # launching the same generation again changes nothing
        again = await driver.launch(spec1)
        assert (again.runtime_id, again.started) == (result.runtime_id, False)
        assert containers_of(podman, key) == [container_name(key, 1)]

        # stop: with an init process SIGTERM ends it, no SIGKILL after the stop timeout
        stopped = await driver.stop(key, 1)
        assert stopped.outcome == "succeeded" and stopped.runtime_id == result.runtime_id
        exited = await watcher.wait_snapshot(key, 1, "exited")
        # catatonit: 128 + SIGTERM (a SIGKILL once the stop timeout ran out would give 137)
        assert exited.exit_code == stopped.exit_code == 143
        [info] = await driver.get(key)
        assert (info.state, info.exit_code) == ("exited", 143)
        assert (await driver.stop(key, 1)).outcome == "succeeded"  # already stopped

        # generation 2 on the same workspace; generation 1 is removed first
        mark = len(watcher.seen)
        spec2 = spec_for(settings, key, 2, ["sh", "-c", "sleep 3600"])
        result2 = await driver.launch(spec2)
        assert result2.started and result2.runtime_id != result.runtime_id
        assert await driver.exec(key, 2, ["cat", "/workspace/f"]) == (0, "hi\n")
        assert [(i.generation, i.state) for i in await driver.get(key)] == [(2, "running")]
        assert containers_of(podman, key) == [container_name(key, 2)]
        assert volumes_of(podman, key) == [volume_name(key, spec1.sandbox_id)]
        await watcher.wait_for(removed(key, 1), "gen 1 removed", start=mark)
        await watcher.wait_for(snapshot(key, 2, "created"), "created gen 2", start=mark)
        await watcher.wait_for(snapshot(key, 2, "running"), "running gen 2", start=mark)

        # delete: runtimes and workspace gone, observed as removed; a second delete finds nothing
        mark = len(watcher.seen)
        assert await driver.delete(key) is True
        assert containers_of(podman, key) == [] and volumes_of(podman, key) == []
        assert await driver.get(key) == []
        await watcher.wait_for(removed(key, 2), "gen 2 removed", start=mark)
        assert await driver.delete(key) is False
        assert (await driver.stop(key, 2)).outcome == "already_absent"
    finally:
        await watcher.stop()


async def test_a_slow_stop_of_one_sandbox_does_not_delay_another(
    driver: PodmanDriver, settings: Settings, podman: PodmanClient, keys: Callable[[], str]
) -> None:
    """A runtime that ignores SIGTERM keeps its delete waiting out the grace period (600 s
    here); the driver serves other sandboxes meanwhile. Cancelling the caller does not cancel
    Podman's stop: the key stays taken until it ends, so the next delete waits for it."""
    stubborn, other = keys(), keys()
    await launch_stubborn(driver, stubborn_spec(settings, stubborn, 1, stop_timeout=LONG_GRACE))
    slow_delete = asyncio.create_task(driver.delete(stubborn))
    await eventually(
        lambda: podman.containers.get(container_name(stubborn, 1)).attrs["State"]["Status"],
        lambda status: status == "stopping",
        "the stubborn sandbox to be stopping",
    )
    await driver.launch(spec_for(settings, other, 1, SLEEPER))
    assert (await driver.stop(other, 1)).exit_code == 143
    assert not slow_delete.done()  # the other sandbox was served meanwhile

    slow_delete.cancel()
    next_delete = asyncio.create_task(driver.delete(stubborn))  # queued behind the first one
    # Only a kill ends the stop under way (kill is not queued behind it); the first delete's
    # thread then removes everything, so the queued delete finds nothing left. Had the
    # cancellation released the key, it would have found the stopping runtime (True).
    assert (await asyncio.wait_for(driver.kill(stubborn, 1), WAIT)).outcome == "succeeded"
    assert await asyncio.wait_for(next_delete, WAIT) is False
    assert containers_of(podman, stubborn) == []


def test_a_container_removed_while_its_exit_code_is_read_has_none(
    driver: PodmanDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the slow-stop test above in CI: its kill ended the stop, the first delete's
    thread removed the container at once, and the kill's read of the exit code met Podman 4.3's
    500 "no such container" (not a 404): the kill failed. A stand-in client answers as Podman
    did then (the race itself cannot be timed); any other error still raises."""
    gone = "container 0123 does not exist in database: no such container"
    calls = driver._sync

    def answering(error: str) -> Any:
        def get(_: str) -> Any:
            raise APIError(error, explanation=error)

        return lambda: SimpleNamespace(containers=SimpleNamespace(get=get))

    monkeypatch.setattr(calls, "client", answering(gone))
    assert calls.exit_code("0123") is None
    monkeypatch.setattr(calls, "client", answering("something else went wrong"))
    with pytest.raises(APIError):
        calls.exit_code("0123")


async def test_a_repeated_launch_never_starts_a_stopped_generation_again(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings
) -> None:
    key = keys()
    spec = spec_for(settings, key, 1, SLEEPER)
    first = await driver.launch(spec)
    await driver.stop(key, 1, timeout=5)
    [stopped] = await driver.get(key)
    assert stopped.state == "exited"
    with pytest.raises(DriverError) as failure:
        await driver.launch(spec)  # a redelivered launch after the stop
    assert not failure.value.retryable and failure.value.observed == "exited"
    assert "never starts it again" in failure.value.reason
    assert await driver.get(key) == [stopped]
    assert stopped.runtime_id == first.runtime_id


async def test_limits_and_confinement_are_applied(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    limited = SandboxSpec(
        image=settings.sandbox_image,
        command=["sh", "-c", "sleep 3600"],
        resources=SandboxResources(memory_mib=64, cpu_millicores=250, pids=40),
    )
    await driver.launch(LaunchSpec(key, uuid.uuid4(), 1, "id-1", limited))
    host = podman.containers.get(container_name(key, 1)).attrs["HostConfig"]
    assert (host["Memory"], host["PidsLimit"]) == (64 * 1024 * 1024, 40)
    assert host["CpuQuota"] * 1000 // host["CpuPeriod"] == 250
    assert host["ReadonlyRootfs"] is True
    assert "no-new-privileges" in host["SecurityOpt"]
    assert {"Name": "RLIMIT_CORE", "Soft": 0, "Hard": 0} in host["Ulimits"]
    # From inside: no capabilities, a read-only root, a writable workspace and /tmp, no cores.
    probe = "grep CapEff /proc/self/status; ulimit -c; touch /root/x 2>&1; "
    probe += "touch /workspace/w /tmp/t && echo writable"
    _, out = await driver.exec(key, 1, ["sh", "-c", probe])
    assert "CapEff:\t0000000000000000" in out, out
    assert "\n0\n" in out and "Read-only file system" in out and "writable" in out, out

    # Without resources: the driver's defaults; read_only_root=False keeps the root writable.
    plain_key = keys()
    plain = SandboxSpec(
        image=settings.sandbox_image, command=["sleep", "3600"], read_only_root=False
    )
    await driver.launch(LaunchSpec(plain_key, uuid.uuid4(), 1, "id-2", plain))
    host = podman.containers.get(container_name(plain_key, 1)).attrs["HostConfig"]
    assert host["Memory"] == DEFAULT_LIMITS.memory_mib * 1024 * 1024  # type: ignore[operator]
    assert host["PidsLimit"] == DEFAULT_LIMITS.pids
    assert host["ReadonlyRootfs"] is False
    assert (await driver.exec(plain_key, 1, ["touch", "/root/x"]))[0] == 0


async def test_launch_of_an_older_generation_is_superseded(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings
) -> None:
    key = keys()
    await driver.launch(spec_for(settings, key, 3, SLEEPER))
    with pytest.raises(DriverError) as failure:
        await driver.launch(spec_for(settings, key, 2, SLEEPER))
    assert not failure.value.retryable and failure.value.observed == "running"
    assert "superseded" in failure.value.reason
    assert [i.generation for i in await driver.get(key)] == [3]


async def test_stop_and_delete_of_unknown_sandboxes(
    driver: PodmanDriver, keys: Callable[[], str]
) -> None:
    key = keys()
    assert (await driver.stop(key, 1)).outcome == "already_absent"
    assert await driver.delete(key) is False
    assert await driver.get(key) == []


async def test_missing_image_fails_without_retry(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings
) -> None:
    key = keys()
    spec = spec_for(settings, key, 1, SLEEPER)
    bad = LaunchSpec(
        spec.key, spec.sandbox_id, 1, spec.identity, SandboxSpec(image="localhost/no-such:0")
    )
    with pytest.raises(DriverError) as failure:
        await driver.launch(bad)
    assert not failure.value.retryable and "image not known" in failure.value.reason
    assert failure.value.observed == "absent"


async def test_runtime_that_ends_on_its_own_reports_its_exit_code(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings
) -> None:
    key = keys()
    watcher = await Watcher.started(driver)
    try:
        await driver.launch(spec_for(settings, key, 1, ["sh", "-c", "exit 3"]))
        died = await watcher.wait_snapshot(key, 1, "exited")
        assert died.exit_code == 3
        [info] = await driver.get(key)
        assert (info.state, info.exit_code) == ("exited", 3)
        # A command that does not exist: with catatonit as PID 1 the start succeeds and the
        # runtime then exits 1 ("catatonit: failed to exec pid1"), not 127, no start error.
        key2 = keys()
        await driver.launch(spec_for(settings, key2, 1, ["no-such-command"]))
        died = await watcher.wait_snapshot(key2, 1, "exited")
        assert died.exit_code == 1
    finally:
        await watcher.stop()


async def test_delete_of_an_old_incarnation_keeps_the_new_one(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    old, new = uuid.uuid4(), uuid.uuid4()
    await driver.launch(spec_for(settings, key, 1, SLEEPER, sandbox_id=old))
    await driver.launch(spec_for(settings, key, 2, ["sleep", "3600"], sandbox_id=new))
    assert volumes_of(podman, key) == sorted([volume_name(key, old), volume_name(key, new)])
    assert await driver.delete(key, sandbox_id=old) is True  # only the old workspace is left
    assert volumes_of(podman, key) == [volume_name(key, new)]
    assert [(i.generation, i.state) for i in await driver.get(key)] == [(2, "running")]
    assert await driver.exec(key, 2, ["ls", "/workspace"]) == (0, "")  # a fresh workspace


async def test_delete_touches_only_its_own_sandbox(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """Regression: Podman 4.3 ORs label filters on volumes; a delete must not follow it."""
    doomed, bystander = keys(), keys()
    await driver.launch(spec_for(settings, doomed, 1, SLEEPER))
    await driver.stop(doomed, 1)  # its volume would be free to remove
    spec = spec_for(settings, bystander, 1, SLEEPER)
    await driver.launch(spec)
    await driver.stop(bystander, 1)  # ... and so would this one
    assert await driver.delete(doomed) is True
    assert volumes_of(podman, bystander) == [volume_name(bystander, spec.sandbox_id)]
    assert containers_of(podman, bystander) == [container_name(bystander, 1)]


async def test_unmanaged_containers_are_ignored(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key, stranger_key = keys(), keys()
    watcher = await Watcher.started(driver)
    # Our labels except managed-by: it must not be mistaken for a sandbox.
    stranger = podman.containers.create(
        settings.sandbox_image,
        command=["sleep", "3600"],
        name=f"stranger-{stranger_key}",
        labels={LABEL_KEY: stranger_key, LABEL_GENERATION: "1"},
        init=True,
    )
    try:
        await asyncio.to_thread(stranger.start)
        # The stranger's events precede ours in the stream: once ours is seen, so were they.
        await driver.launch(spec_for(settings, key, 1, SLEEPER))
        await watcher.wait_for(snapshot(key, 1, "running"), "our sandbox running")
        assert watcher.of(stranger_key) == []
        assert all(i.key != stranger_key for i in await driver.list())
        assert await driver.get(stranger_key) == []
        # A fresh watcher's listing skips it too.
        fresh = await Watcher.started(driver)
        try:
            await fresh.wait_for(snapshot(key, 1, "running", "list"), "listing of ours")
            assert fresh.of(stranger_key) == []
        finally:
            await fresh.stop()
    finally:
        await watcher.stop()
        await asyncio.to_thread(stranger.remove, force=True)


async def test_watcher_lists_again_after_a_reconnect(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings
) -> None:
    key = keys()
    result = await driver.launch(spec_for(settings, key, 1, SLEEPER))
    watcher = await Watcher.started(driver)
    try:
        listed = await watcher.wait_for(snapshot(key, 1, "running", "list"), "first listing")
        assert listed.runtime_id == result.runtime_id
        mark = len(watcher.seen)
        driver.reconnect_watchers()
        relisted = await watcher.wait_for(
            snapshot(key, 1, "running", "list"), "listing after reconnect", start=mark
        )
        # The same unchanged runtime: the same observation id, recognisable as a duplicate.
        assert relisted.observation_id == listed.observation_id
        # ... and the new event stream works.
        mark = len(watcher.seen)
        await driver.stop(key, 1)
        await watcher.wait_for(snapshot(key, 1, "exited"), "exit after reconnect", start=mark)
    finally:
        await watcher.stop()


async def test_a_watch_that_cannot_reach_podman_logs_the_outage_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the watch logged a warning at every reconnect attempt, one every few
    seconds for as long as Podman was away. Now an outage's first failure is a warning and the
    later ones are debug lines (events/backoff.py)."""
    caplog.set_level(logging.DEBUG, logger="sandstream.drivers.podman")
    away = PodmanDriver(f"unix://{tmp_path}/no-podman.sock", reconnect_delay=0.001,
                        max_reconnect_delay=0.001)  # fmt: skip
    watcher = Watcher(away)

    def failures() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith("podman watch: cannot")]

    try:
        await eventually(failures, lambda found: len(found) >= 4, "four failed connects")
    finally:
        await watcher.stop()
        await away.close()
    levels = [r.levelno for r in failures()]
    assert levels[0] == logging.WARNING and set(levels[1:]) == {logging.DEBUG}, levels


# -- event mapping, on events as Podman 4.3 sends them -------------------------------------------


def _event(action: str, labels: dict[str, str], exit_code: str = "0") -> dict[str, Any]:
    cid = "0f6f9a53fe4e245ecc8ee63591529deba04922003b6d2c5f5718823dc6506345"
    attributes = {"containerExitCode": exit_code, "image": "localhost/x:1", "name": "n", **labels}
    return {
        "status": action,
        "id": cid,
        "from": "localhost/x:1",
        "Type": "container",
        "Action": action,
        "Actor": {"ID": cid, "Attributes": attributes},
        "scope": "local",
        "time": 1795973588,
        "timeNano": 1795973588034922508,
    }


OURS = {LABEL_MANAGED_BY: "sandstream", LABEL_KEY: "box-1", LABEL_GENERATION: "4"}


def test_event_mapping() -> None:
    died = observation_from_event(_event("died", OURS, "143"))
    assert isinstance(died, RuntimeSnapshot)
    assert (died.key, died.generation, died.state, died.exit_code) == ("box-1", 4, "exited", 143)
    assert died.occurred_at.isoformat() == "2026-11-29T17:33:08.034922+00:00"
    again = observation_from_event(_event("died", OURS, "143"))
    assert again is not None and again.observation_id == died.observation_id  # deterministic
    no_code = _event("died", OURS)
    del no_code["Actor"]["Attributes"]["containerExitCode"]
    lacking = observation_from_event(no_code)  # the watcher then inspects the container
    assert isinstance(lacking, RuntimeSnapshot) and lacking.exit_code is None
    start = observation_from_event(_event("start", OURS))
    assert isinstance(start, RuntimeSnapshot) and start.exit_code is None
    assert isinstance(observation_from_event(_event("remove", OURS)), RuntimeRemoved)
    for ignored in ("init", "cleanup", "kill", "stop", "exec", "exec_died", "attach"):
        assert observation_from_event(_event(ignored, OURS)) is None
    assert observation_from_event(_event("start", {LABEL_KEY: "box-1"})) is None
    bad_generation = {**OURS, LABEL_GENERATION: "zero"}
    assert observation_from_event(_event("start", bad_generation)) is None


# -- per-sandbox stop timeout ---------------------------------------------------------------------


def stubborn_spec(
    settings: Settings, key: str, generation: int, stop_timeout: int | None
) -> LaunchSpec:
    spec = spec_for(settings, key, generation, IGNORE_TERM)
    return LaunchSpec(
        spec.key,
        spec.sandbox_id,
        generation,
        spec.identity,
        spec.spec.model_copy(update={"stop_timeout_seconds": stop_timeout}),
    )


async def launch_stubborn(driver: PodmanDriver, spec: LaunchSpec) -> None:
    """Launch, then wait until its shell ignores SIGTERM: a stop sent earlier would be quick."""
    await driver.launch(spec)
    await trap_set(driver, spec.key, spec.generation)


def status_of(podman: PodmanClient, key: str, generation: int) -> str:
    return str(podman.containers.get(container_name(key, generation)).attrs["State"]["Status"])


async def test_a_sandbox_stop_timeout_is_used_by_stop_and_delete(
    keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """The spec's stop_timeout_seconds is the container's StopTimeout and a label; stop and
    delete without an explicit timeout use it, not the driver's default; an explicit timeout
    wins over both. The deadlines are no measurement: the grace period that must not be used
    is 600 s, the one that must be, at most 1 s."""
    driver = PodmanDriver(settings.podman_url, stop_timeout=LONG_GRACE)
    try:
        key = keys()
        await launch_stubborn(driver, stubborn_spec(settings, key, 1, stop_timeout=1))
        attrs = podman.containers.get(container_name(key, 1)).attrs
        assert attrs["Config"]["StopTimeout"] == 1
        assert attrs["Config"]["Labels"][LABEL_STOP_TIMEOUT] == "1"

        stopped = await asyncio.wait_for(driver.stop(key, 1), WAIT)
        assert stopped.exit_code == 137  # SIGTERM ignored (even under catatonit): killed

        # A new generation (a fresh container: the marker of the stopped one would be stale).
        await launch_stubborn(driver, stubborn_spec(settings, key, 2, stop_timeout=1))
        assert await asyncio.wait_for(driver.delete(key), WAIT) is True

        # An explicit timeout still wins over the sandbox's own.
        key2 = keys()
        await launch_stubborn(driver, stubborn_spec(settings, key2, 1, stop_timeout=LONG_GRACE))
        stopped = await asyncio.wait_for(driver.stop(key2, 1, timeout=0), WAIT)
        assert stopped.exit_code == 137
    finally:
        await driver.close()


async def test_without_a_sandbox_stop_timeout_the_driver_default_applies(
    keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """No stop_timeout_seconds: the container's StopTimeout is the driver's default, and a
    delete waits it out. Shown as an order of events: a stop with a 1 s grace, begun after
    that delete, ends (killed) while the delete is still waiting."""
    driver = PodmanDriver(settings.podman_url, stop_timeout=LONG_GRACE)
    try:
        key, quick = keys(), keys()
        await launch_stubborn(driver, stubborn_spec(settings, key, 1, stop_timeout=None))
        await launch_stubborn(driver, stubborn_spec(settings, quick, 1, stop_timeout=1))
        attrs = podman.containers.get(container_name(key, 1)).attrs
        assert attrs["Config"]["StopTimeout"] == LONG_GRACE
        assert LABEL_STOP_TIMEOUT not in attrs["Config"]["Labels"]

        deleting = asyncio.create_task(driver.delete(key))
        await eventually(
            lambda: status_of(podman, key, 1), lambda s: s == "stopping", "the delete's stop"
        )
        assert (await asyncio.wait_for(driver.stop(quick, 1), WAIT)).exit_code == 137
        assert not deleting.done() and status_of(podman, key, 1) == "stopping"

        await driver.kill(key, 1)  # instead of waiting out the 600 s
        assert await asyncio.wait_for(deleting, WAIT) is True
    finally:
        await driver.close()


# -- closing ----------------------------------------------------------------------------------

# A process that closes its driver while a stop of ``key`` waits out its grace period, then
# ends. It reads a line from stdin once the test has seen the stop under way.
EXIT_WHILE_STOPPING = """
import asyncio, sys
from drivers.podman import PodmanDriver

async def main(url: str, key: str) -> None:
    driver = PodmanDriver(url)
    stopping = asyncio.ensure_future(driver.stop(key, 1))
    await asyncio.to_thread(sys.stdin.readline)
    await driver.close()
    stopping.cancel()

asyncio.run(main(*sys.argv[1:]))
"""


async def test_closing_the_driver_leaves_no_stop_holding_up_the_exit(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """Regression: the driver's calls ran in ThreadPoolExecutors, whose threads the
    interpreter joins at exit, so a process that closed its driver while a stop waited out a
    long grace period did not end until Podman answered (pytest hung at exit for minutes after
    the tests that abandon such stops). Now the process ends while the stop is under way."""
    key = keys()
    await launch_stubborn(driver, stubborn_spec(settings, key, 1, stop_timeout=LONG_GRACE))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", EXIT_WHILE_STOPPING, settings.podman_url, key,
        stdin=asyncio.subprocess.PIPE, cwd=PROJECT_ROOT,
    )  # fmt: skip
    try:
        await eventually(
            lambda: status_of(podman, key, 1), lambda s: s == "stopping", "the stop under way"
        )
        assert process.stdin is not None
        process.stdin.write(b"close\n")
        await process.stdin.drain()
        # A deadline, not a measurement: the old code ended only with the 600 s grace.
        assert await asyncio.wait_for(process.wait(), WAIT) == 0
        assert status_of(podman, key, 1) == "stopping"  # the process ended first
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await driver.kill(key, 1)  # ends the stop (the cleanup's delete would wait it out)


def test_a_spec_cannot_forge_our_labels() -> None:
    spec = LaunchSpec(
        key="box",
        sandbox_id=uuid.uuid4(),
        generation=2,
        identity="rid",
        spec=SandboxSpec(
            image="x",
            labels={
                "team": "a",
                LABEL_STOP_TIMEOUT: "0",
                LABEL_MANAGED_BY: "someone-else",
                "io.sandstream.other": "y",
            },
        ),
    )
    labels = runtime_labels(spec)
    assert labels["team"] == "a" and labels[LABEL_MANAGED_BY] == "sandstream"
    assert LABEL_STOP_TIMEOUT not in labels and "io.sandstream.other" not in labels
    with_timeout = LaunchSpec(
        spec.key,
        spec.sandbox_id,
        2,
        "rid",
        spec.spec.model_copy(update={"stop_timeout_seconds": 7}),
    )
    assert runtime_labels(with_timeout)[LABEL_STOP_TIMEOUT] == "7"


# -- forced kill ---------------------------------------------------------------------------------


async def test_kill_forces_a_stop_under_way(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """A stop waiting out a 600 s grace period on an entrypoint that ignores SIGTERM ends as
    soon as the runtime is killed: kill is not queued behind it."""
    key = keys()
    await launch_stubborn(driver, stubborn_spec(settings, key, 1, stop_timeout=LONG_GRACE))
    stopping = asyncio.create_task(driver.stop(key, 1))
    await eventually(
        lambda: podman.containers.get(container_name(key, 1)).attrs["State"]["Status"],
        lambda status: status == "stopping",
        what="the stop to be under way",
    )
    killed = await asyncio.wait_for(driver.kill(key, 1), WAIT)
    assert killed.outcome == "succeeded"
    stopped = await asyncio.wait_for(stopping, WAIT)  # not the 600 s grace period
    assert stopped.outcome == "succeeded" and stopped.exit_code == 137
    assert containers_of(podman, key) == [container_name(key, 1)]  # kept, as a stop keeps it
    assert (await driver.kill(key, 1)).outcome == "succeeded"  # no longer running
    assert (await driver.kill(keys(), 1)).outcome == "already_absent"


def test_a_volume_gone_already_counts_as_removed(podman: PodmanClient) -> None:
    """Real Podman answers a missing volume with 404; a volume removed by someone else between
    its lookup and its removal with 500 "no such volume" (two deletes racing, seen in a run).
    Both count as removed; any other refusal is raised."""
    remove_volume(podman, f"sandstream-never-made-{uuid.uuid4().hex[:8]}")

    class Refusing:
        def __init__(self, message: str) -> None:
            self.message = message

        def remove(self, name: str, force: bool = False) -> None:
            raise APIError(self.message)

    raced = "no volume with name v found in database: no such volume"
    remove_volume(SimpleNamespace(volumes=Refusing(raced)), "v")  # type: ignore[arg-type]
    with pytest.raises(APIError, match="volume is being used"):
        remove_volume(SimpleNamespace(volumes=Refusing("volume is being used")), "v")  # type: ignore[arg-type]


# -- Podman's "stopping" state --------------------------------------------------------------------


def stopping_attrs(key: str, generation: int, *, inspect: bool) -> dict[str, Any]:
    """A container in Podman's "stopping" state, as Podman 4.3 shows it in an inspect answer
    (State a dict) or a list item (State a string): only the fields the driver reads."""
    spec = LaunchSpec(key, uuid.uuid4(), generation, "rid", SandboxSpec(image="x"))
    cid = "58c7b72ab2b4382ef270703e2f2271014f93a0c62ccf58d0ffa5875666585eaa"
    if inspect:
        return {
            "Id": cid, "Name": container_name(key, generation),
            "Created": "2026-12-03T19:53:39.9Z", "Config": {"Labels": runtime_labels(spec)},
            "State": {"Status": "stopping", "Running": False, "ExitCode": 0,
                      "StartedAt": "2026-12-03T19:53:40.265968909Z",
                      "FinishedAt": "0001-01-01T00:00:00Z"},
        }  # fmt: skip
    return {
        "Id": cid, "Names": [container_name(key, generation)], "Created": 1796327619,
        "Labels": runtime_labels(spec), "State": "stopping", "ExitCode": 0,
        "StartedAt": 1796327620, "ExitedAt": -62135596800,
    }  # fmt: skip


def test_podmans_stopping_state_maps_to_a_stopping_runtime_that_lifts_no_row() -> None:
    """Regression: Podman's "stopping" (a stop sent its signal and waits out the grace period)
    was mapped to running, so a listing of a sandbox in Error whose stop was under way (e.g.
    the cleanup stop of a timed-out launch) lifted the row to Ready. It is a stopping runtime,
    in an inspect answer and a list item alike, and its snapshot changes no phase."""
    for inspect in (True, False):
        container = read_container(stopping_attrs(f.KEY, 1, inspect=inspect))
        assert container is not None
        assert (container.info.state, container.info.exit_code) == ("stopping", None)
        assert container.since is not None  # its start (a list item has whole seconds)
        assert container.since.replace(microsecond=0) == datetime(
            2026, 12, 3, 19, 53, 40, tzinfo=UTC
        )
    for phase in (Phase.ERROR, Phase.READY, Phase.STOPPING, Phase.STOPPED, Phase.PROVISIONING):
        h = f.harness_in(phase)
        generation = h.row().generation
        container = read_container(stopping_attrs(f.KEY, generation, inspect=False))
        assert container is not None
        listed = snapshot_from_list(container)
        assert listed.state == "stopping" and ":stopping:" in listed.observation_id
        assert h.send(listed).disposition == "ignored", phase
        assert h.row().phase is phase


async def test_a_container_stopping_behind_sandstreams_back_is_reported_stopping_never_running(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """Regression: while `podman stop --time 60` (from outside sandstream) waits out its grace
    period on an entrypoint that ignores SIGTERM, Podman shows the container as "stopping";
    the driver reported it as running. Now the inspect answer, get, list, the reconcile pass
    (an orphan's report; under a Stopped row, no stray to stop again) and the watcher's
    listing all report it stopping; exec_stream refuses it. A stop with no grace period still
    ends it (SIGKILL)."""
    key = keys()
    spec = stubborn_spec(settings, key, 1, stop_timeout=None)
    await launch_stubborn(driver, spec)
    name = container_name(key, 1)
    outside = await asyncio.create_subprocess_exec(
        "podman", "--url", settings.podman_url, "stop", "--time", "60", name,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    watcher: Watcher | None = None
    try:
        await eventually(
            lambda: status_of(podman, key, 1), lambda s: s == "stopping", "podman stop under way"
        )
        inspected = read_container(
            await asyncio.to_thread(lambda: podman.containers.get(name).attrs)
        )
        [got] = await driver.get(key)
        listed = [info for info in await driver.list() if info.key == key]
        [orphan] = reconcile([], listed, datetime.now(UTC))
        assert isinstance(orphan, RuntimeSnapshot)
        watcher = await Watcher.started(driver)
        seen = await watcher.wait_for(
            lambda o: o.key == key and o.source == "list", "the watcher's listing of it"
        )
        assert isinstance(seen, RuntimeSnapshot)
        reported = {
            "inspect": inspected.info.state if inspected else None,
            "get": got.state,
            "list": [info.state for info in listed],
            "reconcile orphan": orphan.state,
            "watch listing": seen.state,
        }
        assert reported == {
            "inspect": "stopping",
            "get": "stopping",
            "list": ["stopping"],
            "reconcile orphan": "stopping",
            "watch listing": "stopping",
        }
        stopped_row = LiveRow(key, spec.sandbox_id, 1, Phase.STOPPED, version=1)
        assert stray_runtimes([stopped_row], listed) == []  # on its way out: no second stop
        assert reconcile([stopped_row], listed, datetime.now(UTC)) == []
        with pytest.raises(DriverError, match="no running runtime"):
            async for _ in driver.exec_stream(key, 1, ["true"]):
                pass
        assert status_of(podman, key, 1) == "stopping"  # all of the above seen while stopping

        # The driver's own stop of a stopping container is still sent, and ends it.
        stopped = await asyncio.wait_for(driver.stop(key, 1, timeout=0), WAIT)
        assert (stopped.outcome, stopped.exit_code) == ("succeeded", 137)
        assert (await watcher.wait_snapshot(key, 1, "exited")).exit_code == 137
        assert not [o for o in watcher.of(key) if isinstance(o, RuntimeSnapshot)
                    and o.state == "running"]  # fmt: skip
        assert await asyncio.wait_for(outside.wait(), WAIT) == 0
    finally:
        if watcher is not None:
            await watcher.stop()
        if outside.returncode is None:
            outside.kill()
            await outside.wait()


async def test_a_paused_container_is_reported_stopping_never_running(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """Regression: Podman's "paused" (`podman pause`: the agent frozen) was read as running, so
    a listing of a paused sandbox in Error lifted the row to Ready. Now the inspect answer,
    get, list, the watcher's pause event and its listing report it stopping (a process that
    runs nothing), which lifts no row; exec refuses it; unpausing it is seen as running again;
    a stop of a paused container ends it (Podman refuses to stop one: it failed before)."""
    key = keys()
    await driver.launch(spec_for(settings, key, 1, ["sleep", "600"]))
    name = container_name(key, 1)
    watcher = await Watcher.started(driver)
    try:
        await asyncio.to_thread(lambda: podman.containers.get(name).pause())
        assert status_of(podman, key, 1) == "paused"
        inspected = read_container(
            await asyncio.to_thread(lambda: podman.containers.get(name).attrs)
        )
        [got] = await driver.get(key)
        listed = [info.state for info in await driver.list() if info.key == key]
        paused = await watcher.wait_snapshot(key, 1, "stopping")
        reported = {
            "inspect": inspected.info.state if inspected else None,
            "get": got.state,
            "list": listed,
            "watch event": paused.state,
        }
        assert reported == {
            "inspect": "stopping",
            "get": "stopping",
            "list": ["stopping"],
            "watch event": "stopping",
        }
        container = read_container(
            await asyncio.to_thread(lambda: podman.containers.get(name).attrs)
        )
        assert container is not None
        for phase in (Phase.ERROR, Phase.STARTING):
            h = f.harness_in(phase)
            generation = h.row().generation
            seen = snapshot_from_list(container).model_copy(update={"generation": generation})
            assert h.send(seen).disposition == "ignored", phase
            assert h.row().phase is phase
        with pytest.raises(DriverError, match="no running runtime"):
            async for _ in driver.exec_stream(key, 1, ["true"]):
                pass
        start = len(watcher.seen)
        await asyncio.to_thread(lambda: podman.containers.get(name).unpause())
        await watcher.wait_snapshot(key, 1, "running", start=start)
        await asyncio.to_thread(lambda: podman.containers.get(name).pause())
        await watcher.wait_snapshot(key, 1, "stopping", start=start)
        stopped = await asyncio.wait_for(driver.stop(key, 1, timeout=0), WAIT)  # Podman refuses
        assert stopped.outcome == "succeeded"  # to stop a paused container: it is thawed first
        assert status_of(podman, key, 1) == "exited"
    finally:
        await watcher.stop()
