"""The Helm chart (deploy/helm/sandstream): `helm lint`, what `helm template` renders, and every
rendered object sent to the local kube-apiserver as a server-side apply with dryRun=All and
strict field validation, so each one is valid for the real API (unknown or misplaced fields
included). The rendered Deployments are run for real in tests/test_deploy_kube_play.py."""

from __future__ import annotations

import base64
import json
import ssl
import stat
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import tlskit
import yaml
from chart_support import CHART, ROLES, component, env_of, helm, of_kind, render
from kube_support import admin_client, cluster_kubeconfig, namespace

from services.api.server import Tls
from services.common.settings import PROJECT_ROOT, Settings

REQUIRED = {"kafka": {"bootstrap": "kafka.example:9093"}, "postgres": {"host": "pg.example"}}
# api and processor scale out; watcher, scheduler and provider-sync stand by under their lease
ALL_ROLES = {**REQUIRED, "providerSync": {"enabled": True}}
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "Job": "jobs",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
}


def test_helm_lint_passes_strict(settings: Settings) -> None:
    result = helm(settings, "lint", "--strict", str(CHART), *_set(REQUIRED))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_a_missing_endpoint_fails_the_render_naming_the_value(settings: Settings) -> None:
    result = helm(settings, "template", "sst", str(CHART), *_set({"postgres": {"host": "pg"}}))
    assert result.returncode != 0
    assert "kafka.bootstrap is required" in result.stderr


def test_one_deployment_per_role_with_its_own_kafka_principal(settings: Settings) -> None:
    objects = render(settings, ALL_ROLES)
    deployments = {component(d): d for d in of_kind(objects, "Deployment").values()}
    assert set(deployments) == set(ROLES)
    assert {r: d["spec"]["replicas"] for r, d in deployments.items()} == {
        "api": 2, "processor": 2, "executor": 2, "watcher": 2, "scheduler": 2, "provider-sync": 2,
    }  # fmt: skip
    for role, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        main = pod["containers"][0]
        env = env_of(main)
        assert env["SANDSTREAM_KAFKA_CREDENTIALS"] == {"secret": "sandstream-kafka", "key": role}
        assert env["SANDSTREAM_PG_PASSWORD"] == {"secret": "sandstream-postgres", "key": "password"}
        # the credentials key only where provider values are encrypted or decrypted
        assert ("SANDSTREAM_CREDENTIALS_KEY" in env) == (
            role in ("api", "executor", "provider-sync")
        )
        assert main["args"][0] == role
        port = int(env["SANDSTREAM_HEALTH_PORT"])
        assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
        assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
        assert main["resources"]["requests"]["cpu"] and main["resources"]["requests"]["memory"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert main["securityContext"]["readOnlyRootFilesystem"] is True
        # the tokens file reaches the role through the init step's private copy
        assert env["SANDSTREAM_RUN_DIR"] == "/run/sandstream"
        assert env_of(pod["initContainers"][0])["TOKENS"] == {
            "secret": "sandstream-tokens", "key": "tokens.json",
        }  # fmt: skip
        # the driver's ServiceAccount token only where the driver runs or logs are read
        assert pod["automountServiceAccountToken"] is (
            role in ("api", "executor", "watcher", "provider-sync")
        )


def test_the_api_serves_http_and_openshell_behind_one_service(settings: Settings) -> None:
    objects = render(settings, REQUIRED)
    (service,) = of_kind(objects, "Service").values()
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8787, "grpc": 8788}
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "api"
    api = of_kind(objects, "Deployment")["sst-sandstream-api"]["spec"]["template"]["spec"]
    names = [c["name"] for c in api["containers"]]
    assert names == ["api", "openshell"]
    assert api["containers"][1]["command"] == ["python", "-m", "services.openshell"]


def test_prepare_runs_as_the_admin_principal_before_install_and_upgrade(
    settings: Settings,
) -> None:
    (job,) = of_kind(render(settings, REQUIRED), "Job").values()
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["prepare"]
    assert env_of(container)["SANDSTREAM_KAFKA_CREDENTIALS"]["key"] == "admin"


def test_the_driver_role_is_the_one_of_compose_kubernetes(settings: Settings) -> None:
    (role,) = of_kind(render(settings, REQUIRED), "Role").values()
    compose = yaml.safe_load_all((PROJECT_ROOT / "compose/kubernetes/rbac.yaml").read_text())
    (reference,) = [o for o in compose if o["kind"] == "Role"]
    assert role["rules"] == reference["rules"]


def test_the_podman_driver_mounts_the_socket_into_the_driver_roles_only_run_as_root(
    settings: Settings,
) -> None:
    objects = render(settings, {**REQUIRED, "driver": "podman"})
    assert not of_kind(objects, "Role")
    for deployment in of_kind(objects, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        sockets = [v for v in pod["volumes"] if "hostPath" in v]
        driver_role = component(deployment) in ("executor", "watcher")
        assert bool(sockets) == driver_role
        # root's socket: those two pods run as root, their tokens copy too (root without
        # capabilities can write neither into another user's directory nor read their files)
        assert pod["securityContext"]["runAsUser"] == (0 if driver_role else 10001)
        assert pod["securityContext"]["runAsNonRoot"] is not driver_role


PLACEMENT = {
    "nodeSelector": {"sandstream.dev/real-node": "true"},
    "tolerations": [
        {"key": "sandstream.dev/real-node", "operator": "Equal", "value": "true",
         "effect": "NoSchedule"},
    ],
}  # fmt: skip
API_SERVER = {"kubernetesDriver": {"apiServer": {"host": "127.0.0.1", "port": 16443}}}


def test_the_placement_values_reach_every_role_and_the_prepare_job(settings: Settings) -> None:
    objects = render(settings, {**ALL_ROLES, **PLACEMENT})
    pods = {f"{o['kind']}/{component(o)}": o["spec"]["template"]["spec"]
            for o in objects if o["kind"] in ("Deployment", "Job")}  # fmt: skip
    assert len(pods) == len(ROLES) + 1
    for name, pod in pods.items():
        assert pod.get("nodeSelector") == PLACEMENT["nodeSelector"], name
        assert pod.get("tolerations") == PLACEMENT["tolerations"], name
    # none by default
    for obj in render(settings, ALL_ROLES):
        if obj["kind"] in ("Deployment", "Job"):
            assert not {"nodeSelector", "tolerations"} & set(obj["spec"]["template"]["spec"])


def test_no_pod_gets_the_services_variables_which_read_as_sandstream_settings(
    settings: Settings,
) -> None:
    """The kubelet gives a pod ``<SERVICE>_PORT=tcp://<ip>:<port>`` for every Service of its
    namespace: the release ``sandstream``'s own Service ``sandstream-api`` makes
    SANDSTREAM_API_PORT, which the roles read as their ``api_port`` setting and refused to start
    on (found on the real node)."""
    objects = render(settings, ALL_ROLES, release="sandstream")
    assert "sandstream-api" in of_kind(objects, "Service")
    pods = [o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Deployment", "Job")]
    assert len(pods) == len(ROLES) + 1
    assert all(pod.get("enableServiceLinks") is False for pod in pods)


def test_the_api_server_address_is_given_to_the_containers_with_the_driver_token(
    settings: Settings,
) -> None:
    """Where the pods cannot reach the kubernetes Service (host network, no kube-proxy), the
    roles that use the cluster get the apiserver's address; the others get nothing."""
    for values, expected in ((API_SERVER, {"127.0.0.1", "16443"}), ({}, set())):
        objects = render(settings, {**ALL_ROLES, **values})
        for deployment in of_kind(objects, "Deployment").values():
            pod = deployment["spec"]["template"]["spec"]
            for container in pod["containers"]:
                env = env_of(container)
                found = {env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")}
                wanted = expected if pod["automountServiceAccountToken"] and expected else {None}
                assert found == wanted, (component(deployment), container["name"])


@pytest.mark.parametrize(
    "variant",
    [
        {
            "driver": "kubernetes",
            "providerSync": {"enabled": True},
            "hostNetwork": True,
            **PLACEMENT,
            **API_SERVER,
            "api": {"tls": {"secretName": "sst-tls"}, "forwardedAllowIps": ["10.0.0.0/8"]},
        },
        {"driver": "podman", "hostNetwork": True, "kafka": {"caConfigMap": "kafka-ca"}},
    ],
    ids=["kubernetes", "podman-host-network"],
)
async def test_every_rendered_object_is_valid_for_the_real_api(
    settings: Settings, variant: dict[str, Any]
) -> None:
    async with admin_client(settings) as admin, namespace(admin, "chart") as ns:
        values = {**REQUIRED, **variant}
        values["kafka"] = {**REQUIRED["kafka"], **variant.get("kafka", {})}
        objects = render(settings, values, namespace=ns)
        assert {o["kind"] for o in objects} >= {"Deployment", "Service", "Job", "ServiceAccount"}
        async with _kube_http(cluster_kubeconfig(settings)) as http:
            for obj in objects:
                response = await http.patch(
                    _path(obj, ns),
                    params={"dryRun": "All", "fieldManager": "sst-chart-test",
                            "fieldValidation": "Strict"},
                    content=json.dumps(obj),
                    headers={"Content-Type": "application/apply-patch+yaml"},
                )  # fmt: skip
                assert response.status_code in (200, 201), (
                    f"{obj['kind']}/{obj['metadata']['name']}: {response.text}"
                )
                # a dry run persists nothing
                assert (await http.get(_path(obj, ns))).status_code == 404


def _set(values: dict[str, Any]) -> list[str]:
    return [f"--set-json={k}={json.dumps(v)}" for k, v in values.items()]


def _path(obj: dict[str, Any], default_ns: str) -> str:
    group_version = obj["apiVersion"]
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    ns = obj["metadata"].get("namespace", default_ns)
    return f"{base}/namespaces/{ns}/{PLURALS[obj['kind']]}/{obj['metadata']['name']}"


def _kube_http(kubeconfig: Path) -> httpx.AsyncClient:
    """An HTTP client of the cluster in ``kubeconfig`` (its CA, its bearer token)."""
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    user = config["users"][0]["user"]
    context = ssl.create_default_context(
        cadata=base64.b64decode(cluster["certificate-authority-data"]).decode()
    )
    return httpx.AsyncClient(
        base_url=cluster["server"],
        verify=context,
        headers={"Authorization": f"Bearer {user['token']}"},
        timeout=30,
    )


def _api_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = of_kind(objects, "Deployment")["sst-sandstream-api"]["spec"]["template"]
    return pod["spec"]


def test_tls_from_a_secret_serves_the_api_and_the_grpc_api(
    settings: Settings, tmp_path: Path
) -> None:
    values = {**REQUIRED, "api": {"tls": {"secretName": "sst-tls"},
                                  "forwardedAllowIps": ["10.0.0.0/8", "192.0.2.7"]}}  # fmt: skip
    objects = render(settings, values)
    pod = _api_pod(objects)
    api, openshell = pod["containers"]
    for container in (api, openshell):
        env = env_of(container)
        assert env["SANDSTREAM_API_TLS_CERTFILE"] == "/run/sandstream/tls.crt"
        assert env["SANDSTREAM_API_TLS_KEYFILE"] == "/run/sandstream/tls.key"
    assert env_of(api)["SANDSTREAM_API_FORWARDED_ALLOW_IPS"] == "10.0.0.0/8,192.0.2.7"
    (service,) = of_kind(objects, "Service").values()
    protocols = {p["name"]: p["appProtocol"] for p in service["spec"]["ports"]}
    assert protocols == {"http": "https", "grpc": "grpc"}
    # only the API's pod reads the Secret
    for deployment in of_kind(objects, "Deployment").values():
        text = json.dumps(deployment)
        assert ("sst-tls" in text) == (component(deployment) == "api")
        assert ("SANDSTREAM_API_FORWARDED_ALLOW_IPS" in text) == (component(deployment) == "api")

    # The init step's own script, run here: the files it writes are the pair, mode 0600 (the
    # API refuses a key others can read), and the API's settings accept them.
    (init,) = [c for c in pod["initContainers"] if c["name"] == "tls"]
    assert env_of(init) == {"CERT": {"secret": "sst-tls", "key": "tls.crt"},
                            "KEY": {"secret": "sst-tls", "key": "tls.key"}}  # fmt: skip
    issued = tlskit.issue_for_localhost(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    script = init["command"][2].replace("/run/sandstream", str(run))
    pair = {"CERT": issued.cert.read_text(), "KEY": issued.key.read_text()}
    written = subprocess.run(
        [*init["command"][:2], script], check=False, capture_output=True, text=True,
        env={**pair, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    assert (run / "tls.key").read_bytes() == issued.key.read_bytes()
    assert stat.S_IMODE((run / "tls.key").stat().st_mode) == 0o600
    tls = Tls.of(Settings(api_tls_certfile=run / "tls.crt", api_tls_keyfile=run / "tls.key"))
    assert tls is not None
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.certfile, tls.keyfile)


def test_without_tls_the_api_speaks_http_and_trusts_no_proxy(settings: Settings) -> None:
    objects = render(settings, REQUIRED)
    pod = _api_pod(objects)
    assert [c["name"] for c in pod["initContainers"]] == ["tokens"]
    for container in pod["containers"]:
        assert "SANDSTREAM_API_TLS_CERTFILE" not in env_of(container)
    assert env_of(pod["containers"][0])["SANDSTREAM_API_FORWARDED_ALLOW_IPS"] == ""
    (service,) = of_kind(objects, "Service").values()
    assert service["spec"]["ports"][0]["appProtocol"] == "http"


def test_the_grpc_api_can_stay_plaintext_beside_an_https_api(settings: Settings) -> None:
    values = {**REQUIRED, "api": {"tls": {"secretName": "sst-tls"}, "openshell": {"tls": False}}}
    api, openshell = _api_pod(render(settings, values))["containers"]
    assert "SANDSTREAM_API_TLS_CERTFILE" in env_of(api)
    assert "SANDSTREAM_API_TLS_CERTFILE" not in env_of(openshell)
