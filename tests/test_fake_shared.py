"""The file-backed fake: several driver objects (processes) on one file see one backend."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from test_driver_fake import SID, spec

from drivers.fake import FakeDriver
from drivers.fake_shared import SharedFakeDriver
from drivers.protocol import DriverError
from services.common.settings import Settings
from services.executor.backends import describe_driver, driver_from_settings


async def test_a_runtime_launched_through_one_driver_is_stopped_and_deleted_through_another(
    tmp_path: Path,
) -> None:
    first, second = SharedFakeDriver(tmp_path / "b"), SharedFakeDriver(tmp_path / "b")
    launched = await first.launch(spec("box"))
    [seen] = await second.list()
    assert (seen.runtime_id, seen.state) == (launched.runtime_id, "running")
    assert (await second.stop("box", 1)).outcome == "succeeded"
    assert [r.state for r in await first.get("box")] == ["exited"]
    assert await second.delete("box", SID)
    assert await first.list() == []
    assert not await first.delete("box", SID)  # nothing left to remove


async def test_runtime_ids_stay_unique_across_drivers_and_a_refused_launch_changes_nothing(
    tmp_path: Path,
) -> None:
    first, second = SharedFakeDriver(tmp_path / "b"), SharedFakeDriver(tmp_path / "b")
    a = await first.launch(spec("a"))
    b = await second.launch(spec("b"))
    assert a.runtime_id != b.runtime_id
    other = uuid.uuid4()
    await first.launch(spec("c", generation=2, sandbox_id=other))
    with pytest.raises(DriverError, match="superseded"):
        await second.launch(spec("c", generation=1, sandbox_id=other))
    assert [(r.key, r.generation) for r in await first.list()] == [("a", 1), ("b", 1), ("c", 2)]


async def test_a_new_drivers_watch_stream_starts_with_the_shared_listing(tmp_path: Path) -> None:
    await SharedFakeDriver(tmp_path / "b").launch(spec("box"))
    stream = SharedFakeDriver(tmp_path / "b").watch()
    first = await anext(stream)
    assert (first.key, first.source, first.type) == ("box", "list", "RuntimeSnapshot")
    await stream.aclose()


def test_the_settings_fake_driver_shares_its_runtimes_when_given_a_state_file(
    tmp_path: Path,
) -> None:
    shared = Settings(driver="fake", fake_state_file=tmp_path / "b")
    driver = driver_from_settings(shared)
    assert isinstance(driver, SharedFakeDriver) and driver.state_file == tmp_path / "b"
    assert "shared" in describe_driver(shared)
    alone = driver_from_settings(Settings(driver="fake"))
    assert isinstance(alone, FakeDriver) and not isinstance(alone, SharedFakeDriver)
