"""The Kubernetes driver against a real kube-apiserver (kwok as the node; `make k8s`).

No mocks: Pods, claims, deletions and watch events are the API server's. kwok stands in for
the kubelet, so Pods reach Running and finish their graceful deletion; container exits are
written through pods/status as a kubelet would. These tests fail (never skip) when the
cluster is missing. Every test uses its own sandbox names in this module's own namespace.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import factories as f
import pytest
import pytest_asyncio
import yaml
from harness import eventually
from kube_support import (
    Admin,
    Keys,
    OwnApiserver,
    admin_fixture,  # noqa: F401  (the module's admin client)
    env_of,
    keys_fixture,  # noqa: F401  (the test's sandbox names)
    namespace,
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
    own_apiserver,
    phase_of,
    wait_pods,
)
from kubernetes_asyncio import client

from drivers.kube_objects import (
    ANNOTATION_LABELS,
    claim_name,
    is_label,
    pod_labels,
    pod_manifest,
    pod_name,
    read_pod,
    secret_name,
    snapshot,
)
from drivers.kube_watch import Reported
from drivers.kubernetes import KubernetesDriver, parse_node_selector
from drivers.protocol import (
    IDENTITY_ENV,
    LABEL_GENERATION,
    LABEL_IDENTITY,
    LABEL_KEY,
    LABEL_STOP_TIMEOUT,
    Driver,
    DriverError,
    LaunchSpec,
    WatchObservation,
)
from events.common import Phase, SandboxSpec
from events.observations import RuntimeRemoved, RuntimeSnapshot
from services.common.settings import PROJECT_ROOT, Settings
from services.executor.backends import describe_driver, driver_from_settings

IMAGE = "registry.example/agent:1"


@pytest_asyncio.fixture(loop_scope="session")
async def driver(admin: Admin, ns: str) -> AsyncIterator[KubernetesDriver]:
    d = new_driver(admin, ns)
    try:
        yield d
    finally:
        await d.close()


def launch_spec(key: str, generation: int = 1, sandbox_id: uuid.UUID | None = None,
                **spec: Any) -> LaunchSpec:  # fmt: skip
    return LaunchSpec(
        key=key,
        sandbox_id=sandbox_id or uuid.uuid5(uuid.NAMESPACE_DNS, key),
        generation=generation,
        identity=f"rid-{key}-{generation}",
        spec=SandboxSpec(image=IMAGE, command=["sleep", "3600"], **spec),
    )


class Watching:
    """``driver.watch()`` in a task, keeping what it yields; started once the watch is open."""

    def __init__(self, driver: KubernetesDriver) -> None:
        self.seen: list[WatchObservation] = []
        self._task = asyncio.create_task(self._run(driver))

    @classmethod
    async def started(cls, driver: KubernetesDriver) -> Watching:
        before = driver.connected_watchers
        watching = cls(driver)
        await eventually(lambda: driver.connected_watchers, lambda n: n > before, what="watch")
        return watching

    async def _run(self, driver: KubernetesDriver) -> None:
        async for observation in driver.watch():
            self.seen.append(observation)

    def of(self, key: str) -> list[WatchObservation]:
        return [o for o in self.seen if o.key == key]

    async def close(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


def kinds(observations: list[WatchObservation]) -> list[tuple[str, int, str | None]]:
    out: list[tuple[str, int, str | None]] = []
    for o in observations:
        if isinstance(o, RuntimeRemoved):
            out.append(("removed", o.generation, None))
        else:
            assert isinstance(o, RuntimeSnapshot)
            out.append(
                (o.state, o.generation, str(o.exit_code) if o.exit_code is not None else None)
            )
    return out


# -- pure parts -------------------------------------------------------------------------------


def test_a_pod_being_deleted_does_not_lift_an_error_row_to_ready() -> None:
    """Scenario 5 on Kubernetes, at the mechanism: a Pod whose deletion is under way while its
    container still runs (a stop of a sandbox in Error, e.g. the cleanup of a timed-out
    launch) is a stopping runtime, which no phase takes as running: it never makes Ready."""
    h = f.harness_in(Phase.ERROR)
    pod = pod_dict("Running", deleting=True, key=f.KEY, generation=h.row().generation)
    view = read_pod(pod)
    assert view is not None
    decision = h.send(snapshot(view, source="watch"))
    assert (decision.disposition, h.row().phase) == ("ignored", Phase.ERROR)
    assert view.info.state == "stopping"
    for phase in (Phase.READY, Phase.STOPPING, Phase.STOPPED, Phase.PROVISIONING):
        h = f.harness_in(phase)
        pod = pod_dict("Running", deleting=True, key=f.KEY, generation=h.row().generation)
        view = read_pod(pod)
        assert view is not None
        assert h.send(snapshot(view, source="watch")).disposition == "ignored", phase
        assert h.row().phase is phase


def test_a_stopping_pod_is_dated_when_its_stop_began_and_nothing_after_the_readers_clock() -> None:
    """A review found both. A Pod's deletion timestamp is its delete's time plus the grace
    period (when the kubelet will kill), so a stopping runtime was dated up to a grace period
    ahead. And a watch snapshot took the node's times as they were: a node clock ahead of the
    control plane's dated a start after the exit the reconcile loop reported (bounded by its
    own clock), and a start sent again then lifted the Error."""
    pod = pod_dict("Running", deleting=True)  # deletion timestamp 00:01:00
    pod["metadata"]["deletionGracePeriodSeconds"] = 30
    view = read_pod(pod)
    assert view is not None and view.since == datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC)
    running = read_pod(pod_dict("Running"))  # started 00:00:01 by the node's clock
    assert running is not None
    ours = datetime(2026, 1, 1, 0, 0, 0, 500_000, tzinfo=UTC)
    assert snapshot(running, source="watch", now=ours).occurred_at == ours


def test_labels_and_selectors_follow_kubernetes_rules() -> None:
    assert is_label("team", "a-b_c.d") and is_label("example.com/team", "")
    assert not is_label("team", "has space") and not is_label("team", "x" * 64)
    assert not is_label("Bad_Prefix/x", "v")
    assert parse_node_selector(" disk=ssd, zone=a ") == {"disk": "ssd", "zone": "a"}
    assert parse_node_selector("") == {}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_node_selector("disk")


def test_settings_become_the_drivers_configuration(tmp_path: Path) -> None:
    settings = Settings(
        driver="kubernetes", kube_namespace="agents", kube_config=tmp_path / "kc",
        kube_node_selector="disk=ssd", kube_storage_class="fast", kube_cpu_limit="500m",
        kube_service_account="sandboxes", stop_timeout_seconds=7,
    )  # fmt: skip
    driver = driver_from_settings(settings)
    assert isinstance(driver, KubernetesDriver)
    cfg = driver.cfg
    assert (cfg.namespace, cfg.kubeconfig, cfg.storage_class) == ("agents", tmp_path / "kc", "fast")
    assert (cfg.node_selector, cfg.cpu_limit, cfg.stop_timeout) == ({"disk": "ssd"}, "500m", 7.0)
    manifest = pod_manifest(launch_spec("k"), cfg.pod_settings)
    assert manifest["spec"]["nodeSelector"] == {"disk": "ssd"}
    assert manifest["spec"]["serviceAccountName"] == "sandboxes"
    assert manifest["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "500m"}}
    assert describe_driver(settings) == f"kubernetes (namespace agents, {tmp_path / 'kc'})"
    with pytest.raises(ValueError, match="node selector"):
        driver_from_settings(settings.model_copy(update={"kube_node_selector": "ssd"}))
    assert describe_driver(Settings()).startswith("podman (")


def pod_dict(
    phase: str, *, terminated: int | None = None, deleting: bool = False, rv: str = "7",
    key: str = "k", generation: int = 2,
) -> dict[str, Any]:  # fmt: skip
    """A sandstream Pod as the API server sends it (only the fields the driver reads)."""
    spec = launch_spec(key, generation)
    meta: dict[str, Any] = {
        "name": pod_name(key, generation), "uid": "u-1", "resourceVersion": rv,
        "creationTimestamp": "2026-01-01T00:00:00Z", "labels": pod_labels(spec),
    }  # fmt: skip
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    state: dict[str, Any] = {"running": {"startedAt": "2026-01-01T00:00:01Z"}}
    if terminated is not None:
        state = {"terminated": {"exitCode": terminated, "finishedAt": "2026-01-01T00:02:00Z"}}
    status = {"phase": phase, "containerStatuses": [{"name": "sandbox", "state": state}]}
    return {"metadata": meta, "status": status}


def test_pod_phases_container_states_and_deletion_map_to_observations() -> None:
    reported = Reported()  # what one watch stream has reported of each Pod

    def seen(kind: str, pod: dict[str, Any]) -> list[tuple[str, int, str | None]]:
        return kinds(reported.observe(kind, pod))

    pending = pod_dict("Pending")
    pending["status"] = {"phase": "Pending"}
    assert seen("ADDED", pending) == [("created", 2, None)]
    assert seen("MODIFIED", pod_dict("Running")) == [("running", 2, None)]
    assert seen("MODIFIED", pod_dict("Running", rv="8")) == []  # nothing the fold knows changed
    terminating = reported.observe("MODIFIED", pod_dict("Running", deleting=True))
    assert kinds(terminating) == [("stopping", 2, None)]  # the stop in progress
    assert terminating[0].observation_id == "k8s:u-1:7:stopping"
    assert terminating[0].occurred_at.minute == 1  # since the deletion began
    # The final status carried the exit: it is reported before the removal.
    final = reported.observe("DELETED", pod_dict("Failed", terminated=143, rv="9"))
    assert kinds(final) == [("exited", 2, "143"), ("removed", 2, None)]
    assert [o.observation_id for o in final] == ["k8s:u-1:9:exited", "k8s:u-1:9:removed"]
    assert reported.known == {} and reported.shapes == {}
    succeeded = pod_dict("Succeeded")
    succeeded["status"] = {"phase": "Succeeded"}
    assert seen("MODIFIED", succeeded) == [("exited", 2, "0")]
    foreign = pod_dict("Running")
    foreign["metadata"]["labels"] = {"app": "web"}
    assert seen("ADDED", foreign) == []
    # A node that stopped reporting: the Pod may still run, and stop and delete must see it.
    lost = pod_dict("Unknown")
    lost["status"] = {"phase": "Unknown"}
    view = read_pod(lost)
    assert view is not None and (view.info.state, view.info.exit_code) == ("running", None)


# -- against the API server -------------------------------------------------------------------


async def test_launch_makes_one_labelled_pod_and_a_claim_and_is_idempotent(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    assert isinstance(driver, Driver)
    key = keys()
    spec = launch_spec(key, labels={"team": "blue", "note": "not a label value!"},
                       stop_timeout_seconds=3, env={"A": "1"})  # fmt: skip
    result = await driver.launch(spec)
    assert result.started and not result.adopted and result.generation == 1
    assert result.identity == spec.identity

    (pod,) = await admin.pods(ns, key)
    assert pod["metadata"]["name"] == pod_name(key, 1) and phase_of(pod) == "Running"
    labels = pod["metadata"]["labels"]
    assert labels[LABEL_KEY] == key and labels[LABEL_GENERATION] == "1"
    assert labels[LABEL_IDENTITY] == spec.identity and labels[LABEL_STOP_TIMEOUT] == "3"
    assert labels["team"] == "blue" and "note" not in labels  # not a valid label value
    assert '"note": "not a label value!"' in pod["metadata"]["annotations"][ANNOTATION_LABELS]
    assert env_of(pod) == {"A": "1", IDENTITY_ENV: spec.identity}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 3
    assert pod["spec"]["restartPolicy"] == "Never"
    claim = claim_name(key, spec.sandbox_id)
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    assert await admin.claims(ns, key) == [claim]

    again = await driver.launch(spec)
    assert (again.started, again.adopted, again.runtime_id) == (False, True, result.runtime_id)
    assert await admin.pod_names(ns, key) == [pod_name(key, 1)]
    (info,) = await driver.get(key)
    assert (info.generation, info.state, info.identity) == (1, "running", spec.identity)


async def test_provider_values_go_in_a_secret_per_generation_owned_by_its_pod(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    first = replace(
        launch_spec(key, env={"API_KEY": "plain", "OTHER": "x"}),
        secrets={"API_KEY": "sekrit-one", "TOKEN": "sekrit-token"},
    )
    assert (await driver.launch(first)).started
    (pod,) = await admin.pods(ns, key)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    name1 = secret_name(key, 1)
    assert env["API_KEY"] == {
        "name": "API_KEY",
        "valueFrom": {"secretKeyRef": {"name": name1, "key": "API_KEY"}},
    }
    assert env["TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": name1, "key": "TOKEN"}
    assert env["OTHER"]["value"] == "x"
    (secret,) = await admin.secrets(ns, key)
    assert secret["metadata"]["name"] == name1
    assert secret["metadata"]["labels"][LABEL_GENERATION] == "1"
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded == {"API_KEY": "sekrit-one", "TOKEN": "sekrit-token"}
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("Pod", pod["metadata"]["uid"])

    # The next generation gets its own Secret; the replaced one goes with its Pod.
    second = replace(launch_spec(key, 2, first.sandbox_id), secrets={"API_KEY": "sekrit-two"})
    assert (await driver.launch(second)).started
    (secret,) = await admin.secrets(ns, key)
    assert secret["metadata"]["name"] == secret_name(key, 2)
    assert base64.b64decode(secret["data"]["API_KEY"]).decode() == "sekrit-two"
    pods_text = json.dumps(await admin.pods(ns, key))
    assert (await driver.stop(key, 2)).outcome == "succeeded"
    assert await admin.secrets(ns, key) == []

    # A delete removes them too; and no value is in a Pod spec or an event.
    third = replace(launch_spec(key, 3, first.sandbox_id), secrets={"API_KEY": "sekrit-three"})
    await driver.launch(third)
    assert [s["metadata"]["name"] for s in await admin.secrets(ns, key)] == [secret_name(key, 3)]
    pods_text += json.dumps(await admin.pods(ns, key))
    assert await driver.delete(key)
    assert await admin.secrets(ns, key) == []
    seen = pods_text + await admin.events_text(ns)
    for value in ("sekrit-one", "sekrit-token", "sekrit-two", "sekrit-three"):
        assert value not in seen
        assert base64.b64encode(value.encode()).decode() not in seen


async def test_a_pod_removed_by_someone_else_takes_its_secret_along(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    await driver.launch(replace(launch_spec(key), secrets={"API_KEY": "v"}))
    assert len(await admin.secrets(ns, key)) == 1
    await admin.delete_pod_now(ns, pod_name(key, 1))
    # The garbage collector follows the Secret's owner reference to the deleted Pod.
    await eventually(lambda: admin.secrets(ns, key), lambda s: s == [], timeout=60,
                     what="the orphaned Secret collected")  # fmt: skip


async def test_stop_removes_the_pod_and_keeps_the_claim_for_the_next_generation(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    first = launch_spec(key)
    await driver.launch(first)
    stopped = await driver.stop(key, 1)
    assert stopped.outcome == "succeeded"
    assert await admin.pod_names(ns, key) == [] and await driver.get(key) == []
    assert await admin.claims(ns, key) == [claim_name(key, first.sandbox_id)]
    assert (await driver.stop(key, 1)).outcome == "already_absent"

    second = launch_spec(key, generation=2, sandbox_id=first.sandbox_id)
    assert (await driver.launch(second)).started
    (pod,) = await admin.pods(ns, key)
    assert pod["metadata"]["labels"][LABEL_GENERATION] == "2"
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim_name(
        key, first.sandbox_id
    )
    with pytest.raises(DriverError) as superseded:
        await driver.launch(first)
    assert not superseded.value.retryable and "superseded" in superseded.value.reason
    assert superseded.value.observed == "running"


async def test_launch_of_a_new_generation_removes_the_old_pod_first(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    first = launch_spec(key)
    await driver.launch(first)
    await driver.launch(launch_spec(key, generation=2, sandbox_id=first.sandbox_id))
    assert await admin.pod_names(ns, key) == [pod_name(key, 2)]


async def test_delete_removes_pods_and_claims_of_the_incarnation(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    spec = launch_spec(key)
    await driver.launch(spec)
    assert await driver.delete(key, uuid.uuid4()) is False  # another incarnation: untouched
    assert await admin.pod_names(ns, key) == [pod_name(key, 1)]
    assert await driver.delete(key, spec.sandbox_id) is True
    assert await admin.pod_names(ns, key) == [] and await admin.claims(ns, key) == []
    assert await driver.delete(key) is False


async def test_watch_lists_then_reports_start_exit_stop_and_removal(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    done, running = keys(), keys()
    await driver.launch(launch_spec(done))
    watching = await Watching.started(driver)
    try:
        await eventually(lambda: watching.of(done), bool, what="the listing of the first")
        assert watching.of(done)[0].source == "list"

        await driver.launch(launch_spec(running))
        await admin.exit_pod(ns, pod_name(done, 1), 3)
        await eventually(lambda: kinds(watching.of(done)), lambda k: ("exited", 1, "3") in k,
                         what="the exit with its code")  # fmt: skip
        await eventually(lambda: kinds(watching.of(running)), lambda k: ("running", 1, None) in k,
                         what="the second running")  # fmt: skip

        assert (await driver.stop(running, 1)).outcome == "succeeded"
        seen = await eventually(
            lambda: watching.of(running),
            lambda obs: any(isinstance(o, RuntimeRemoved) for o in obs),
            what="the removal",
        )
        # The graceful deletion is seen first (stopping: the stop in progress), then gone.
        terminating = [o for o in seen if o.observation_id.endswith(":stopping")]
        assert [kinds([o]) for o in terminating] == [[("stopping", 1, None)]]
        assert seen.index(terminating[0]) < len(seen) - 1
        assert all(o.occurred_at.tzinfo is not None for o in watching.seen)
        assert len({o.observation_id for o in seen}) == len(seen)
    finally:
        await watching.close()


async def test_a_broken_watch_resumes_from_its_version_without_listing_again(
    driver: KubernetesDriver, admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    await driver.launch(launch_spec(key))
    watching = await Watching.started(driver)
    try:
        await eventually(lambda: watching.of(key), bool, what="the listing")
        driver.reconnect_watchers()
        await admin.exit_pod(ns, pod_name(key, 1), 0)
        await eventually(lambda: kinds(watching.of(key)), lambda k: ("exited", 1, "0") in k,
                         what="the exit after the reconnect")  # fmt: skip
        assert driver.listings == 1
        assert [o.source for o in watching.of(key)] == ["list", "watch"]
    finally:
        await watching.close()


async def test_an_apiserver_restart_is_survived_and_its_410_answered_by_a_relisting(
    admin: Admin, ns: str, keys: Keys, settings: Settings, tmp_path: Path
) -> None:
    """The driver talks to an apiserver of its own, which is killed and restarted; the
    cluster's own apiserver (every other client's) runs on untouched."""
    async with own_apiserver(settings, tmp_path) as server:
        driver = new_driver(admin, ns, kubeconfig=server.kubeconfig)
        try:
            await _restart_survived(driver, server, admin, ns, keys)
        finally:
            await driver.close()


async def _restart_survived(
    driver: KubernetesDriver, server: OwnApiserver, admin: Admin, ns: str, keys: Keys
) -> None:
    exits, stays = keys(), keys()
    await driver.launch(launch_spec(exits))
    await driver.launch(launch_spec(stays))
    watching = await Watching.started(driver)
    try:
        await eventually(lambda: watching.of(stays), bool, what="the listing")
        # A write the Pod watch does not see: the store moves past the watch's version, so the
        # restarted server's watch cache (which starts at the store's version) has expired it.
        await admin.core.create_namespaced_config_map(ns, {"metadata": {"name": keys()}})
        await server.restart()
        await admin.exit_pod(ns, pod_name(exits, 1), 7)  # through the cluster's own apiserver

        await eventually(lambda: kinds(watching.of(exits)), lambda k: ("exited", 1, "7") in k,
                         what="the exit")  # fmt: skip
        await eventually(lambda: driver.listings, lambda n: n == 2, what="a second listing")
        await eventually(lambda: driver.connected_watchers, lambda n: n == 1, what="watching")
        # The relisting reports the untouched sandbox again (same id: it did not change) and
        # the exit once as a change, whichever of the two saw it first.
        stays_ids = [o.observation_id for o in watching.of(stays)]
        assert len(stays_ids) == 2 and len(set(stays_ids)) == 1
        exited = [o for o in watching.of(exits) if kinds([o])[0][0] == "exited"]
        assert len(exited) == 1
    finally:
        await watching.close()


async def test_a_pod_that_never_terminates_delays_no_other_sandbox(
    admin: Admin, ns: str, keys: Keys
) -> None:
    driver = new_driver(admin, ns, removal_margin=60.0)
    stuck, free = keys(), keys()
    try:
        await driver.launch(launch_spec(stuck))
        await admin.hold(ns, pod_name(stuck, 1))
        stopping = asyncio.create_task(driver.stop(stuck, 1))
        await wait_pods(
            admin, ns, stuck, lambda p: bool(p and p[0]["metadata"].get("deletionTimestamp")),
            what="its deletion to begin",
        )  # fmt: skip

        spec = launch_spec(free)
        assert (await driver.launch(spec)).started
        assert (await driver.stop(free, 1)).outcome == "succeeded"
        assert await driver.delete(free) is True
        assert not stopping.done()  # the stuck stop is still waiting: nobody waited for it

        (info,) = await driver.get(stuck)
        assert info.state == "stopping"
        view = read_pod((await admin.pods(ns, stuck))[0])
        assert view is not None and view.terminating
        await admin.release(ns, pod_name(stuck, 1))
        assert (await asyncio.wait_for(stopping, 30)).outcome == "succeeded"
    finally:
        await driver.close()


async def test_the_role_in_compose_is_all_the_driver_needs(
    admin: Admin, keys: Keys, tmp_path: Path
) -> None:
    """The driver runs a whole lifecycle with the token of compose/kubernetes/rbac.yaml's
    ServiceAccount (in a namespace of its own), and that token can do nothing elsewhere."""
    documents = list(
        yaml.safe_load_all((PROJECT_ROOT / "compose/kubernetes/rbac.yaml").read_text())
    )
    assert [d["kind"] for d in documents] == ["ServiceAccount", "Role", "RoleBinding"]
    async with namespace(admin, "rbac") as ns:
        for document in documents:
            document["metadata"]["namespace"] = ns
            for subject in document.get("subjects", []):
                subject["namespace"] = ns
        account, role, binding = documents
        await admin.core.create_namespaced_service_account(ns, account)
        rbac = client.RbacAuthorizationV1Api(admin.api)
        await rbac.create_namespaced_role(ns, role)
        await rbac.create_namespaced_role_binding(ns, binding)
        issued = await admin.core.create_namespaced_service_account_token(
            account["metadata"]["name"], ns, {"spec": {"expirationSeconds": 3600}}
        )
        kubeconfig = yaml.safe_load(admin.kubeconfig.read_text())
        kubeconfig["users"][0]["user"] = {"token": issued.status.token}
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))

        driver = new_driver(admin, ns, kubeconfig=path)
        key = keys()
        try:
            spec = launch_spec(key)
            assert (await driver.launch(spec)).started
            watching = await Watching.started(driver)
            try:
                await eventually(lambda: watching.of(key), bool, what="the listing")
            finally:
                await watching.close()
            assert [r.generation for r in await driver.list()] == [1]
            assert (await driver.stop(key, 1)).outcome == "succeeded"
            assert await driver.claims(key) == [claim_name(key, spec.sandbox_id)]
            with_values = replace(launch_spec(key, 2, spec.sandbox_id), secrets={"K": "v"})
            assert (await driver.launch(with_values)).started
            assert len(await admin.secrets(ns, key)) == 1
            assert await driver.delete(key) is True
            assert await admin.pod_names(ns, key) == [] and await admin.claims(ns, key) == []
            assert await admin.secrets(ns, key) == []
        finally:
            await driver.close()
            await admin.remove_everything_of(ns, key)

        elsewhere = new_driver(admin, "default", kubeconfig=path)
        try:
            with pytest.raises(DriverError, match="403") as forbidden:
                await elsewhere.list()
            assert not forbidden.value.retryable
        finally:
            await elsewhere.close()


async def test_two_drivers_doing_the_same_call_at_once_converge(
    admin: Admin, ns: str, keys: Keys
) -> None:
    """A redelivered intent may run while the first call of it still runs (another executor):
    both launches, both stops and both deletes succeed, and one of each happened."""
    first, second = new_driver(admin, ns), new_driver(admin, ns)
    key = keys()
    try:
        spec = launch_spec(key)
        a, b = await asyncio.gather(first.launch(spec), second.launch(spec))
        assert a.runtime_id == b.runtime_id and a.started
        assert await admin.pod_names(ns, key) == [pod_name(key, 1)]
        assert len(await admin.claims(ns, key)) == 1

        stops = await asyncio.gather(first.stop(key, 1), second.stop(key, 1))
        assert "succeeded" in {s.outcome for s in stops}
        assert {s.outcome for s in stops} <= {"succeeded", "already_absent"}
        assert await admin.pod_names(ns, key) == []

        deletes = await asyncio.gather(first.delete(key), second.delete(key))
        assert True in deletes
        assert await admin.claims(ns, key) == []
    finally:
        await first.close()
        await second.close()


async def test_a_pod_that_outlasts_its_deadlines_fails_the_call_retryably(
    admin: Admin, ns: str, keys: Keys
) -> None:
    """A stop whose Pod is still terminating past grace + margin, and a launch whose Pod is never
    scheduled, fail retryably and say what the backend looks like."""
    driver = new_driver(admin, ns, stop_timeout=0, removal_margin=1.0, launch_timeout=1.0)
    stuck, nowhere = keys(), keys()
    try:
        await driver.launch(launch_spec(stuck))
        await admin.hold(ns, pod_name(stuck, 1))
        with pytest.raises(DriverError) as stop_failed:
            await driver.stop(stuck, 1)
        assert stop_failed.value.retryable and stop_failed.value.observed == "running"
        assert "still terminating" in stop_failed.value.reason
        await admin.release(ns, pod_name(stuck, 1))
        assert (await driver.stop(stuck, 1)).outcome in ("succeeded", "already_absent")

        unschedulable = new_driver(admin, ns, node_selector={"sandstream.test/no": "node"},
                                   launch_timeout=1.0)  # fmt: skip
        try:
            with pytest.raises(DriverError) as launch_failed:
                await unschedulable.launch(launch_spec(nowhere))
            assert launch_failed.value.retryable and launch_failed.value.observed == "created"
            assert "not running 1s after its creation" in launch_failed.value.reason
        finally:
            await unschedulable.close()
    finally:
        await driver.close()


async def test_kill_removes_the_pod_at_once_and_is_not_queued_behind_the_key(
    admin: Admin, ns: str, keys: Keys
) -> None:
    """A kill removes the Pod without grace and returns: it neither waits for the key's lock
    (a stop in progress holds it) nor for a removal it could only miss (the Pod is gone when
    the delete answers; the old code waited out the whole margin for a watch event)."""
    driver = new_driver(admin, ns, removal_margin=600.0)
    key = keys()
    try:
        spec = launch_spec(key, stop_timeout_seconds=600)
        await driver.launch(spec)
        async with driver._lock(key):  # as a stop in progress holds it
            killed = await asyncio.wait_for(driver.kill(key, 1), 30)
        assert killed.outcome == "succeeded" and killed.runtime_id is not None
        assert await admin.pod_names(ns, key) == []
        assert await admin.claims(ns, key) == [claim_name(key, spec.sandbox_id)]
        assert (await driver.kill(key, 1)).outcome == "already_absent"
    finally:
        await driver.close()


async def test_a_pod_being_deleted_with_its_container_running_is_a_stopping_runtime(
    admin: Admin, ns: str, keys: Keys, driver: KubernetesDriver
) -> None:
    """A Pod with a deletion timestamp whose container still runs (a finalizer holds it here;
    a kubelet waiting out the grace period does the same) is reported as stopping by get,
    list and the watch, never as running."""
    key = keys()
    name = pod_name(key, 1)
    watching = await Watching.started(driver)
    try:
        await driver.launch(launch_spec(key))
        await eventually(lambda: kinds(watching.of(key)), lambda k: ("running", 1, None) in k,
                         what="the running Pod watched")  # fmt: skip
        await admin.hold(ns, name)
        await admin.core.delete_namespaced_pod(name, ns, grace_period_seconds=30)
        await eventually(lambda: kinds(watching.of(key)), lambda k: ("stopping", 1, None) in k,
                         what="the Pod being deleted watched as stopping")  # fmt: skip
        assert [(i.generation, i.state) for i in await driver.get(key)] == [(1, "stopping")]
        assert [i.state for i in await driver.list() if i.key == key] == ["stopping"]
        seen = kinds(watching.of(key))
        assert seen[seen.index(("stopping", 1, None)) :].count(("running", 1, None)) == 0
        await admin.release(ns, name)
        await eventually(lambda: kinds(watching.of(key)), lambda k: ("removed", 1, None) in k,
                         what="the Pod's removal watched")  # fmt: skip
    finally:
        await watching.close()
        await admin.release(ns, name)
