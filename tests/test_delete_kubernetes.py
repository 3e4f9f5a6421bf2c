"""A decided delete finishes on Kubernetes too, against a real kube-apiserver (kwok as the node;
`make k8s` starts it) with the whole pipeline (processor, executor, watcher, reconcile loop):

- a sandbox whose workspace claim a Pod sandstream does not manage mounts stays Deleting (its
  Pod removed, the claim held by its protection finalizer, the failures recorded) until that
  Pod goes; then the claim is gone and only then is the row Deleted;
- a claim of an incarnation this store tombstoned, made after its delete (as a launch still
  running in an executor that lost its partition would), is collected by the reconcile loop.

The executor's retry window (600 s) and the delete deadline (120 s, doubling up to 1800 s) are
scaled down as in tests/test_delete_finishes.py, keeping their relation (the retry falls due
while the executor still retries, the executor reports the failure after its window, the row
keeps its deadline and the next retry deletes again).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import factories as f
from harness import Env, eventually, isolated_env
from kube_support import (
    Admin,
    Keys,
    admin_fixture,  # noqa: F401  (the module's admin client)
    keys_fixture,  # noqa: F401  (the test's sandbox names)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
)
from pipeline_support import command, history, phase, running_plane, wait_phase

from drivers.kube_objects import claim_manifest, claim_name
from drivers.kubernetes import KubernetesDriver
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from events.publisher import CommandPublisher
from services.executor.calls import RetryPolicy
from services.up.control_plane import ControlPlane

SPEC = SandboxSpec(image="registry.example/agent:1", command=["sleep", "3600"])
SCALED = {
    "delete_retry_seconds": 1.0,
    "delete_retry_max_seconds": 3.0,
    "stop_timeout_seconds": 1,
    "scheduler_poll_seconds": 0.5,
}
RETRY = RetryPolicy(first_delay=0.2, max_delay=0.5, give_up_after=2.0)


@asynccontextmanager
async def pipeline(
    driver: KubernetesDriver,
) -> AsyncIterator[tuple[Env, ControlPlane, CommandPublisher]]:
    try:
        async with isolated_env() as env:
            env.settings = env.settings.model_copy(update=SCALED)
            async with (
                running_plane(
                    env, driver, reconcile_interval=3600, retry=RETRY, with_scheduler=True
                ) as plane,
                await env.publisher() as pub,
            ):
                yield env, plane, pub
    finally:
        await driver.close()


def now() -> datetime:
    """Commands decided now (the factories' fixed time would put every deadline in the past)."""
    return datetime.now(UTC)


def failed_deletes(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        h
        for h in items
        if h["message_type"] == "DriverOperationResult"
        and (h["message"]["operation"], h["message"]["outcome"]) == ("delete", "failed")
    ]


async def sandbox_id_of(env: Env, key: str) -> UUID:
    value = await env.fetchval("SELECT sandbox_id FROM sandboxes WHERE key = $1", key)
    assert isinstance(value, UUID)
    return value


async def test_a_claim_a_foreign_pod_mounts_keeps_the_row_deleting_until_it_is_gone(
    admin: Admin, ns: str, keys: Keys
) -> None:
    key, holder = keys(), f"holder-{keys()}"
    driver = new_driver(admin, ns, removal_margin=1.0, stop_timeout=1.0)
    try:
        async with pipeline(driver) as (env, _, pub):
            await command(env, pub, f.create(key, sandbox_spec=SPEC, occurred_at=now()))
            await wait_phase(env, key, "Ready")
            claim = claim_name(key, await sandbox_id_of(env, key))
            foreign = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": holder},
                "spec": {
                    "containers": [{"name": "c", "image": SPEC.image}],
                    "volumes": [{"name": "w", "persistentVolumeClaim": {"claimName": claim}}],
                },
            }
            await admin.core.create_namespaced_pod(ns, foreign)
            await command(env, pub, f.delete(key, occurred_at=now()))
            items = await eventually(
                lambda: history(env, key),
                lambda items: len(failed_deletes(items)) >= 1,
                timeout=60,
                what="the delete's failure report",
            )
            failure = failed_deletes(items)[0]
            assert (failure["disposition"], failure["phase"]) == ("applied", "Deleting")
            assert "still present" in failure["message"]["reason"]
            assert await admin.pod_names(ns, key) == []  # its own Pod is gone ...
            removed = [h for h in items if h["message_type"] == "RuntimeRemoved"]
            assert removed and all(h["disposition"] == "ignored" for h in removed), removed
            assert await admin.claims(ns, key) == [claim]  # ... its claim is not
            assert await phase(env, key) == "Deleting"

            await admin.delete_pod_now(ns, holder)
            await wait_phase(env, key, "Deleted", timeout=60)
            assert await admin.claims(ns, key) == []
            final = next(h for h in await history(env, key) if h["phase"] == "Deleted")
            assert final["message"]["operation"] == "delete"
            assert final["message"]["outcome"] in ("succeeded", "already_absent")
    finally:
        await admin.delete_pod_now(ns, holder)


async def test_a_tombstoned_incarnations_claim_is_collected(
    admin: Admin, ns: str, keys: Keys
) -> None:
    key, live = keys(), keys()
    driver = new_driver(admin, ns, stop_timeout=1.0)
    async with pipeline(driver) as (env, plane, pub):
        reconciler = plane.reconciler
        assert reconciler is not None
        # The loop's first pass (at start, then hourly) must not collect what follows: it ends
        # before the creates (see the Podman twin in test_delete_finishes.py).
        await eventually(lambda: reconciler.passes, lambda n: n >= 1,
                         what="the reconcile loop's first pass")  # fmt: skip
        for name in (key, live):
            await command(env, pub, f.create(name, sandbox_spec=SPEC, occurred_at=now()))
            await wait_phase(env, name, "Ready")
        sandbox_id = await sandbox_id_of(env, key)
        await command(env, pub, f.delete(key, occurred_at=now()))
        await wait_phase(env, key, "Deleted")
        assert await admin.claims(ns, key) == []
        # What a launch still running elsewhere would make after the delete: its claim.
        spec = LaunchSpec(key, sandbox_id, 1, "rid-late", SPEC)
        await admin.core.create_namespaced_persistent_volume_claim(
            ns, claim_manifest(spec, driver.cfg.pod_settings)
        )
        assert await admin.claims(ns, key) == [claim_name(key, sandbox_id)]
        await reconciler.run_once()
        await eventually(
            lambda: admin.claims(ns, key), lambda claims: claims == [], timeout=30,
            what="the tombstoned incarnation's claim to be collected",
        )  # fmt: skip
        assert reconciler.collected == 1
        assert await admin.claims(ns, live) == [claim_name(live, await sandbox_id_of(env, live))]
        assert await phase(env, live) == "Ready"
