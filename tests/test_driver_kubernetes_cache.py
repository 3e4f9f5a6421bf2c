"""The Kubernetes driver's shared Pod cache against a real kube-apiserver (kwok as the node):
what a sandbox costs the apiserver, and that a cache lagging behind another driver's Pods
never makes a launch, stop or delete wrong.

The request counts come from an apiserver of the test's own on the cluster's etcd, which no
other client uses: its ``apiserver_request_total`` holds exactly the driver's requests.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from harness import eventually
from kube_support import (
    Admin,
    Keys,
    admin_fixture,  # noqa: F401  (the module's admin client)
    driver_config,
    keys_fixture,  # noqa: F401  (the test's sandbox names)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
    own_apiserver,
)

from drivers.kube_api import KubeApi
from drivers.kube_cache import PodCache
from drivers.kube_objects import (
    PodSettings,
    PodView,
    claim_name,
    pod_manifest,
    pod_name,
    read_pod,
    secret_manifest,
    sort_views,
)
from drivers.kubernetes import KubeConfig, KubernetesDriver
from drivers.protocol import DriverError, LaunchSpec
from events.common import SandboxSpec
from services.bench.kube_requests import bare_costs, driver_costs, kube_client, table
from services.common.settings import Settings

IMAGE = "registry.example/agent:1"
SANDBOXES = 10


def launch_spec(key: str, generation: int = 1, sandbox_id: uuid.UUID | None = None) -> LaunchSpec:
    return LaunchSpec(
        key=key,
        sandbox_id=sandbox_id or uuid.uuid5(uuid.NAMESPACE_DNS, key),
        generation=generation,
        identity=f"rid-{key}-{generation}",
        spec=SandboxSpec(image=IMAGE, command=["sleep", "3600"]),
    )


async def test_a_sandbox_costs_the_apiserver_its_pods_create_and_delete_and_no_more(
    admin: Admin, ns: str, settings: Settings, tmp_path: Path
) -> None:
    """Ten sandboxes created (each launch returns once its Pod runs) and deleted at once by
    one driver: it asks for each Pod's create and delete, and beyond those only for what all
    ten share (its cache's listing). Bare Pods, measured in the same run, cost as much.
    The driver before the cache listed the key's Pods, Secrets and claims and watched the
    one Pod in its calls: 9.2 to 9.5 requests per sandbox."""
    async with own_apiserver(settings, tmp_path) as server:
        kube = kube_client(settings, server.settings.kube_apiserver_port)
        try:
            cfg = driver_config(admin, ns, kubeconfig=server.kubeconfig, storage_class=None)
            ours = await driver_costs(kube, cfg, IMAGE, SANDBOXES)
            bare = await bare_costs(kube, ns, IMAGE, SANDBOXES)
        finally:
            await kube.close()
    print(table(ours, bare), f"\n  driver: {ours.line()}\n  bare:   {bare.line()}")
    assert ours.requests.get(("POST", "pods")) == SANDBOXES
    assert ours.requests.get(("DELETE", "pods")) == SANDBOXES
    # Its cache's one listing (and its watch, if resumed meanwhile): nothing per sandbox.
    assert ours.beyond_create_and_delete() <= 2, ours.line()
    assert ours.per_sandbox <= 1.2 * bare.per_sandbox, table(ours, bare)


# -- a cache behind the apiserver --------------------------------------------------------------


@asynccontextmanager
async def lagging(driver: KubernetesDriver) -> AsyncIterator[asyncio.Event]:
    """The driver's cache held behind the apiserver: the watch events it receives are kept
    back, in order, until the yielded event is set (as a slow watch would deliver them)."""
    cache = driver._cache
    await cache.views("warm-up", 10)  # listed, watching
    assert cache.live
    deliver = cache._event
    held: list[tuple[str, Mapping[str, Any]]] = []
    release = asyncio.Event()

    def event(kind: str, pod: Mapping[str, Any]) -> None:
        if release.is_set():
            deliver(kind, pod)
        else:
            held.append((kind, pod))

    async def releasing() -> None:
        await release.wait()
        for kind, pod in held:
            deliver(kind, pod)
        held.clear()

    cache._event = event  # type: ignore[method-assign]
    task = asyncio.ensure_future(releasing())
    try:
        yield release
    finally:
        release.set()
        await task
        cache._event = deliver  # type: ignore[method-assign]


async def pod_made(admin: Admin, ns: str, key: str, generation: int) -> None:
    await eventually(lambda: admin.pod_names(ns, key), lambda n: pod_name(key, generation) in n,
                     what=f"generation {generation}'s Pod")  # fmt: skip


async def test_a_launch_whose_cache_missed_a_newer_generation_is_superseded_and_leaves_none(
    admin: Admin, ns: str, keys: Keys
) -> None:
    """Another driver made generation 2 a moment ago; this driver's cache has not seen it and
    launches generation 1: once its cache catches up, the launch removes the Pod it made and
    fails "superseded", as a launch that saw generation 2 first does."""
    late, other = new_driver(admin, ns), new_driver(admin, ns)
    key = keys()
    first = launch_spec(key)
    try:
        async with lagging(late) as release:
            await other.launch(launch_spec(key, 2, first.sandbox_id))
            launching = asyncio.ensure_future(late.launch(first))
            await pod_made(admin, ns, key, 1)
            release.set()
            with pytest.raises(DriverError) as superseded:
                await launching
        assert "superseded" in superseded.value.reason and not superseded.value.retryable
        assert await admin.pod_names(ns, key) == [pod_name(key, 2)]
    finally:
        await late.close()
        await other.close()


async def test_a_launch_whose_cache_missed_an_older_generation_replaces_it(
    admin: Admin, ns: str, keys: Keys
) -> None:
    late, other = new_driver(admin, ns), new_driver(admin, ns)
    key = keys()
    first = launch_spec(key)
    try:
        async with lagging(late) as release:
            await other.launch(first)
            launching = asyncio.ensure_future(late.launch(launch_spec(key, 2, first.sandbox_id)))
            await pod_made(admin, ns, key, 2)
            release.set()
            assert (await launching).started
        await eventually(lambda: admin.pod_names(ns, key), lambda n: n == [pod_name(key, 2)],
                         what="generation 1 replaced")  # fmt: skip
    finally:
        await late.close()
        await other.close()


async def test_a_stop_and_a_delete_whose_cache_missed_the_pod_still_remove_it(
    admin: Admin, ns: str, keys: Keys
) -> None:
    """A Pod made by another driver and not yet in this driver's cache is found by its name
    (stop) or by a listing (delete: the cache had none of the key)."""
    late, other = new_driver(admin, ns), new_driver(admin, ns)
    stopped, deleted = keys(), keys()
    try:
        async with lagging(late):
            await other.launch(launch_spec(stopped))
            await other.launch(launch_spec(deleted))
            stop = asyncio.ensure_future(late.stop(stopped, 1))
            delete = asyncio.ensure_future(late.delete(deleted))
            # Their removals are awaited on the cache: released below, they complete.
            await eventually(
                lambda: admin.pods(ns, stopped),
                lambda pods: all(p["metadata"].get("deletionTimestamp") for p in pods),
                what="the stop's deletion",
            )
        assert (await stop).outcome == "succeeded"
        assert await delete is True
        assert await admin.pod_names(ns, stopped) == [] and await admin.pod_names(ns, deleted) == []
    finally:
        await late.close()
        await other.close()


# -- what a delete still looks for ---------------------------------------------------------------


async def test_a_delete_removes_the_secret_of_a_launch_that_made_no_pod(
    admin: Admin, ns: str, keys: Keys
) -> None:
    """A launch interrupted after writing its Secret left no Pod to refer to it: the delete,
    finding no Pod, still looks for the key's Secrets."""
    driver = new_driver(admin, ns)
    key = keys()
    try:
        spec = replace(launch_spec(key), secrets={"API_KEY": "left-behind"})
        await admin.core.create_namespaced_secret(ns, secret_manifest(spec))
        assert await driver.delete(key, spec.sandbox_id) is True
        assert await admin.secrets(ns, key) == []
    finally:
        await driver.close()


async def test_a_delete_without_a_storage_class_removes_a_claim_its_pod_mounts(
    admin: Admin, ns: str, keys: Keys
) -> None:
    """A sandbox launched while a storage class was configured, deleted by a driver without
    one: its Pod mounts a claim, so the delete looks for the claims and removes it."""
    before, after = new_driver(admin, ns), new_driver(admin, ns, storage_class=None)
    key = keys()
    spec = launch_spec(key)
    try:
        await before.launch(spec)
        assert await admin.claims(ns, key) == [claim_name(key, spec.sandbox_id)]
        assert await after.delete(key, spec.sandbox_id) is True
        assert await admin.pod_names(ns, key) == [] and await admin.claims(ns, key) == []
    finally:
        await before.close()
        await after.close()


# -- the cache's own rules (no apiserver) --------------------------------------------------------


def pod_at(key: str, uid: str, version: int, phase: str = "Running") -> dict[str, Any]:
    pod = pod_manifest(launch_spec(key), PodSettings())
    pod["metadata"] |= {"uid": uid, "resourceVersion": str(version)}
    pod["status"] = {"phase": phase}
    return pod


def view_at(key: str, uid: str, version: int, phase: str = "Running") -> PodView:
    view = read_pod(pod_at(key, uid, version, phase))
    assert view is not None
    return view


async def test_the_cache_keeps_the_newest_version_and_never_brings_a_removed_pod_back() -> None:
    cache = PodCache(KubeApi(KubeConfig()), 0.1, 1.0)
    cache._listing([], "10")
    cache.note(view_at("a", "u1", 12))  # the driver's own create, ahead of the watch
    cache._event("ADDED", pod_at("a", "u1", 11, "Pending"))  # an older event arrives late
    assert cache.pod("u1") == view_at("a", "u1", 12) and cache.version == 11
    cache._event("DELETED", pod_at("a", "u1", 13))
    cache.note(view_at("a", "u1", 12))  # a late answer of an earlier write
    assert cache.pod("u1") is None and cache.last("u1") == view_at("a", "u1", 13)
    assert await cache.views("a", 0) == []
    await cache.close()  # its informer never ran: the views above were answered at once


async def test_a_relisting_drops_what_it_misses_and_keeps_what_the_driver_wrote_since() -> None:
    cache = PodCache(KubeApi(KubeConfig()), 0.1, 1.0)
    cache._listing([view_at("a", "gone", 5), view_at("a", "stays", 6)], "10")
    cache.note(view_at("a", "new", 21))  # created after the listing below was taken
    cache._listing([view_at("a", "stays", 6)], "20")
    assert [v.uid for v in await cache.views("a", 0) or []] == ["new", "stays"]
    assert cache.pod("gone") is None and cache.version == 20
    await cache.close()


async def test_a_pods_change_wakes_the_waits_on_that_pod_only_and_a_listing_wakes_all() -> None:
    # A burst's launches and deletes wait on their own Pods: each change once woke all of them.
    cache = PodCache(KubeApi(KubeConfig()), 0.1, 1.0)
    uids = [f"u{i}" for i in range(20)]
    cache._listing([view_at(f"k{i}", uid, 5) for i, uid in enumerate(uids)], "10")
    checks: Counter[str] = Counter()

    def gone(uid: str) -> Callable[[], bool]:
        def done() -> bool:
            checks[uid] += 1
            return cache.pod(uid) is None

        return done

    waits = [asyncio.ensure_future(cache.until(gone(uid), 30, uid)) for uid in uids]
    # Each wait's first check, then it waits.
    await eventually(lambda: len(checks), lambda n: n == len(uids), 5, 0.01, "first checks")
    assert checks == Counter(uids)
    cache._event("DELETED", pod_at("k0", "u0", 11))
    assert await asyncio.wait_for(waits[0], 5) is True
    # The other waits, woken with it on the old code, would have checked again by now.
    assert checks == Counter(uids) + Counter(["u0"])
    cache._listing([view_at(f"k{i}", uid, 5) for i, uid in enumerate(uids) if i != 1], "20")
    assert await asyncio.wait_for(waits[1], 5) is True
    assert all(checks[uid] == 2 for uid in uids[1:])  # a listing wakes every wait
    for wait in waits[2:]:
        wait.cancel()
    await asyncio.gather(*waits[2:], return_exceptions=True)
    assert cache._waiters == {}  # the waits left nothing behind
    await cache.close()


async def test_a_keys_pods_are_its_own_whatever_changes_moved_them() -> None:
    """The cache reads a key's Pods from an index by key (it scanned every Pod): after any
    sequence of events, notes, removals, relabellings and relistings, each key's views are
    exactly the Pods the cache holds under that key."""
    rng = random.Random(42)
    cache = PodCache(KubeApi(KubeConfig()), 0.1, 1.0)
    keys, uids = ["a", "b", "c"], [f"u{i}" for i in range(8)]
    cache._listing([], "1")
    version = 1
    for _ in range(600):
        version += 1
        key, uid, step = rng.choice(keys), rng.choice(uids), rng.random()
        if step < 0.5:  # added, changed or relabelled to ``key``
            cache._event(rng.choice(["ADDED", "MODIFIED"]), pod_at(key, uid, version))
        elif step < 0.7:
            cache.note(view_at(key, uid, version))
        elif step < 0.9:
            cache._event("DELETED", pod_at(key, uid, version))
        else:
            held = [cache.pod(u) for u in uids]
            at = str(version)
            listed = [v for v in held if v is not None and rng.random() < 0.7]
            cache._listing([replace(v, resource_version=at) for v in listed], at)
        held = [v for v in (cache.pod(u) for u in uids) if v is not None]
        for k in keys:
            assert await cache.views(k, 0) == sort_views([v for v in held if v.info.key == k])
    await cache.close()
