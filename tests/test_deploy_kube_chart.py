"""The chart installed for real on the local cluster's real node (`make k8s-node`) with the
``kubernetes`` driver: ``helm install`` of the chart from the image (imported into the node's
containerd), the roles as Pods on the host's network against the local stack's Kafka and
PostgreSQL in an isolated environment of this test's own (services/localstack/kube_chart.py
says which values that takes). A sandbox created through the in-cluster API runs as a real Pod
on the same node; its output is read through the HTTP API (the API Pod's token, the chart's Role)
and through OpenShell's gRPC API beside it; it is deleted, and ``helm uninstall`` leaves nothing
of the release."""

from __future__ import annotations

import json
import uuid
from typing import Any

import grpc
import httpx
import pytest
from deploy_support import current_image, wait_api_ready
from harness import eventually
from kube_support import Admin, admin_client, cluster_kubeconfig, namespace

from services.common.settings import Settings
from services.localstack import kube_chart
from services.localstack.cluster import free_port_run
from services.localstack.isolation import isolated
from services.localstack.kube_node import NODE_NAME
from services.localstack.kube_play import PLAYED_ROLES, LocalDeployment, Ports
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

# Minutes on a busy two-core machine: the image's import, then every role's first start.
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(1200)]
START_HINT = "run `make k8s-node` (python -m services.localstack.kubernetes up --real-node)"
INSTANCE, COMPONENT = "app.kubernetes.io/instance", "app.kubernetes.io/component"
API_SERVICE = {"metadata": {"name": "sandstream-api"}, "spec": {"ports": [{"port": 8787}]}}
# An agent that says hello and ends at once on SIGTERM (its trap runs within a second).
AGENT = ["sh", "-c", "trap 'exit 0' TERM; echo hello from the pod; while :; do sleep 1; done"]


async def test_the_chart_on_the_real_node_serves_a_sandbox_pod_and_its_logs(
    settings: Settings,
) -> None:
    await current_image(settings)
    async with admin_client(settings) as admin:
        await _node_ready(admin)
        async with isolated(settings, "kc") as (env, _pool), namespace(admin, "kc") as ns:
            base = free_port_run(2 + len(PLAYED_ROLES))
            ports = Ports(
                api=base,
                openshell=base + 1,
                health={r: base + 2 + i for i, r in enumerate(PLAYED_ROLES)},
            )
            release = f"sst-kc-{uuid.uuid4().hex[:6]}"
            deployment = kube_chart.ClusterDeployment(
                LocalDeployment(env, release=release, ports=ports), ns, cluster_kubeconfig(settings)
            )
            # The Service the release "sandstream" (the docs' name) makes, beside this release:
            # its kubelet variable SANDSTREAM_API_PORT=tcp://... reads as the api_port setting
            await admin.core.create_namespaced_service(ns, API_SERVICE)
            try:
                await kube_chart.up(deployment)  # --wait: every role's Pods Ready
                roles = await _pods(admin, ns, f"{INSTANCE}={release},{COMPONENT}!=prepare")
                assert sorted(_component(p) for p in roles) == sorted(PLAYED_ROLES)
                for pod in roles:
                    assert pod["spec"]["nodeName"] == NODE_NAME, _component(pod)
                    assert pod["spec"]["hostNetwork"] is True
                    assert _ready(pod), json.dumps(pod["status"])
                await _sandbox_round_trip(admin, deployment)
                # every probe held through the round trip: no container was restarted
                for pod in await _pods(admin, ns, f"{INSTANCE}={release},{COMPONENT}!=prepare"):
                    restarts = {c["name"]: c["restartCount"]
                                for c in pod["status"]["containerStatuses"]}  # fmt: skip
                    assert set(restarts.values()) == {0}, (_component(pod), restarts)
            finally:
                await kube_chart.down(deployment)
            assert not deployment.local.home.exists()  # the tokens file and the admin token
            left = await _pods(admin, ns, f"{INSTANCE}={release}")
            assert not left, [p["metadata"]["name"] for p in left]
            secrets = await admin.core.list_namespaced_secret(ns)
            assert not {s.metadata.name for s in secrets.items} & set(
                deployment.local.secret_names().values()
            )


async def _sandbox_round_trip(admin: Admin, deployment: kube_chart.ClusterDeployment) -> None:
    """Create → Ready as a running Pod on the real node → its output through the API →
    delete → the Pod gone."""
    ns, settings = deployment.namespace, deployment.local.settings
    token = deployment.local.admin_token_file.read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(
        base_url=deployment.local.api_url, headers=auth, timeout=90
    ) as api:
        await wait_api_ready(api)
        name = f"kc-{uuid.uuid4().hex[:8]}"
        body = {"name": name, "spec": {"image": settings.sandbox_image, "command": AGENT}}
        created = await api.post("/v1/sandboxes", params={"wait": 60}, json=body)
        assert created.status_code == 201, created.text

        async def phase() -> str | None:
            found = await api.get(f"/v1/sandboxes/{name}")
            return found.json().get("phase") if found.status_code == 200 else None

        await eventually(phase, lambda p: p == "Ready", timeout=120, interval=0.5,
                         what=f"{name} Ready")  # fmt: skip
        (pod,) = await admin.pods(ns, name)
        assert pod["spec"]["nodeName"] == NODE_NAME
        assert pod["status"]["phase"] == "Running"
        (container,) = pod["status"]["containerStatuses"]
        assert "running" in container["state"], container

        async def output() -> list[str]:
            answer = await api.get(f"/v1/sandboxes/{name}/logs")
            assert answer.status_code == 200, answer.text
            return [json.loads(line)["text"] for line in answer.text.splitlines()]

        lines = await eventually(output, bool, timeout=30, interval=0.5, what=f"{name}'s output")
        assert lines == ["hello from the pod"]
        # the same through OpenShell's gRPC API, the API Pod's second container
        assert await _openshell_logs(deployment, token, name) == ["hello from the pod"]

        # a command run in the sandbox's container through the API Pod (pods/exec)
        body = {"command": ["sh", "-c", "echo in $HOSTNAME; exit 3"]}
        ran = await api.post(f"/v1/sandboxes/{name}/exec", json=body)
        assert ran.status_code == 200, ran.text
        assert (ran.json()["exit_code"], ran.json()["stdout"]) == (
            3,
            f"in {name}\n",
        )

        deleted = await api.delete(f"/v1/sandboxes/{name}", params={"wait": 60})
        assert deleted.status_code == 200, deleted.text

        async def status() -> int:
            return (await api.get(f"/v1/sandboxes/{name}")).status_code

        await eventually(status, lambda s: s == 404, timeout=120, interval=0.5,
                         what=f"{name} deleted")  # fmt: skip
        await eventually(lambda: admin.pods(ns, name), lambda found: not found, timeout=60,
                         what=f"{name}'s Pod removed")  # fmt: skip


async def _openshell_logs(
    deployment: kube_chart.ClusterDeployment, token: str, name: str
) -> list[str]:
    request = os1.GetSandboxLogsRequest(
        sandbox=name, workspace_scope=dm1.WorkspaceSelector(workspace="default")
    )
    target = f"127.0.0.1:{deployment.local.ports.openshell}"
    async with grpc.aio.insecure_channel(target) as channel:
        rpc = channel.unary_unary(
            "/openshell.v1.OpenShell/GetSandboxLogs",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=os1.GetSandboxLogsResponse.FromString,
        )
        answer = await rpc(request, metadata=[("authorization", f"Bearer {token}")], timeout=60)
    return [line.message for line in answer.logs]


async def _node_ready(admin: Admin) -> None:
    try:
        node = await admin.core.read_node(NODE_NAME)
    except Exception as exc:
        pytest.fail(f"no real node {NODE_NAME} ({exc!r}); {START_HINT}")
    ready = [c for c in node.status.conditions or [] if c.type == "Ready"]
    if not ready or ready[0].status != "True":
        pytest.fail(f"node {NODE_NAME} is not Ready; {START_HINT}")


async def _pods(admin: Admin, ns: str, selector: str) -> list[dict[str, Any]]:
    answer = await admin.core.list_namespaced_pod(
        ns, label_selector=selector, _preload_content=False
    )
    async with answer:
        items: list[dict[str, Any]] = json.loads(await answer.read())["items"]
    return items


def _component(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"][COMPONENT])


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod["status"].get("conditions") or [])  # fmt: skip
