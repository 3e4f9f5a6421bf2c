"""Podman 4.3's event stream sends the newer half of its event log again each time it rotates
the log (``events_logfile_max_size``, 1 MB by default): a watch saw a sandbox's start again
after its exit, and the row went back to Ready over an exited container (a suite run; the
reconcile loop's side is in tests/test_reconcile.py). The watch reports each event once.

On a Podman service of the test's own, on the same storage, whose event log rotates at 4 KiB:
sandboxes that start and exit at once are reported created, running, exited and removed, each
at most once and in that order, across several rotations. (Not all four: a container's exit is
written to the log of the first Podman process that notices it, another test's service when it
lists the container first, and Podman 4.3 can drop an event at a rotation; the reconcile loop
covers a lost exit or removal.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from harness import eventually
from podman import PodmanClient

from drivers.podman import PodmanDriver
from drivers.protocol import LaunchSpec, RuntimeInfo, WatchObservation
from events.common import SandboxSpec
from events.observations import RuntimeRemoved
from services.common.settings import PROJECT_ROOT, Settings

LOGGER = 'events_logger = "file"'


@contextlib.asynccontextmanager
async def podman_rotating_its_event_log() -> AsyncIterator[tuple[str, Path]]:
    """The URL of a Podman service with the local stack's settings whose event log rotates
    at 4 KiB, and that log's path."""
    home = Path(tempfile.mkdtemp(prefix="sspm", dir="/tmp"))  # a short socket path
    conf = (PROJECT_ROOT / "compose" / "podman" / "containers.conf").read_text()
    assert LOGGER in conf
    log = home / "events.log"
    small = f'{LOGGER}\nevents_logfile_path = "{log}"\nevents_logfile_max_size = "4k"'
    (home / "containers.conf").write_text(conf.replace(LOGGER, small))
    url = f"unix://{home / 'podman.sock'}"
    service = _serve(url, home)
    try:
        with PodmanClient(base_url=url, timeout=10) as client:
            await eventually(lambda: _pings(client), bool, what="the test's Podman service")
        yield url, log
    finally:
        service.terminate()
        await asyncio.to_thread(service.wait, 30)
        shutil.rmtree(home, ignore_errors=True)


def _serve(url: str, home: Path) -> subprocess.Popen[bytes]:
    with (home / "service.log").open("wb") as out:
        return subprocess.Popen(
            ["podman", "system", "service", "--time=0", url],
            env={**os.environ, "CONTAINERS_CONF": str(home / "containers.conf")},
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _pings(client: PodmanClient) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


ONCE = ["created", "running", "exited", "removed"]


async def caught_up(
    driver: PodmanDriver, seen: list[WatchObservation], image: str, keys: list[str]
) -> None:
    """Return once the watch has read past everything before: it reported the creation of a
    marker sandbox made now. Podman 4.3 can also drop an event at a rotation, so a marker not
    seen within seconds is followed by another. Each marker's key goes into ``keys``."""
    for _ in range(5):
        keys.append(marker := f"rotation-mark-{uuid.uuid4().hex[:8]}")
        spec = SandboxSpec(image=image, command=["sleep", "60"])
        await driver.launch(LaunchSpec(marker, uuid.uuid4(), 1, "rid-mark", spec))
        with contextlib.suppress(AssertionError):
            await eventually(lambda: states(seen, marker), bool, timeout=5, what="a marker")
            return
    raise AssertionError("the watch saw none of the markers")


def _exited(runtimes: list[RuntimeInfo]) -> bool:
    return [r.state for r in runtimes] == ["exited"]


def states(seen: list[WatchObservation], key: str) -> list[str]:
    return [
        "removed" if isinstance(o, RuntimeRemoved) else o.state
        for o in seen
        if o.key == key and o.source == "watch"
    ]


async def test_the_events_podman_sends_again_after_rotating_its_log_are_reported_once(
    settings: Settings,
) -> None:
    async with podman_rotating_its_event_log() as (url, log):
        driver = PodmanDriver(url, stop_timeout=1)
        seen: list[WatchObservation] = []

        async def watch() -> None:
            async for observation in driver.watch():
                seen.append(observation)

        watching = asyncio.create_task(watch())
        keys = [f"rotation-{uuid.uuid4().hex[:8]}" for _ in range(6)]
        try:
            await eventually(lambda: driver.connected_watchers, bool, what="the event stream")
            for key in keys:
                spec = SandboxSpec(image=settings.sandbox_image, command=["true"])
                await driver.launch(LaunchSpec(key, uuid.uuid4(), 1, f"rid-{key}", spec))
                await eventually(lambda k=key: driver.get(k), _exited, what=f"{key} exited")  # type: ignore[misc]
                await driver.delete(key)
            await caught_up(driver, seen, settings.sandbox_image, keys)
            assert '"log-rotation"' in log.read_text()  # the log did rotate meanwhile
            ids = [o.observation_id for o in seen if o.source == "watch"]
            assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
            for key in keys:  # once each, in order (some may be missing: see above)
                assert states(seen, key) == [s for s in ONCE if s in states(seen, key)], key
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            for key in keys:
                with contextlib.suppress(Exception):
                    await driver.delete(key)
            await driver.close()
