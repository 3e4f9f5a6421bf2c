"""Idle suspend on the real stack: Kafka, PostgreSQL, the scheduler, real Podman, both doors.

The doors record use (``services/common/usage.py``), the scheduler reads it and puts it on the
log, the fold decides (``projections/lifecycle/idle.py``). One test runs at the default flush
interval (10 s); the others scale it to 1 s through the setting ``use_flush_seconds`` and set
idle timeouts of a few seconds. The scaled run takes the same path: no code branches on either
value (the recorder flushes every interval whatever it is, the scheduler's query adds it as a
number, the fold compares times), so only how long the test waits changes.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import apikit
import grpc
import pytest
import pytest_asyncio
from apikit import Api, create_body, unique
from harness import eventually
from openshell_support import auth
from pipeline_support import history, wait_phase
from pydantic import SecretStr
from test_idle_after_outage import FLUSH as FLUSH_DEFAULT
from test_idle_after_outage import ready_on_a_plane

from drivers.fake import FakeDriver
from drivers.podman import PodmanDriver
from events.codec import OBSERVATIONS, decode
from events.observations import DeadlineDue
from events.publisher import now
from services.common.settings import Settings
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.openshell_pb2_grpc import OpenShellStub
from services.openshell.server import RunningOpenShell, start_openshell
from services.scheduler.scheduler import Scheduler

FLUSH = 1.0  # the scaled flush interval (default 10 s)
AGENT = ["sleep", "3600"]


async def row(api: Api, name: str) -> dict[str, Any]:
    async with api.client() as c:
        r = await c.get(f"/v1/sandboxes/{name}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def phase_is(
    api: Api, name: str, phases: tuple[str, ...], timeout: float = 60
) -> dict[str, Any]:
    return dict(
        await eventually(
            lambda: row(api, name),
            lambda v: v["phase"] in phases,
            what=f"{name} in {phases}",
            timeout=timeout,
            interval=0.2,
        )
    )


async def ready(api: Api, settings: Settings, name: str, idle: int) -> dict[str, Any]:
    body = create_body(name, image=settings.sandbox_image, command=AGENT, idle_suspend_seconds=idle)
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
    return await phase_is(api, name, ("Ready",))


def at(value: str) -> datetime:
    return datetime.fromisoformat(value)


async def stays_ready_while(api: Api, name: str, work: asyncio.Future[Any]) -> Any:
    """Poll the row until ``work`` ends, failing as soon as it is not Ready; ``work``'s
    result."""
    while not work.done():
        assert (await row(api, name))["phase"] == "Ready"
        await asyncio.wait([work], timeout=0.3)
    assert (await row(api, name))["phase"] == "Ready"
    return work.result()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def podman_driver(settings: Settings) -> AsyncIterator[PodmanDriver]:
    driver = PodmanDriver(settings.podman_url, stop_timeout=2)
    try:
        yield driver
    finally:
        await driver.close()


def _key() -> SecretStr:
    return SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())


async def _openshell(api: Api, driver: PodmanDriver) -> RunningOpenShell:
    """OpenShell's door beside the API, sharing its gateway and its record of use (as `up`)."""
    state = api.app.state.api
    served = api.env.settings.model_copy(update={"openshell_port": 0})
    return await start_openshell(
        served, pool=api.env.pool, gateway=state.gateway, tokens=apikit.tokens(), driver=driver,
        use=state.use, limits=state.exec_limits,
    )  # fmt: skip


@asynccontextmanager
async def _stack(
    driver: PodmanDriver, *, scheduler: bool, **update: Any
) -> AsyncIterator[tuple[Api, RunningOpenShell]]:
    update = {"credentials_key": _key(), **update}
    async with apikit.running_api(driver, settings_update=update, with_scheduler=scheduler) as api:
        door = await _openshell(api, driver)
        try:
            yield api, door
        finally:
            await door.stop(0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def scaled(podman_driver: PodmanDriver) -> AsyncIterator[tuple[Api, RunningOpenShell]]:
    """The flush interval scaled to FLUSH; the scheduler polls every second."""
    async with _stack(
        podman_driver, scheduler=True, use_flush_seconds=FLUSH, scheduler_poll_seconds=1.0
    ) as stack:
        yield stack


@asynccontextmanager
async def sandbox(api: Api, settings: Settings, prefix: str, idle: int) -> AsyncIterator[str]:
    """A Ready sandbox on Podman with idle timeout ``idle``; deleted at the end."""
    name = unique(prefix)
    await ready(api, settings, name, idle)
    try:
        yield name
    finally:
        async with api.client() as c:
            await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})

            async def status() -> int:
                return int((await c.get(f"/v1/sandboxes/{name}")).status_code)

            await eventually(status, lambda code: code == 404, what="deleted", timeout=60)


def idle_inputs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        h for h in entries
        if h["message_type"] == "DeadlineDue" and h["message"]["deadline"] == "idle"
    ]  # fmt: skip


def suspended_by_idle(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [h for h in idle_inputs(entries) if h["disposition"] == "applied"]


async def exec_http(api: Api, name: str, command: list[str]) -> dict[str, Any]:
    async with api.client() as c:
        r = await c.post(f"/v1/sandboxes/{name}/exec", json={"command": command})
    assert r.status_code == 200, r.text
    return dict(r.json())


async def exec_openshell(door: RunningOpenShell, sandbox_id: str, command: list[str]) -> bytes:
    """The command's stdout through OpenShell's ExecSandbox; its exit code must be 0."""
    async with grpc.aio.insecure_channel(door.address) as channel:
        request = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=command)
        events = [
            e
            async for e in OpenShellStub(channel).ExecSandbox(request, metadata=auth(apikit.ADMIN))
        ]
    assert events[-1].exit.exit_code == 0, events
    return b"".join(e.stdout.data for e in events if e.HasField("stdout"))


# -- at the default flush interval ------------------------------------------------------------


async def test_an_idle_sandbox_is_suspended_at_the_default_flush_interval_and_an_exec_wakes_it(
    podman_driver: PodmanDriver, settings: Settings
) -> None:
    idle = 5
    flush = Settings().use_flush_seconds
    assert flush == 10.0  # the default this test runs at
    async with (
        _stack(podman_driver, scheduler=True) as (api, _),
        sandbox(api, settings, "idle", idle) as name,
    ):
        await exec_http(api, name, ["sh", "-c", "echo kept > /workspace/f"])  # a use
        gone = await phase_is(api, name, ("Suspending", "Suspended"), timeout=idle + 3 * flush + 30)
        assert gone["generation"] == 1 and gone["reason"].startswith("IdleSuspend: no use since")
        [applied] = suspended_by_idle(await history(api.env, name))
        message = applied["message"]
        assert message["last_used_at"] is not None  # the exec was recorded, and counted
        since = max(at(message["last_used_at"]), at(gone["created_at"]))
        waited = (at(message["occurred_at"]) - since).total_seconds()
        # Not before the timeout plus one flush; within one more flush and the poll after it.
        assert idle + flush <= waited <= idle + 2 * flush + settings.scheduler_poll_seconds + 5
        await phase_is(api, name, ("Suspended",))
        out = await exec_http(api, name, ["cat", "/workspace/f"])  # wakes it, then runs
        assert (out["exit_code"], out["stdout"]) == (0, "kept\n")
        woken = await row(api, name)
        assert (woken["phase"], woken["generation"]) == ("Ready", 2)


async def test_an_exec_begun_after_the_timeout_but_before_the_next_scan_is_not_cut_off(
    podman_driver: PodmanDriver, settings: Settings
) -> None:
    """Regression: a use waited for the next flush, but the scheduler may find a sandbox idle
    at any moment past its timeout plus one flush (its slack covers only uses before the
    timeout), so an exec begun in between was killed by a suspend decided on the old record.
    A session now writes its use when it begins. The scheduler is driven by hand here: its
    scan comes right after the exec began, within the flush interval (default, 10 s)."""
    idle, flush = 1, Settings().use_flush_seconds
    async with (
        _stack(podman_driver, scheduler=False) as (api, _),
        sandbox(api, settings, "late", idle) as name,
    ):
        ready_at = at((await row(api, name))["updated_at"])

        async def idle_for() -> float:
            return (datetime.now(ready_at.tzinfo) - ready_at).total_seconds()

        await eventually(idle_for, lambda s: s >= idle + flush + 0.5, timeout=flush + 10,
                         what="idle past its timeout and one flush")  # fmt: skip
        command = ["sh", "-c", "echo on > /tmp/begun; sleep 8; echo done"]
        work = asyncio.ensure_future(exec_http(api, name, command))

        async def begun() -> int:  # read through the driver: no door, no use
            return (await podman_driver.exec(name, 1, ["cat", "/tmp/begun"]))[0]

        await eventually(begun, lambda code: code == 0, what="the exec running")
        scheduler = Scheduler(api.env.settings, api.env.pool)
        await scheduler.start()
        try:
            assert await scheduler.round() == 0  # the exec's use is on record: not idle
        finally:
            await scheduler.stop()
        result = await stays_ready_while(api, name, work)
        assert (result["exit_code"], result["stdout"]) == (0, "done\n")


# -- scaled: use_flush_seconds = FLUSH ---------------------------------------------------------


async def test_use_through_the_doors_keeps_it_awake_and_it_suspends_once_unused(
    scaled: tuple[Api, RunningOpenShell], settings: Settings
) -> None:
    api, _ = scaled
    idle = 3
    async with sandbox(api, settings, "used", idle) as name, api.client() as c:

        async def use(seconds: float) -> int:
            """A files call or a read of logs every half second, for ``seconds``."""
            calls, end = 0, time.monotonic() + seconds
            while time.monotonic() < end:
                path = f"/v1/sandboxes/{name}/" + ("logs" if calls % 2 else "files?path=/workspace")
                r = await c.get(path)
                assert r.status_code == 200, r.text
                calls += 1
                await asyncio.sleep(0.5)  # the pace of the use, not a synchronisation
            return calls

        calls = await stays_ready_while(api, name, asyncio.ensure_future(use(4 * idle)))
        assert calls >= 8
        assert suspended_by_idle(await history(api.env, name)) == []
        unused = time.monotonic()
        await phase_is(api, name, ("Suspending", "Suspended"), timeout=idle + 3 * FLUSH + 20)
        assert time.monotonic() - unused >= idle  # it had been unused for the whole timeout


@pytest.mark.parametrize("door", ["http", "openshell"])
async def test_an_exec_running_longer_than_the_timeout_keeps_it_awake(
    scaled: tuple[Api, RunningOpenShell], settings: Settings, door: str
) -> None:
    api, openshell = scaled
    idle = 2
    async with sandbox(api, settings, f"busy-{door}", idle) as name:
        sandbox_id = (await row(api, name))["id"]
        command = ["sh", "-c", f"sleep {4 * idle}; echo done"]
        work = asyncio.ensure_future(
            exec_http(api, name, command)
            if door == "http"
            else exec_openshell(openshell, sandbox_id, command)
        )
        started = time.monotonic()
        result = await stays_ready_while(api, name, work)
        assert time.monotonic() - started >= 4 * idle
        assert (result["stdout"] if door == "http" else result.decode()) == "done\n"
        assert suspended_by_idle(await history(api.env, name)) == []
        # The timeout was live all along: unused now, it is suspended.
        await phase_is(api, name, ("Suspending", "Suspended"), timeout=idle + 3 * FLUSH + 20)


async def test_an_upload_lasting_longer_than_the_timeout_keeps_it_awake(
    scaled: tuple[Api, RunningOpenShell], settings: Settings
) -> None:
    api, _ = scaled
    scheduler = api.plane.scheduler  # type: ignore[union-attr]
    assert scheduler is not None
    idle, piece = 2, b"x" * 1024
    # A piece after each of the scheduler's reads of the use, which come a flush interval
    # apart at least: the upload outlasts four timeouts, and the reads past the first timeout
    # would find the sandbox idle were the upload not keeping it in use.
    pieces = int(4 * idle / FLUSH) + 2
    async with sandbox(api, settings, "upload", idle) as name, api.client() as c:

        async def slow() -> AsyncIterator[bytes]:
            for _ in range(pieces):
                yield piece
                scans = scheduler.idle_scans
                await eventually(lambda: scheduler.idle_scans, lambda n, seen=scans: n > seen,
                                 timeout=30, what="the scheduler's next idle scan")  # fmt: skip

        upload = c.put(
            f"/v1/sandboxes/{name}/files/content",
            params={"path": "/workspace/slow.bin"},
            content=slow(),
            headers={"Content-Length": str(pieces * len(piece))},
        )
        started = time.monotonic()
        r = await stays_ready_while(api, name, asyncio.ensure_future(upload))
        assert time.monotonic() - started >= 4 * idle
        assert r.status_code == 201, r.text
        assert r.json()["size"] == pieces * len(piece)
        assert suspended_by_idle(await history(api.env, name)) == []
        # The timeout was live all along: unused now, it is suspended.
        await phase_is(api, name, ("Suspending", "Suspended"), timeout=idle + 3 * FLUSH + 20)


async def test_a_held_sandbox_is_not_idle_suspended_and_counts_anew_from_its_release(
    scaled: tuple[Api, RunningOpenShell], settings: Settings
) -> None:
    api, _ = scaled
    idle = 1
    async with sandbox(api, settings, "held", idle) as name, api.client() as c:
        r = await c.post(f"/v1/sandboxes/{name}:hold", json={"reason": "look"}, params={"wait": 30})
        assert r.status_code == 200, r.text
        watched_until = time.monotonic() + idle + 4 * FLUSH + 2  # several idle scans
        while time.monotonic() < watched_until:
            assert (await row(api, name))["phase"] == "Ready"
            await asyncio.sleep(0.3)  # the pace of the watch, not a synchronisation
        assert idle_inputs(await history(api.env, name)) == []  # the scheduler skips it
        r = await c.post(f"/v1/sandboxes/{name}:release", params={"wait": 30})
        assert r.status_code == 200, r.text
        released = at((await row(api, name))["updated_at"])
        await phase_is(api, name, ("Suspending", "Suspended"), timeout=idle + 3 * FLUSH + 20)
        [applied] = suspended_by_idle(await history(api.env, name))
        assert at(applied["message"]["occurred_at"]) >= released + timedelta(seconds=idle)


async def test_openshell_exec_wakes_an_idle_suspended_sandbox(
    scaled: tuple[Api, RunningOpenShell], settings: Settings
) -> None:
    api, openshell = scaled
    async with sandbox(api, settings, "oswake", 1) as name:
        sandbox_id = (await row(api, name))["id"]
        await exec_openshell(openshell, sandbox_id, ["sh", "-c", "echo kept > /workspace/f"])
        await phase_is(api, name, ("Suspended",), timeout=1 + 3 * FLUSH + 30)
        # ExecSandbox resumes it and runs once it is Ready (a use: it stays awake a while).
        assert await exec_openshell(openshell, sandbox_id, ["cat", "/workspace/f"]) == b"kept\n"
        woken = await row(api, name)
        assert (woken["phase"], woken["generation"]) == ("Ready", 2)


async def test_an_openshell_exec_refused_for_the_tokens_session_limit_wakes_nothing(
    scaled: tuple[Api, RunningOpenShell], settings: Settings
) -> None:
    api, openshell = scaled
    async with sandbox(api, settings, "osrefused", 1) as name:
        suspended = await phase_is(api, name, ("Suspended",), timeout=1 + 3 * FLUSH + 30)
        limits = api.app.state.api.exec_limits  # shared by both doors, as under `up`
        with ExitStack() as sessions:  # the token's sessions all open elsewhere
            for _ in range(limits.per_token):
                sessions.enter_context(limits.session("admin"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await exec_openshell(openshell, suspended["id"], ["true"])
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await row(api, name) == suspended
        entries = await history(api.env, name)
        assert "ResumeSandbox" not in [h["message_type"] for h in entries]


async def test_set_idle_suspend_over_http_changes_the_timeout_and_clears_it(
    scaled: tuple[Api, RunningOpenShell], settings: Settings
) -> None:
    api, _ = scaled
    async with sandbox(api, settings, "setidle", 3600) as name, api.client() as c:
        path = f"/v1/sandboxes/{name}:idle-suspend"
        r = await c.post(path, json={"idle_suspend_seconds": 0})
        assert r.status_code == 422 and "idle_suspend_seconds" in r.text, r.text
        version = (await row(api, name))["version"]
        body = {"idle_suspend_seconds": None, "expected_version": version}
        r = await c.post(path, json=body, params={"wait": 30})
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
        assert "idle_suspend_seconds" not in (await row(api, name))["spec"]
        r = await c.post(path, json={"idle_suspend_seconds": 1}, params={"wait": 30})
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
        await phase_is(api, name, ("Suspending", "Suspended"), timeout=1 + 3 * FLUSH + 20)


# -- the scheduler killed and started again ----------------------------------------------------


async def test_a_killed_scheduler_started_again_does_not_suspend_twice(
    podman_driver: PodmanDriver, settings: Settings
) -> None:
    """The scheduler's restart sends what it finds due again; the fold acts once."""
    idle = 1
    async with (
        _stack(podman_driver, scheduler=False, use_flush_seconds=FLUSH) as (api, _),
        sandbox(api, settings, "twice", idle) as name,
    ):
        env = api.env
        first = Scheduler(env.settings, env.pool)
        await first.start()
        try:
            await eventually(first.round, lambda sent: sent > 0, timeout=idle + 3 * FLUSH + 10,
                             interval=0.2, what="the idle deadline published")  # fmt: skip
        finally:
            await first.stop()  # killed: what it sent is known only to the log
        [record] = [
            r for r in await env.read_topic(env.settings.topic_observations)
            if r.key == name.encode() and b'"idle"' in (r.value or b"")
        ]  # fmt: skip
        # Its successor started before the fold acted sends the same message again.
        await env.produce(env.settings.topic_observations, [(record.key, record.value)],
                          role="scheduler")  # fmt: skip
        entries = await eventually(lambda: history(env, name), lambda h: len(idle_inputs(h)) == 2,
                                   what="both decided", timeout=30)  # fmt: skip
        assert len(suspended_by_idle(entries)) == 1
        types = await env.fetch("SELECT event_types FROM history WHERE key = $1", name)
        assert sum(list(t["event_types"]).count("SandboxSuspending") for t in types) == 1
        await phase_is(api, name, ("Suspended",))
        second = Scheduler(env.settings, env.pool)
        await second.start()
        try:
            assert await second.round() == 0  # started after the fold acted: nothing due
        finally:
            await second.stop()


# -- the scheduler's idle message, composed before a wait on Kafka ------------------------------


async def test_an_idle_message_whose_read_of_use_went_stale_is_not_sent() -> None:
    """The scheduler's idle message carries the use it read; publishes before it that waited
    on Kafka longer than a flush interval (an outage) leave that read stale, and a use since
    (an exec begun meanwhile) would not have saved the sandbox. Old code sent it all the same
    (and kept sending it until Kafka took it); now the next scan reads the use again. The
    clock is the scheduler's own setting: a first round two flush intervals before the scan
    (a scheduler holds its first idle scan that long), then the scan's round, then the moment
    of the publish, two flush intervals on."""
    flush = FLUSH_DEFAULT
    async with ready_on_a_plane("idle", 1) as env:
        scan = now() + timedelta(hours=1)  # long idle by then
        readings = iter([scan - 2 * flush, scan])
        scheduler = Scheduler(
            env.settings, env.pool, clock=lambda: next(readings, scan + 2 * flush)
        )
        await scheduler.start()
        try:
            await scheduler.round()
            assert scheduler.idle_scans == 0
            await scheduler.round()
            assert (scheduler.idle_scans, scheduler.published) == (1, 0)
            inputs = [
                decode(OBSERVATIONS, r.value)
                for r in await env.read_topic(env.settings.topic_observations)
            ]
            assert [m for m in inputs if isinstance(m, DeadlineDue)] == []
            # The next scan, on a read of use made then, sends it and the fold suspends.
            scheduler.clock = lambda: scan + 3 * flush
            await scheduler.round()
            assert scheduler.published == 1
        finally:
            await scheduler.stop()
        await wait_phase(env, "idle", "Suspended", timeout=60)


async def test_the_recorded_use_of_a_deleted_sandbox_is_forgotten_by_the_schedulers_scan(
    settings: Settings,
) -> None:
    """The doors' record of a deleted sandbox goes at the scheduler's next idle scan, a use
    recorded just after the delete too; a live sandbox's stays."""
    update = {"use_flush_seconds": FLUSH}
    async with apikit.running_api(FakeDriver(), settings_update=update, with_scheduler=True) as api:
        gone, kept = unique("ugone"), unique("ukept")
        async with api.client() as c:
            for name in (gone, kept):
                body = create_body(name, idle_suspend_seconds=3600)
                r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
                assert r.status_code == 201, r.text
            use = api.app.state.api.use
            use.touch(gone)
            use.touch(kept)
            assert await use.flush() == 2
            await c.delete(f"/v1/sandboxes/{gone}", params={"wait": 30})
            await eventually(
                lambda: c.get(f"/v1/sandboxes/{gone}"),
                lambda r: r.status_code == 404,
                what="deleted",
                timeout=30,
            )
            use.touch(gone)  # a door's use recorded after the delete
            assert await use.flush() == 1

        async def recorded() -> set[str]:
            rows = await api.env.fetch(
                "SELECT key FROM sandbox_use WHERE key = ANY($1)", [gone, kept]
            )
            return {r["key"] for r in rows}

        assert await eventually(recorded, lambda keys: gone not in keys, timeout=30) == {kept}
