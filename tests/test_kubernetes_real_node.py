"""The Kubernetes driver on a real node: a kubelet with containerd and runc runs the sandbox
Pods' containers (`python -m services.localstack.kubernetes up --real-node`, `make k8s-node`).

What kwok cannot prove, proven here with real processes: a SIGTERM the agent ignores is
followed by SIGKILL at the end of the grace period, the exit code is the kernel's, a late
status of the kubelet's own stop leaves Stopped alone, logs come from the container's output.
The node is tainted; these tests' Pods tolerate the taint and select the node, so every other
Kubernetes test stays on kwok's node. They fail (never skip) when the node is missing. (Two
tests here need no node: the pure one of tolerations, and the log read kwok's node cannot
serve.)
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import apikit
import factories as f
import httpx
import pytest
import pytest_asyncio
import yaml
from apikit import create_body, unique
from harness import eventually, isolated_env
from kube_support import (
    Admin,
    HoldingDriver,
    admin_fixture,  # noqa: F401  (the module's admin client)
    namespace,
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
    wait_pods,
)
from kubernetes_asyncio import client
from pipeline_support import command, history, running_plane, wait_restart_limit
from test_restart_kubernetes import assert_backoff, decided

from drivers.kube_config import parse_tolerations
from drivers.kube_logs import KubeLogs
from drivers.kube_objects import pod_manifest, pod_name
from drivers.kubernetes import KubernetesDriver
from drivers.logs import LogsUnavailable
from drivers.protocol import LaunchSpec
from events.common import RestartBackoff, SandboxSpec
from events.observations import RuntimeRemoved, RuntimeSnapshot
from events.publisher import now
from services.common.settings import PROJECT_ROOT, Settings
from services.executor.backends import kube_config
from services.localstack import kube_node
from services.localstack.kube_node import NODE_LABEL, NODE_NAME, TAINT, TAINT_KEY

START_HINT = "run `make k8s-node` (python -m services.localstack.kubernetes up --real-node)"
# An agent that ignores SIGTERM: only the SIGKILL at the end of the grace period ends it.
STUBBORN = ["sh", "-c", "trap '' TERM; echo agent up; while :; do sleep 0.2; done"]
IMAGE = Settings().sandbox_image  # imported from Podman into the node's containerd
GRACE = 3  # seconds: the stop's grace period in these tests
SIGKILLED = 137  # 128 + SIGKILL: what the kernel reports for a process ended by SIGKILL


def node_settings(settings: Settings, admin: Admin, ns: str) -> dict[str, Any]:
    """The settings of a plane whose Kubernetes driver (and log source) uses the real node."""
    return {
        "driver": "kubernetes",
        "kube_config": admin.kubeconfig,
        "kube_namespace": ns,
        "kube_node_selector": NODE_LABEL,
        "kube_tolerations": TAINT,
    }


def node_driver(admin: Admin, ns: str) -> KubernetesDriver:
    return new_driver(
        admin, ns,
        node_selector={TAINT_KEY: "true"}, tolerations=parse_tolerations(TAINT),
        launch_timeout=60.0,
    )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="session", name="node")
async def node_fixture(admin: Admin) -> str:
    """The real node's name, once it is Ready (the test fails with the command otherwise)."""
    try:
        found = await admin.core.read_node(NODE_NAME)
    except Exception as exc:
        pytest.fail(f"no real node {NODE_NAME} ({exc!r}); {START_HINT}")
    ready = [c for c in found.status.conditions or [] if c.type == "Ready"]
    if not ready or ready[0].status != "True":
        pytest.fail(f"node {NODE_NAME} is not Ready; {START_HINT}")
    return NODE_NAME


@pytest_asyncio.fixture(loop_scope="session")
async def api(
    settings: Settings, admin: Admin, ns: str, node: str
) -> AsyncIterator[tuple[apikit.Api, HoldingDriver]]:
    driver = HoldingDriver(node_driver(admin, ns))
    update = node_settings(settings, admin, ns)
    try:
        async with apikit.running_api(driver, settings_update=update) as running:
            yield running, driver
    finally:
        await driver.close()


def container_of(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    (status,) = pod["status"]["containerStatuses"]
    return status  # type: ignore[no-any-return]


def test_tolerations_are_parsed_and_go_into_the_pod() -> None:
    assert parse_tolerations(" a=b:NoSchedule, gpu:NoExecute ") == [
        {"key": "a", "effect": "NoSchedule", "operator": "Equal", "value": "b"},
        {"key": "gpu", "effect": "NoExecute", "operator": "Exists"},
    ]
    assert parse_tolerations("") == []
    for bad in ("a=b", "a=b:Sometimes", ":NoSchedule"):
        with pytest.raises(ValueError, match="tolerations: expected KEY"):
            parse_tolerations(bad)
    cfg = kube_config(Settings(driver="kubernetes", kube_tolerations=TAINT))
    spec = LaunchSpec(
        key="k", sandbox_id=uuid.uuid4(), generation=1, identity="rid",
        spec=SandboxSpec(image="x", command=["true"]),
    )  # fmt: skip
    manifest = pod_manifest(spec, cfg.pod_settings)
    assert manifest["spec"]["tolerations"] == [
        {"key": TAINT_KEY, "effect": "NoSchedule", "operator": "Equal", "value": "true"}
    ]


async def test_lifecycle_with_a_real_container_sigkill_after_the_grace_and_its_exit_code(
    api: tuple[apikit.Api, HoldingDriver], admin: Admin, ns: str, node: str
) -> None:
    """create → Ready (a container of the sandbox image runs on the node) → stop, which the
    agent ignores: SIGKILL after the grace period, exit code 137 → start → logs → delete."""
    running, _ = api
    name = unique("rn")
    try:
        async with running.client() as c:
            body = create_body(name, image=IMAGE, command=STUBBORN, stop_timeout_seconds=GRACE)
            created = await c.post("/v1/sandboxes", params={"wait": 60}, json=body)
            assert created.status_code == 201, created.text
            await running.wait_phase(name, "Ready", timeout=60)
            (pod,) = await admin.pods(ns, name)
            assert pod["spec"]["nodeName"] == node
            first = container_of(pod)
            assert first["containerID"].startswith("containerd://") and "running" in first["state"]
            assert await logs_of(c, name, lambda lines: "agent up" in lines) == ["agent up"]

            started = time.monotonic()
            stop = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 60})
            assert stop.status_code == 200, stop.text
            await running.wait_phase(name, "Stopped", timeout=60)
            took = time.monotonic() - started
            assert GRACE <= took < GRACE + 20, took  # SIGTERM ignored: SIGKILL at the end
            # The transition to Stopped carries the kernel's exit code of the SIGKILLed agent
            # (the kubelet's status of the stop, or the stop's own result: whichever came first).
            (into_stopped,) = [
                h["message"] for h in await history(running.env, name)
                if h["disposition"] == "applied" and h["phase"] == "Stopped"
            ]  # fmt: skip
            assert into_stopped["exit_code"] == SIGKILLED, into_stopped
            # The kubelet reports the exit before it has removed the Pod: it goes right after.
            await eventually(lambda: admin.pod_names(ns, name), lambda n: n == [], what="no Pod")

            start = await c.post(f"/v1/sandboxes/{name}:start", params={"wait": 60})
            assert start.status_code == 200 and start.json()["generation"] == 2, start.text
            await running.wait_phase(name, "Ready", timeout=60)
            (pod,) = await admin.pods(ns, name)
            assert container_of(pod)["containerID"] != first["containerID"]

            delete = await c.delete(f"/v1/sandboxes/{name}", params={"wait": 60})
            assert delete.status_code == 200, delete.text
            await running.wait_phase(name, "Deleted", timeout=60)
            assert await admin.pod_names(ns, name) == []
    finally:
        await admin.remove_everything_of(ns, name)


async def test_an_image_that_cannot_be_pulled_fails_the_create_at_once_in_the_kubelets_words(
    api: tuple[apikit.Api, HoldingDriver], admin: Admin, ns: str, node: str
) -> None:
    """The kubelet retries a failed pull for ever (ErrImagePull, then ImagePullBackOff) and the
    Pod stays Pending: the launch waited out its timeout (60 s here, 120 s by default), failed
    as retryable, and the executor tried again, for minutes in all. Now the back-off fails it
    for good with the kubelet's message, and the Pod goes once that is decided: left Pending,
    it held its node's resources and its Secret, and a later pull that worked would have
    lifted the row to Ready by itself (found by a review)."""
    running, _ = api
    name = unique("pull")
    image = "localhost/sandstream-no-such-image:1"
    try:
        async with running.client() as c:
            body = create_body(name, image=image, command=["sleep", "60"])
            created = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert created.status_code == 201, created.text
            await running.wait_phase(name, "Error", timeout=45)  # under the launch's 60 s
            reason = (await c.get(f"/v1/sandboxes/{name}")).json()["reason"]
            assert f"cannot pull image {image!r}" in reason and "ImagePullBackOff" in reason, reason
            await eventually(lambda: admin.pod_names(ns, name), lambda names: names == [],
                             timeout=60, what=f"{name}'s Pending Pod removed")  # fmt: skip
            assert (await c.get(f"/v1/sandboxes/{name}")).json()["phase"] == "Error"
            delete = await c.delete(f"/v1/sandboxes/{name}", params={"wait": 60})
            assert delete.status_code == 200, delete.text
            await running.wait_phase(name, "Deleted", timeout=60)
            assert await admin.pod_names(ns, name) == []
    finally:
        await admin.remove_everything_of(ns, name)


async def logs_of(
    c: httpx.AsyncClient, name: str, done: Callable[[list[str]], bool], timeout: float = 30.0
) -> list[str]:
    """The sandbox's log lines through the HTTP API, once ``done(lines)`` holds."""

    async def read() -> list[str]:
        answer = await c.get(f"/v1/sandboxes/{name}/logs")
        assert answer.status_code == 200, answer.text
        return [json.loads(line)["text"] for line in answer.text.splitlines()]

    lines: list[str] = await eventually(read, done, timeout=timeout, what=f"{name}'s log")
    return lines


async def test_an_agents_own_exit_is_an_error_with_the_kernels_exit_code(
    api: tuple[apikit.Api, HoldingDriver], admin: Admin, ns: str, node: str
) -> None:
    running, _ = api
    name = unique("rx")
    try:
        async with running.client() as c:
            body = create_body(name, image=IMAGE, command=["sh", "-c", "echo bye; sleep 1; exit 7"])
            created = await c.post("/v1/sandboxes", params={"wait": 60}, json=body)
            assert created.status_code == 201, created.text
            await running.wait_phase(name, "Error", timeout=60)
            row = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert row["exit_code"] == 7, row
            (pod,) = await admin.pods(ns, name)
            assert container_of(pod)["state"]["terminated"]["exitCode"] == 7
            assert await logs_of(c, name, lambda lines: "bye" in lines) == ["bye"]
    finally:
        await admin.remove_everything_of(ns, name)


async def test_the_kubelets_late_stop_status_leaves_stopped_alone(
    api: tuple[apikit.Api, HoldingDriver], admin: Admin, ns: str, node: str
) -> None:
    """Scenario 5 on a real node: the watch's reports of the stop (the kubelet's terminating
    status with the SIGKILLed container, then the Pod's deletion) are held back and delivered
    only after the row reached Stopped; they are ignored, and a start still recovers it."""
    running, driver = api
    name = unique("r5")
    try:
        async with running.client() as c:
            body = create_body(name, image=IMAGE, command=STUBBORN, stop_timeout_seconds=GRACE)
            created = await c.post("/v1/sandboxes", params={"wait": 60}, json=body)
            assert created.status_code == 201, created.text
            await running.wait_phase(name, "Ready", timeout=60)

            driver.hold(name)
            stop = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 60})
            assert stop.status_code == 200, stop.text
            await running.wait_phase(name, "Stopped", timeout=60)
            stopped = (await c.get(f"/v1/sandboxes/{name}")).json()
            await eventually(lambda: driver.held_of(name),
                             lambda held: any(isinstance(o, RuntimeRemoved) for o in held),
                             what="the held deletion")  # fmt: skip
            late = driver.release(name)
            # The kubelet's own status of the stop is among them: the container SIGKILLed.
            codes = {o.exit_code for o in late if isinstance(o, RuntimeSnapshot)}
            assert SIGKILLED in codes, late
            late_ids = {o.observation_id for o in late}

            async def recorded() -> list[dict[str, Any]]:
                return [
                    h for h in await history(running.env, name)
                    if h["message"] and h["message"].get("observation_id") in late_ids
                ]  # fmt: skip

            entries = await eventually(recorded, lambda hs: len(hs) == len(late),
                                       what="the late reports in the history")  # fmt: skip
            assert {h["disposition"] for h in entries} == {"ignored"}
            assert {h["phase"] for h in entries} == {"Stopped"}
            after = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert (after["phase"], after["version"]) == ("Stopped", stopped["version"])

            start = await c.post(f"/v1/sandboxes/{name}:start", params={"wait": 60})
            assert start.status_code == 200, start.text
            await running.wait_phase(name, "Ready", timeout=60)
            assert [(r.generation, r.state) for r in await driver.get(name)] == [(2, "running")]
    finally:
        await admin.remove_everything_of(ns, name)


def test_the_nodes_files_live_in_its_folder_and_the_kubelet_allows_cgroup_v1(
    tmp_path: Path,
) -> None:
    settings = Settings(state_dir=tmp_path / "state", kube_home=tmp_path / "cache")
    p = kube_node.paths(settings)
    assert p.home == tmp_path / "state" / "kubernetes" / "node"
    toml = kube_node.containerd_config(p)
    quoted = re.findall(r'"(/[^"]*)"', toml)
    assert quoted and all(Path(q).is_relative_to(p.home) or q == "/usr/lib/cni" for q in quoted)
    assert "SystemdCgroup = false" in toml and "restrict_oom_score_adj = true" in toml
    config = kube_node.kubelet_config(settings, p)
    assert (config["failCgroupV1"], config["cgroupDriver"]) == (False, "cgroupfs")
    assert (config["address"], config["port"]) == (settings.kube_node_ip, 16250)
    taint = {"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}
    assert config["registerWithTaints"] == [taint]
    command = kube_node.kubelet_command(settings, p)
    assert Path(command[0]).is_relative_to(tmp_path / "cache")
    assert f"--hostname-override={NODE_NAME}" in command


async def test_provider_values_reach_the_agent_from_its_secret_and_the_next_generation_new_ones(
    admin: Admin, ns: str, node: str
) -> None:
    """The container's env takes the provider value from the generation's Secret
    (``secretKeyRef``, resolved by the kubelet); the next generation (a rotation's restart)
    runs with the new value, and the old Pod and Secret are gone."""
    driver = node_driver(admin, ns)
    logs = KubeLogs(driver.cfg)
    key = unique("rs")
    show = ["sh", "-c", 'echo "key=$API_KEY"; while :; do sleep 1; done']
    first = LaunchSpec(
        key=key, sandbox_id=uuid.uuid4(), generation=1, identity="rid-1",
        spec=SandboxSpec(image=IMAGE, command=show), secrets={"API_KEY": "value-one"},
    )  # fmt: skip
    second = replace(first, generation=2, identity="rid-2", secrets={"API_KEY": "value-two"})
    try:
        for spec, value in ((first, "value-one"), (second, "value-two")):
            assert (await driver.launch(spec)).started
            lines = await eventually(
                functools.partial(read_lines, logs, key, spec.generation),
                bool, what=f"generation {spec.generation}'s output",
            )  # fmt: skip
            assert lines == [f"key={value}"]
        (pod,) = await admin.pods(ns, key)
        assert pod["metadata"]["name"].endswith("-g2")
        env = pod["spec"]["containers"][0]["env"]
        assert {"name": "API_KEY", "valueFrom": {"secretKeyRef": {
            "name": f"sandstream-{key}-g2", "key": "API_KEY"}}} in env  # fmt: skip
        assert [s["metadata"]["name"] for s in await admin.secrets(ns, key)] == [
            f"sandstream-{key}-g2"
        ]
    finally:
        await admin.remove_everything_of(ns, key)
        await logs.close()
        await driver.close()


async def read_lines(logs: KubeLogs, key: str, generation: int) -> list[str]:
    return [line.text async for line in logs.read(key, generation)]


async def test_a_held_deletion_delays_no_other_sandbox_on_the_node(
    admin: Admin, ns: str, node: str
) -> None:
    """A Pod whose deletion a finalizer holds: the kubelet ends its container (SIGKILL after
    the grace the agent ignores), the Pod stays; meanwhile another sandbox launches, stops
    and is deleted with real containers. Released, the held stop returns the exit code."""
    driver = node_driver(admin, ns)
    stuck, free = unique("rh"), unique("rf")
    polite = ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 0.2; done"]

    def spec_of(key: str, command: list[str]) -> LaunchSpec:
        return LaunchSpec(
            key=key, sandbox_id=uuid.uuid4(), generation=1, identity=f"rid-{key}",
            spec=SandboxSpec(image=IMAGE, command=command, stop_timeout_seconds=GRACE),
        )  # fmt: skip

    try:
        assert (await driver.launch(spec_of(stuck, STUBBORN))).started
        await admin.hold(ns, pod_name(stuck, 1))
        stopping = asyncio.create_task(driver.stop(stuck, 1))
        await wait_pods(
            admin, ns, stuck, lambda p: bool(p and p[0]["metadata"].get("deletionTimestamp")),
            what="its deletion to begin",
        )  # fmt: skip

        started = time.monotonic()
        assert (await driver.launch(spec_of(free, polite))).started
        assert (await driver.stop(free, 1)).outcome == "succeeded"
        assert await driver.delete(free) is True
        assert not stopping.done()  # the held stop still waits: nobody waited for it
        assert time.monotonic() - started < 30

        # The kubelet has ended the held Pod's container; only the finalizer keeps the Pod.
        (held,) = await wait_pods(
            admin, ns, stuck,
            lambda p: "terminated" in container_of(p[0])["state"], what="its container ended",
        )  # fmt: skip
        assert container_of(held)["state"]["terminated"]["exitCode"] == SIGKILLED
        await admin.release(ns, pod_name(stuck, 1))
        result = await asyncio.wait_for(stopping, 30)
        assert (result.outcome, result.exit_code) == ("succeeded", SIGKILLED)
    finally:
        for key in (stuck, free):
            await admin.remove_everything_of(ns, key)
        await driver.close()


async def test_on_failure_restarts_a_real_exit_with_its_back_off_until_the_limit(
    admin: Admin, ns: str, node: str
) -> None:
    """The agent exits 1 by itself a second after it starts (the kubelet reports the exit):
    restarted after 0.5 s, then 1 s, then the limit leaves the row in Error with code 1."""
    driver = node_driver(admin, ns)
    key = unique("rb")
    sandbox = SandboxSpec(
        image=IMAGE, command=["sh", "-c", "echo try; sleep 1; exit 1"],
        restart_policy="OnFailure", max_restarts=2,
        restart_backoff=RestartBackoff(initial_seconds=0.5, max_seconds=1.0),
    )  # fmt: skip
    try:
        async with (
            isolated_env(scheduler_poll_seconds=0.5) as env,
            running_plane(env, driver, with_scheduler=True, reconcile_interval=3600),
            await env.publisher() as pub,
        ):
            await command(env, pub, f.create(key, sandbox_spec=sandbox, occurred_at=now()))
            row = await wait_restart_limit(env, key, 120)
            assert (row["phase"], row["generation"], row["exit_code"]) == ("Error", 3, 1)
            assert_backoff(await decided(env, key, "SandboxRestartsExhausted"), "OnFailure",
                           [0.5, 1.0])  # fmt: skip
            (pod,) = await admin.pods(ns, key)
            assert pod["spec"]["nodeName"] == node
            assert container_of(pod)["state"]["terminated"]["exitCode"] == 1
    finally:
        await admin.remove_everything_of(ns, key)
        await driver.close()


async def test_the_role_in_compose_reads_a_real_pods_log(
    admin: Admin, node: str, tmp_path: Path
) -> None:
    """compose/kubernetes/rbac.yaml's account (the chart's Role is the same) reads a sandbox's
    output through pods/log: what the API role needs for logs in-cluster."""
    documents = list(
        yaml.safe_load_all((PROJECT_ROOT / "compose/kubernetes/rbac.yaml").read_text())
    )
    async with namespace(admin, "rbac-logs") as ns:
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
        driver = node_driver(admin, ns)
        logs = KubeLogs(replace(driver.cfg, kubeconfig=path))
        key = unique("rl")
        try:
            spec = LaunchSpec(
                key=key, sandbox_id=uuid.uuid4(), generation=1, identity="rid",
                spec=SandboxSpec(image=IMAGE, command=["sh", "-c", "echo hello; sleep 3600"]),
            )  # fmt: skip
            assert (await driver.launch(spec)).started
            lines = await eventually(
                functools.partial(read_lines, logs, key, 1), bool, what="the output"
            )
            assert lines == ["hello"]
        finally:
            await admin.remove_everything_of(ns, key)
            await logs.close()
            await driver.close()


async def test_a_log_the_cluster_cannot_serve_is_unavailable_never_a_line(
    admin: Admin, ns: str
) -> None:
    """On kwok's node (no kubelet serves logs) the apiserver answers an error: the read
    raises LogsUnavailable with it (it once yielded the error's Status object as a log line,
    which the API then served as the sandbox's output)."""
    driver = new_driver(admin, ns)  # kwok's node
    logs = KubeLogs(driver.cfg)
    key = unique("kl")
    try:
        spec = LaunchSpec(
            key=key, sandbox_id=uuid.uuid4(), generation=1, identity="rid",
            spec=SandboxSpec(image=IMAGE, command=["sleep", "3600"]),
        )  # fmt: skip
        assert (await driver.launch(spec)).started
        with pytest.raises(LogsUnavailable, match="serves no log of Pod") as unavailable:
            await read_lines(logs, key, 1)
        assert '"kind":"Status"' not in str(unavailable.value)
        assert await read_lines(logs, key, 2) == []  # no Pod of that generation: no lines
    finally:
        await admin.remove_everything_of(ns, key)
        await logs.close()
        await driver.close()
