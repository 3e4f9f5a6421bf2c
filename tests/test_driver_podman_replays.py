"""Podman 4.3 sends the newer half of its event log again after rotating it, events from before
the watch began among them: a runtime's start, sent again after its exit, made the watch report
an exited runtime running (a suite run met it). The watch now drops a start it already knows of,
from its listing or an event; a start well after that one (by hand) is still reported.

On the real Podman of the local stack: the runtime, its listing and the watch are real; the
start sent again is put on the watch's own event stream as Podman sends it (a rotation cannot be
caused here without rotating every other watch's log too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from podman import PodmanClient
from test_driver_podman import SLEEPER, Watcher, driver, keys, snapshot, spec_for

from drivers.podman import PodmanDriver, container_name
from drivers.podman_events import SAME_START, known_start
from drivers.podman_objects import parse_time
from events.observations import RuntimeSnapshot
from services.common.settings import Settings

__all__ = ["driver", "keys"]  # the fixtures, from the driver's own tests


def _nanos(at: datetime) -> int:
    return int(at.timestamp()) * 1_000_000_000 + at.microsecond * 1000


def _event(action: str, attrs: dict[str, Any], at: datetime) -> dict[str, Any]:
    """A container event as Podman 4.3 sends it on the stream."""
    cid = attrs["Id"]
    labels = attrs["Config"]["Labels"]
    attributes = {"containerExitCode": "0", "image": attrs["ImageName"], **labels}
    return {"status": action, "id": cid, "from": attrs["ImageName"], "Type": "container",
            "Action": action, "Actor": {"ID": cid, "Attributes": attributes}, "scope": "local",
            "time": int(at.timestamp()), "timeNano": _nanos(at)}  # fmt: skip


async def test_a_start_sent_again_after_the_exit_is_not_reported_but_a_later_start_is(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    await driver.launch(spec_for(settings, key, 1, SLEEPER))
    watcher = await Watcher.started(driver)
    try:
        await watcher.wait_snapshot(key, 1, "running", source="list")
        await asyncio.wait_for(driver.stop(key, 1, timeout=0), 30)
        await watcher.wait_snapshot(key, 1, "exited")
        attrs = await asyncio.to_thread(lambda: podman.containers.get(container_name(key, 1)).attrs)
        started = parse_time(attrs["State"]["StartedAt"])
        assert started is not None
        [stream] = list(driver._streams)

        # Its start sent again (Podman stamps it a few milliseconds after StartedAt), then an
        # exit stamped later, which shows when the watch has read past the start.
        stream._put(_event("start", attrs, started + timedelta(milliseconds=3)))
        marker = started + timedelta(milliseconds=500)
        stream._put(_event("died", attrs, marker))
        await watcher.wait_for(lambda o: o.key == key and o.occurred_at == marker, "the marker")
        running = [o for o in watcher.of(key) if snapshot(key, 1, "running")(o)]
        assert running == []

        # A start by hand long after: reported.
        by_hand = started + SAME_START + timedelta(seconds=5)
        stream._put(_event("start", attrs, by_hand))
        again = await watcher.wait_for(
            lambda o: snapshot(key, 1, "running")(o) and o.occurred_at == by_hand, "the new start"
        )
        assert isinstance(again, RuntimeSnapshot)
    finally:
        await watcher.stop()


def test_only_a_start_event_within_same_start_of_the_one_the_watch_holds_is_known() -> None:
    at = datetime(2026, 12, 6, 15, 42, 13, tzinfo=UTC)

    def start(
        runtime_id: str, occurred_at: datetime, source: str = "watch", action: str = "start"
    ) -> RuntimeSnapshot:
        nanos = _nanos(occurred_at)
        return RuntimeSnapshot(type="RuntimeSnapshot",
                               observation_id=f"podman:{runtime_id}:{nanos}:{action}",
                               key="k", generation=1, occurred_at=occurred_at, actor="podman",
                               state="running", runtime_id=runtime_id, source=source)  # fmt: skip

    held = {"r1": at}
    assert known_start(start("r1", at + timedelta(milliseconds=3)), held)
    assert known_start(start("r1", at + SAME_START), held)
    assert not known_start(start("r1", at + SAME_START + timedelta(milliseconds=1)), held)
    assert not known_start(start("r2", at), held)  # a runtime it holds no start of
    assert not known_start(start("r1", at, source="list"), held)  # listings are not events
    exited = start("r1", at).model_copy(update={"state": "exited", "exit_code": 0})
    assert not known_start(exited, held)
    # Regression: an unpause reports running too; one soon after the start is news.
    assert not known_start(start("r1", at + timedelta(milliseconds=600), action="unpause"), held)
