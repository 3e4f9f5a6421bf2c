"""The routing driver: each call goes to the backend its sandbox's name routes to, and each
backend answers only for its own names (listings and watch streams). Two fakes first, then
the shared fake beside real Podman, as the chaos checker runs them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import cast

import pytest
from harness import eventually
from podman import PodmanClient

from drivers.fake import FakeDriver
from drivers.fake_shared import SharedFakeDriver
from drivers.podman import PodmanDriver, container_name
from drivers.protocol import Driver, LaunchSpec, RuntimeInfo, WatchObservation
from drivers.routing import RoutingDriver
from events.common import SandboxSpec
from events.observations import RuntimeSnapshot
from services.common.settings import Settings
from services.executor.backends import describe_driver, driver_from_settings

WAIT = 20.0


def spec(key: str, generation: int = 1, image: str = "localhost/sandstream-base:1") -> LaunchSpec:
    return LaunchSpec(
        key=key,
        sandbox_id=uuid.uuid5(uuid.NAMESPACE_DNS, key),
        generation=generation,
        identity=f"rid-{key}-{generation}",
        spec=SandboxSpec(image=image, command=["sleep", "3600"]),
    )


def stream(driver: Driver) -> AsyncGenerator[WatchObservation, None]:
    return cast(AsyncGenerator[WatchObservation, None], driver.watch())


async def next_matching(
    watch: AsyncGenerator[WatchObservation, None], key: str, state: str
) -> RuntimeSnapshot:
    """The next snapshot of ``key`` in ``state`` (others pass by), within WAIT seconds."""

    async def find() -> RuntimeSnapshot:
        async for o in watch:
            if isinstance(o, RuntimeSnapshot) and (o.key, o.state) == (key, state):
                return o
        raise AssertionError(f"the stream ended before {key} was {state}")

    return await asyncio.wait_for(find(), WAIT)


def states(observations: list[WatchObservation]) -> list[tuple[str, str]]:
    return [(o.key, o.state if isinstance(o, RuntimeSnapshot) else "removed") for o in observations]


def keys_of(runtimes: list[RuntimeInfo]) -> list[tuple[str, int, str]]:
    return [(rt.key, rt.generation, rt.state) for rt in runtimes]


# -- two fakes ----------------------------------------------------------------------------------


def test_the_routing_driver_implements_the_protocol_and_needs_a_prefix() -> None:
    assert isinstance(RoutingDriver(FakeDriver(), FakeDriver(), "p-"), Driver)
    with pytest.raises(ValueError, match="prefix"):
        RoutingDriver(FakeDriver(), FakeDriver(), "")


async def test_every_call_goes_to_the_backend_the_name_routes_to() -> None:
    default, routed = FakeDriver(), FakeDriver()
    driver = RoutingDriver(default, routed, "p-")
    await driver.launch(spec("p-one"))
    await driver.launch(spec("plain"))
    assert keys_of(await routed.list()) == [("p-one", 1, "running")]
    assert keys_of(await default.list()) == [("plain", 1, "running")]
    assert (await driver.stop("p-one", 1)).outcome == "succeeded"
    assert (await driver.kill("plain", 1)).outcome == "succeeded"
    assert keys_of(await driver.get("p-one")) == [("p-one", 1, "exited")]
    assert keys_of(await driver.get("plain")) == [("plain", 1, "exited")]
    assert await driver.delete("p-one") is True
    assert await routed.list() == [] and len(await default.list()) == 1
    assert [(c.op, c.key) for c in routed.calls if c.op != "list"] == [
        ("launch", "p-one"), ("stop", "p-one"), ("get", "p-one"), ("delete", "p-one")
    ]  # fmt: skip
    assert [(c.op, c.key) for c in default.calls if c.op != "list"] == [
        ("launch", "plain"), ("kill", "plain"), ("get", "plain")
    ]  # fmt: skip


async def test_each_backend_lists_and_reports_only_its_own_names() -> None:
    default, routed = FakeDriver(), FakeDriver()
    driver = RoutingDriver(default, routed, "p-")
    await default.launch(spec("b-plain"))
    await routed.launch(spec("p-mine"))
    # Names of the other side, on a backend shared with others: not ours to show.
    await default.launch(spec("p-stranger"))
    await routed.launch(spec("a-stranger"))
    assert keys_of(await driver.list()) == [("b-plain", 1, "running"), ("p-mine", 1, "running")]
    watch = stream(driver)
    listed = [await asyncio.wait_for(anext(watch), WAIT) for _ in range(2)]
    assert sorted(o.key for o in listed) == ["b-plain", "p-mine"]
    # Changes come from both backends as they happen; the strangers' never.
    await default.stop("p-stranger", 1)
    await routed.stop("p-mine", 1)
    await default.stop("b-plain", 1)
    changes = [await asyncio.wait_for(anext(watch), WAIT) for _ in range(2)]
    assert sorted(states(changes)) == [("b-plain", "exited"), ("p-mine", "exited")]
    await watch.aclose()
    assert default.watcher_count == 0 and routed.watcher_count == 0  # both streams closed


async def test_the_merged_stream_ends_when_either_backend_stream_ends() -> None:
    default, routed = FakeDriver(), FakeDriver()
    driver = RoutingDriver(default, routed, "p-")
    watch = stream(driver)
    pending = asyncio.ensure_future(anext(watch))
    await eventually(
        lambda: routed.watcher_count, lambda n: n > 0, WAIT, what="the routed stream to open"
    )
    await routed.close()  # its stream ends: the watcher must reopen both and list again
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, WAIT)
    assert default.watcher_count == 0


def test_settings_with_a_route_prefix_build_a_routing_driver(tmp_path: Path) -> None:
    settings = Settings(driver="fake", fake_state_file=tmp_path / "fake.pickle",
                        driver_route_prefix="p-", driver_route="podman")  # fmt: skip
    driver = driver_from_settings(settings)
    assert isinstance(driver, RoutingDriver)
    assert isinstance(driver.default, SharedFakeDriver) and driver.prefix == "p-"
    assert isinstance(driver.routed, PodmanDriver)
    assert "names starting 'p-': podman" in describe_driver(settings)
    same = Settings(driver="podman", driver_route_prefix="p-", driver_route="podman")
    with pytest.raises(ValueError, match="SANDSTREAM_DRIVER_ROUTE names the default"):
        driver_from_settings(same)
    empty = settings.model_copy(update={"driver_route_prefix": ""})
    with pytest.raises(ValueError, match="SANDSTREAM_DRIVER_ROUTE_PREFIX is empty"):
        driver_from_settings(empty)


# -- the shared fake beside real Podman ------------------------------------------------------


@pytest.fixture
async def fake_and_podman(
    settings: Settings, podman: PodmanClient, tmp_path: Path
) -> AsyncIterator[tuple[RoutingDriver, str]]:
    """The shared fake with real Podman for the names with a fresh prefix; everything of
    that prefix is removed from Podman afterwards."""
    prefix = f"rt{uuid.uuid4().hex[:8]}-"
    fake = SharedFakeDriver(tmp_path / "fake.pickle")
    driver = RoutingDriver(fake, PodmanDriver(settings.podman_url, stop_timeout=1), prefix)
    yield driver, prefix
    for rt in await driver.routed.list():
        if rt.key.startswith(prefix):
            await driver.routed.delete(rt.key)
    await driver.close()


async def test_names_with_the_prefix_run_on_podman_and_the_rest_on_the_fake(
    fake_and_podman: tuple[RoutingDriver, str], podman: PodmanClient, settings: Settings
) -> None:
    driver, prefix = fake_and_podman
    real, fake = f"{prefix}real", "not-on-podman"
    image = settings.sandbox_image
    watch = stream(driver)
    try:
        await driver.launch(spec(real, image=image))
        await driver.launch(spec(fake, image=image))
        # Podman ran it for real; the fake's sandbox left nothing there.
        assert podman.containers.get(container_name(real, 1)).status == "running"
        assert not podman.containers.exists(container_name(fake, 1))
        # The listing has both and nothing of the others' containers on the same service.
        assert keys_of(await driver.list()) == [(fake, 1, "running"), (real, 1, "running")]
        # Podman's own events reach the merged stream.
        await driver.stop(real, 1)
        assert (await next_matching(watch, real, "exited")).actor == "podman-watcher"
        assert await driver.delete(real) is True
        assert not podman.containers.exists(container_name(real, 1))
        assert keys_of(await driver.list()) == [(fake, 1, "running")]
    finally:
        await watch.aclose()
