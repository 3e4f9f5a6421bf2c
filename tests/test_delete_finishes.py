"""A decided delete finishes, on the real stack (Kafka, PostgreSQL, Podman, the scheduler):
a time-to-live delete whose workspace volume another container holds stays Deleting, failing
and retrying visibly, until the volume is free; then the volume is removed and only then is
the row Deleted.

The old rules ended it two ways, both tested here: the watcher's report that the sandbox's
container was removed tombstoned the row at once (the volume, with the agent's files, stayed
on Podman for good), and the executor's failure report, after its retry window, moved the row
out of Deleting to the phase it observed with the deadline cleared (the time to live already
consumed: alive for good).

The windows are scaled down, keeping their relation at the defaults: the executor retries a
transient failure for 600 s and the first delete retry falls due 120 s after the grace period,
doubling up to 1800 s: here 6 s, 1.2 s and 18 s. The path is the same (the history below shows
it): the scheduler's delete retry falls due while the executor still retries the first delete
(skipped: a delete of the incarnation is running), the executor gives up and reports the
failure ("gave up after N attempts"), the row stays Deleting with its deadline, the next
retry deletes again. ``tests/test_lifecycle_scenarios.py`` decides the same sequence with
the default limits and the failure at 600 s.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from uuid import UUID, uuid4

import apikit
import pytest
from apikit import create_body, unique
from harness import eventually
from podman import PodmanClient
from podman.errors import APIError, NotFound

from drivers.labels import workspace_labels
from drivers.podman import PodmanDriver, container_name, volume_name
from drivers.protocol import DriverError, LaunchSpec
from events.common import SandboxSpec
from services.common.settings import load_settings
from services.executor.backends import podman_driver

# The defaults (600 s, 120 s, 1800 s, and the driver's 10 s grace) divided by 100, the grace
# rounded up to the sandbox's whole second: tests/test_lifecycle_scenarios.py decides the
# delete's timeline at both scales and gets the same events in the same order.
SCALED = {
    "executor_retry_seconds": 6.0,
    "delete_retry_seconds": 1.2,
    "delete_retry_max_seconds": 18.0,
    "scheduler_poll_seconds": 0.2,
}
GRACE = 1
TTL = 8  # seconds: long enough to start the foreign container first


def volume_exists(client: PodmanClient, name: str) -> bool:
    """Podman 4.3 answers a volume being removed at that moment 500 "no such volume", not 404
    (as drivers/podman_objects.remove_volume says): absent too (a suite run's probe met it)."""
    try:
        client.volumes.get(name)
    except NotFound:
        return False
    except APIError as exc:
        if "no such volume" not in str(exc):
            raise
        return False
    return True


def hold_volume(client: PodmanClient, image: str, volume: str, name: str) -> str:
    """A container sandstream does not manage, mounting ``volume`` (running)."""
    container = client.containers.create(
        image,
        ["sleep", "600"],
        name=name,
        volumes={volume: {"bind": "/held", "mode": "rw"}},
        stop_timeout=0,  # killed at once on release: `sleep` as PID 1 ignores SIGTERM
    )
    container.start()
    return str(container.id)


async def history(c: Any, name: str) -> list[dict[str, Any]]:
    r = await c.get(f"/v1/sandboxes/{name}/history", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return r.json()["items"]  # type: ignore[no-any-return]


def events_of(items: list[dict[str, Any]]) -> list[str]:
    return [e for item in items for e in item["events"]]


async def test_a_ttl_delete_with_a_held_volume_stays_deleting_until_the_volume_is_gone() -> None:
    settings = load_settings()
    podman: PodmanDriver = podman_driver(settings)  # type: ignore[assignment]
    client = PodmanClient(base_url=podman.base_url, timeout=60)
    name, holder = unique("heldvol"), unique("heldvol-holder")
    volume = None
    try:
        async with (
            apikit.running_api(podman, settings_update=SCALED, with_scheduler=True) as api,
            api.client() as c,
        ):
            body = create_body(name, command=["sleep", "600"], stop_timeout_seconds=GRACE)
            body["spec"]["image"] = settings.sandbox_image
            body |= {"ttl_seconds": TTL, "on_expiry": "delete"}
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await api.wait_phase(name, "Ready")
            sandbox_id = UUID((await c.get(f"/v1/sandboxes/{name}")).json()["id"])
            volume = volume_name(name, sandbox_id)
            await asyncio.to_thread(hold_volume, client, settings.sandbox_image, volume, holder)

            # The time to live deletes it; the container goes, the volume cannot.
            await eventually(
                lambda: podman.get(name), lambda rts: rts == [], timeout=30,
                what="the sandbox's container to be removed",
            )  # fmt: skip
            # The executor gives up on the volume after its retry window and reports it.
            items = await eventually(
                lambda: history(c, name),
                lambda items: any("SandboxOperationFailed" in i["events"] for i in items),
                timeout=60,
                what="the delete's failure report",
            )
            row = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert row["phase"] == "Deleting", row
            assert row["deadline"] is not None and row["deadline"]["kind"] == "delete", row
            failure = next(i for i in items if "SandboxOperationFailed" in i["events"])
            # The path of the real scale: the deadline's retry fell due while the executor still
            # retried the first delete (so it was skipped), and the failure kept a deadline.
            before = events_of(items[: items.index(failure)])
            assert before[before.index("SandboxDeleting") :].count("SandboxDeleteRetried") >= 1
            assert failure["phase"] == "Deleting"
            message = failure["message"]
            assert (message["operation"], message["outcome"]) == ("delete", "failed")
            assert "gave up after" in message["reason"], message
            # The watcher saw the container go: recorded, and it changed nothing.
            removed = [i for i in items if i["message_type"] == "RuntimeRemoved"]
            assert removed and all(i["disposition"] == "ignored" for i in removed), removed
            assert "SandboxDeleted" not in events_of(items)
            assert await asyncio.to_thread(volume_exists, client, volume)
            # A retry that falls due while the volume is still held fails again: still Deleting.
            await eventually(
                lambda: history(c, name),
                lambda items: events_of(items).count("SandboxOperationFailed") >= 2,
                timeout=60,
                what="a second failed attempt",
            )
            row = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert row["phase"] == "Deleting", row
            assert row["reason"].startswith("DeleteFailed: still Deleting (retries so far: "), row

            # Released: the next retry removes the volume, and only then is the row Deleted.
            await asyncio.to_thread(client.containers.remove, holder, force=True)
            await api.wait_phase(name, "Deleted", timeout=60)
            assert not await asyncio.to_thread(volume_exists, client, volume)
            items = await history(c, name)
            final = next(i for i in items if "SandboxDeleted" in i["events"])
            assert final["message"]["operation"] == "delete"
            assert final["message"]["outcome"] == "succeeded"
            kinds = events_of(items)
            assert kinds.index("SandboxExpired") < kinds.index("SandboxDeleting")
            assert "SandboxDeleteRetried" in kinds
    finally:
        with contextlib.suppress(NotFound):
            client.containers.remove(holder, force=True)
        await podman.delete(name)
        client.close()  # type: ignore[no-untyped-call]
        await podman.close()


async def test_at_the_default_windows_a_held_volume_keeps_the_row_deleting_until_released() -> None:
    """The reported case, unscaled: a time-to-live delete whose volume a container holds for
    a while (here 10 s; the executor's 600 s retry window is never reached). The row was
    Deleted within a second, when the watcher saw the container go; it must stay Deleting
    while the volume is held and be Deleted, the volume gone, soon after the release (the
    executor's retries are at most 10 s apart)."""
    settings = load_settings()
    podman: PodmanDriver = podman_driver(settings)  # type: ignore[assignment]
    client = PodmanClient(base_url=podman.base_url, timeout=60)
    name, holder = unique("heldvol-real"), unique("heldvol-real-holder")
    update = {"scheduler_poll_seconds": 0.2}  # how soon the expiry is noticed, nothing else
    try:
        async with (
            apikit.running_api(podman, settings_update=update, with_scheduler=True) as api,
            api.client() as c,
        ):
            body = create_body(name, command=["sleep", "600"], stop_timeout_seconds=GRACE)
            body["spec"]["image"] = settings.sandbox_image
            body |= {"ttl_seconds": TTL, "on_expiry": "delete"}
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await api.wait_phase(name, "Ready")
            volume = volume_name(name, UUID((await c.get(f"/v1/sandboxes/{name}")).json()["id"]))
            await asyncio.to_thread(hold_volume, client, settings.sandbox_image, volume, holder)
            await eventually(
                lambda: podman.get(name), lambda rts: rts == [], timeout=30,
                what="the sandbox's container to be removed",
            )  # fmt: skip
            loop = asyncio.get_running_loop()
            held_until = loop.time() + 10
            while loop.time() < held_until:  # observed over the hold, not waited on
                assert await api.phase(name) == "Deleting"
                assert await asyncio.to_thread(volume_exists, client, volume)
                await asyncio.sleep(0.5)
            items = await history(c, name)
            removed = [i for i in items if i["message_type"] == "RuntimeRemoved"]
            assert removed and all(i["disposition"] == "ignored" for i in removed), removed
            await asyncio.to_thread(client.containers.remove, holder, force=True)
            await api.wait_phase(name, "Deleted", timeout=30)
            assert not await asyncio.to_thread(volume_exists, client, volume)
    finally:
        with contextlib.suppress(NotFound):
            client.containers.remove(holder, force=True)
        await podman.delete(name)
        client.close()  # type: ignore[no-untyped-call]
        await podman.close()


def zombie_launch(podman: PodmanDriver, key: str, sandbox_id: UUID, image: str) -> None:
    """What a launch still running in an executor that lost its partition leaves behind after
    the delete finished: a container of the incarnation and its workspace volume."""
    spec = SandboxSpec(image=image, command=["sleep", "600"], stop_timeout_seconds=1)
    podman._sync.launch(LaunchSpec(key, sandbox_id, 1, "rid-zombie", spec))


async def test_a_deleted_incarnations_leftovers_are_collected_and_nothing_else() -> None:
    settings = load_settings()
    podman: PodmanDriver = podman_driver(settings)  # type: ignore[assignment]
    client = PodmanClient(base_url=podman.base_url, timeout=60)
    gone, live = unique("leftover"), unique("leftover-live")
    stranger = (unique("leftover-stranger"), uuid4())  # another control plane's
    image = settings.sandbox_image
    try:
        async with apikit.running_api(podman) as api, api.client() as c:
            reconciler = api.plane.reconciler  # type: ignore[union-attr]
            assert reconciler is not None
            # The loop's first pass (at start, then hourly) must not collect what follows. It
            # ends before the creates: a pass that read the rows before a create and listed the
            # backend after it would find a sandbox created and deleted meanwhile a deleted
            # incarnation, and rightly collect it too (a suite run's failure).
            await eventually(lambda: reconciler.passes, lambda n: n >= 1,
                             what="the reconcile loop's first pass")  # fmt: skip
            for name in (gone, live):
                body = create_body(name, command=["sleep", "600"], stop_timeout_seconds=1)
                body["spec"]["image"] = image
                r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
                assert r.status_code == 201, r.text
            first = UUID((await c.get(f"/v1/sandboxes/{gone}")).json()["id"])
            live_id = UUID((await c.get(f"/v1/sandboxes/{live}")).json()["id"])
            r = await c.delete(f"/v1/sandboxes/{gone}", params={"wait": 30})
            assert r.status_code == 200, r.text
            await api.wait_phase(gone, "Deleted")
            await asyncio.to_thread(zombie_launch, podman, gone, first, image)
            await asyncio.to_thread(zombie_launch, podman, *stranger, image)
            assert await asyncio.to_thread(volume_exists, client, volume_name(gone, first))

            await reconciler.run_once()
            await eventually(
                lambda: asyncio.to_thread(volume_exists, client, volume_name(gone, first)),
                lambda exists: not exists, timeout=30,
                what="the deleted incarnation's volume to be collected",
            )  # fmt: skip
            assert await podman.get(gone) == []
            assert reconciler.collected == 1
            # The live sandbox and the stranger are untouched.
            assert [rt.state for rt in await podman.get(live)] == ["running"]
            assert await asyncio.to_thread(volume_exists, client, volume_name(live, live_id))
            assert [rt.sandbox_id for rt in await podman.get(stranger[0])] == [stranger[1]]
            assert await asyncio.to_thread(volume_exists, client, volume_name(*stranger))
            # The collection's result is recorded against the tombstone, which it left as is.
            items = await history(c, gone)
            collected = [
                i for i in items
                if (i["message"] or {}).get("observation_id") == f"result:leftover:{first}"
            ]  # fmt: skip
            assert [i["disposition"] for i in collected] == ["ignored"], collected

            # Re-created: a leftover of the first incarnation goes, the new one stays Ready.
            body = create_body(gone, command=["sleep", "600"], stop_timeout_seconds=1)
            body["spec"]["image"] = image
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            second = UUID((await c.get(f"/v1/sandboxes/{gone}")).json()["id"])
            await api.wait_phase(gone, "Ready")
            volume = volume_name(gone, first)
            await asyncio.to_thread(
                client.volumes.create, volume, labels=workspace_labels(gone, first)
            )
            await reconciler.run_once()
            await eventually(
                lambda: asyncio.to_thread(volume_exists, client, volume),
                lambda exists: not exists, timeout=30,
                what="the first incarnation's volume to be collected after the re-create",
            )  # fmt: skip
            assert await asyncio.to_thread(volume_exists, client, volume_name(gone, second))
            assert [(rt.sandbox_id, rt.state) for rt in await podman.get(gone)] == [
                (second, "running")
            ]
            assert await api.phase(gone) == "Ready"
    finally:
        for name in (gone, live, stranger[0]):
            for runtime in await podman.get(name):
                await podman.kill(name, runtime.generation)
            await podman.delete(name)
        client.close()  # type: ignore[no-untyped-call]
        await podman.close()


def our_secrets(client: PodmanClient, key: str) -> list[str]:
    return sorted(
        str(s.name) for s in client.secrets.list() if str(s.name).startswith(f"sandstream-{key}-g")
    )


async def test_a_failed_launch_leaves_no_provider_secret_for_the_delete_to_miss() -> None:
    """The delete finds a generation's secrets through its container. A launch that failed
    after writing them (missing image; its container name taken by a stranger) left them,
    with the provider values, on Podman for good: the delete that followed removed nothing."""
    settings = load_settings()
    podman: PodmanDriver = podman_driver(settings)  # type: ignore[assignment]
    client = PodmanClient(base_url=podman.base_url, timeout=60)
    missing, taken = unique("nosecret-img"), unique("nosecret-name")
    try:
        spec = SandboxSpec(image="localhost/sandstream-missing:1", command=["sleep", "600"])
        launch = LaunchSpec(missing, uuid4(), 1, "rid-1", spec, secrets={"TOKEN": "s3cret"})
        with pytest.raises(DriverError, match="image not known"):
            await podman.launch(launch)
        assert await asyncio.to_thread(our_secrets, client, missing) == []

        # A container sandstream does not manage holds the generation's container name.
        await asyncio.to_thread(
            lambda: client.containers.create(
                settings.sandbox_image, ["sleep", "600"], name=container_name(taken, 1)
            )
        )
        spec = SandboxSpec(image=settings.sandbox_image, command=["sleep", "600"])
        launch = LaunchSpec(taken, uuid4(), 1, "rid-1", spec, secrets={"TOKEN": "s3cret"})
        with pytest.raises(DriverError, match="does not manage"):
            await podman.launch(launch)
        assert await asyncio.to_thread(our_secrets, client, taken) == []
        await podman.delete(taken, launch.sandbox_id)
        assert await asyncio.to_thread(our_secrets, client, taken) == []
    finally:
        with contextlib.suppress(NotFound):
            client.containers.remove(container_name(taken, 1), force=True)
        for key in (missing, taken):
            await podman.delete(key)
            for name in await asyncio.to_thread(our_secrets, client, key):
                with contextlib.suppress(NotFound):
                    client.secrets.remove(name)
        client.close()  # type: ignore[no-untyped-call]
        await podman.close()
