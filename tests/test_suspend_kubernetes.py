"""Suspend on the Kubernetes driver, against the local cluster's kube-apiserver: the Pods go,
the workspace's claim stays for the next generation; without a storage class (the workspace
an emptyDir that dies with its Pod) the suspend is refused and nothing is touched."""

from __future__ import annotations

import pytest
from kube_support import (
    Admin,
    Keys,
    admin_fixture,  # noqa: F401  (the module's admin client)
    keys_fixture,  # noqa: F401  (the test's sandbox names)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
)
from test_driver_kubernetes import driver, launch_spec

from drivers.kube_objects import WORKSPACE_DIES_WITH_POD, claim_name, pod_name
from drivers.kubernetes import KubernetesDriver
from drivers.protocol import DriverError

__all__ = ["driver"]  # the fixture this module uses


async def test_suspend_removes_the_pods_and_keeps_the_claim_for_the_next_generation(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    first = launch_spec(key)
    await driver.launch(first)
    suspended = await driver.suspend(key, 1)
    assert suspended.outcome == "succeeded"
    assert await admin.pod_names(ns, key) == [] and await driver.get(key) == []
    assert await admin.claims(ns, key) == [claim_name(key, first.sandbox_id)]
    assert (await driver.suspend(key, 1)).outcome == "already_absent"
    resumed = launch_spec(key, generation=2, sandbox_id=first.sandbox_id)
    assert (await driver.launch(resumed)).started
    (pod,) = await admin.pods(ns, key)
    claim = pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == claim_name(key, first.sandbox_id)


async def test_suspend_without_a_storage_class_is_refused_and_touches_nothing(
    admin: Admin, ns: str, keys: Keys
) -> None:
    driver = new_driver(admin, ns, storage_class=None)
    try:
        key = keys()
        await driver.launch(launch_spec(key))
        with pytest.raises(DriverError) as refused:
            await driver.suspend(key, 1)
        assert (refused.value.reason, refused.value.retryable) == (WORKSPACE_DIES_WITH_POD, False)
        assert await admin.pod_names(ns, key) == [pod_name(key, 1)]
    finally:
        await driver.close()


async def test_suspend_of_a_pod_made_before_a_storage_class_was_set_is_refused(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    """A review found it: the driver asked its setting only, so a Pod launched while no
    storage class was set (an emptyDir workspace) was suspended once one was: the Pod went,
    its workspace with it, and the resume got an empty claim."""
    before = new_driver(admin, ns, storage_class=None)
    try:
        key = keys()
        await before.launch(launch_spec(key))
    finally:
        await before.close()
    with pytest.raises(DriverError) as refused:
        await driver.suspend(key, 1)  # this driver has a storage class
    assert "mounts no workspace claim" in refused.value.reason, refused.value.reason
    assert (refused.value.retryable, refused.value.observed) == (False, "running")
    assert await admin.pod_names(ns, key) == [pod_name(key, 1)]
