"""Run the Helm chart's rendered Deployments on this machine with ``podman kube play``, from the
image (`make image`), against the local stack's Kafka and PostgreSQL.

    python -m services.localstack.kube_play up | down

``up`` creates the chart's Secrets as Podman secrets (each role's SCRAM credential from the
local stack's credentials file, the PostgreSQL password, a new credentials key, a new tokens
file whose admin token it writes to ``<state_dir>/kube-play/<release>/admin.token``), renders the
chart with ``helm template`` for the Podman driver on the host network, runs the prepare Job's
Pod, then plays the Deployments. docs/deploy.md says how; tests/test_deploy_kube_play.py runs it
in an isolated environment of its own.

Where kube play (Podman 4.3) cannot express the chart, and what is done instead:

- A Job is no kind it plays: the prepare Job's Pod template is played as a Pod, and waited for.
- Secrets: its ``secretKeyRef`` reads a Podman secret holding JSON of base64 values (a Secret
  object in the YAML is stored in another form that only volumes read), so the secrets are made
  with ``podman secret create`` in that form. The chart uses no Secret volumes.
- Services, the ServiceAccount and the Role are not played: there is no cluster network, the
  Podman driver needs no RBAC, and the API listens on the host's loopback.
- The host network (the containers reach Kafka and PostgreSQL on 127.0.0.1, the address Kafka
  advertises): every process on it needs ports of its own, so each role gets its own health port
  and replicas of one Deployment would collide; a further processor is a second release with
  only the processor, on another health port (``processor_release``). And kube play publishes
  every ``containerPort`` as a host port, which the host network refuses: the played manifests
  leave the (informational) ``ports`` lists out (``for_podman``).
- emptyDir: kube play 4.3 makes a Podman volume named after the pod's volume, and a second
  pod with a volume of that name (every role's "run", in every release) gets the same one:
  the played objects name each emptyDir after its Deployment or Pod.
- Init containers: kube play 4.3 removes a run-once init container right after it ran and can
  fail doing so ("cannot remove container ... as it is running"); the played objects ask for
  init containers that stay (``io.podman.annotations.init.container.type: always``), which
  run again whenever the pod starts, as the tokens step may.
- Restart policy: kube play 4.3 gives every container of a pod the pod's ``restartPolicy``,
  init containers included, so under a Deployment's ``Always`` the tokens step restarted as
  soon as it exited, several times a second, rewriting the tokens file under the running
  roles (which then refused every token while they read it half-written). The played pods
  restart ``OnFailure``: an init step that succeeded stays exited, a role that fails (exit
  code not 0) is restarted, and a role exits 0 only when it was told to stop.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.common.kafka_clients import ROLES, load_credentials
from services.common.settings import PROJECT_ROOT, Settings, load_settings
from services.common.tokens import ensure_tokens
from services.localstack.helm_build import helm_path
from services.localstack.image import IMAGE_REPOSITORY, podman_env, project_version

CHART = PROJECT_ROOT / "deploy" / "helm" / "sandstream"
PREPARE_TIMEOUT = 300.0
# The roles whose Deployments play (provider-sync needs Kubernetes Secrets to read).
PLAYED_ROLES = ("api", "processor", "executor", "watcher", "scheduler")


class PlayError(RuntimeError):
    """A step failed; the message says which and carries its output."""


@dataclass(frozen=True)
class Ports:
    api: int = 8787
    openshell: int = 8788
    # health ports by role, and of the second processor
    health: Mapping[str, int] = field(
        default_factory=lambda: {r: 9101 + i for i, r in enumerate(PLAYED_ROLES)}
    )
    second_processor: int = 9110


@dataclass(frozen=True)
class LocalDeployment:
    """One release of the chart on Podman: its names, ports and files."""

    settings: Settings
    release: str = "sandstream"
    ports: Ports = Ports()

    @property
    def home(self) -> Path:
        return self.settings.state_dir / "kube-play" / self.release

    @property
    def admin_token_file(self) -> Path:
        return self.home / "admin.token"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.api}"

    def secret_names(self) -> dict[str, str]:
        return {
            "kafka": f"{self.release}-kafka",
            "postgres": f"{self.release}-postgres",
            "key": f"{self.release}-credentials-key",
            "tokens": f"{self.release}-tokens",
        }

    def pod(self, role: str, index: int = 0, release: str | None = None) -> str:
        """The Podman pod of a role's replica (kube play names it after the Deployment)."""
        return f"{_fullname(release or self.release)}-{role}-pod-{index}"

    def container(self, role: str, index: int = 0, release: str | None = None) -> str:
        return f"{self.pod(role, index, release)}-{role}"

    @property
    def processor_release(self) -> str:
        return f"{self.release}-p2"


def _fullname(release: str) -> str:
    """The chart's sandstream.fullname helper."""
    name = release if "sandstream" in release else f"{release}-sandstream"
    return name[:40].rstrip("-")


# --------------------------------------------------------------------------- pure parts


def chart_values(deployment: LocalDeployment, version: str) -> dict[str, Any]:
    """The chart's values for the local stack: Podman driver, host network, one replica each."""
    s, ports, names = deployment.settings, deployment.ports, deployment.secret_names()
    one: dict[str, dict[str, Any]] = {
        r: {"replicas": 1, "healthPort": ports.health[r]} for r in PLAYED_ROLES
    }
    one["api"] |= {"port": ports.api, "openshell": {"port": ports.openshell}}
    return {
        "image": {"repository": IMAGE_REPOSITORY, "tag": version, "pullPolicy": "Never"},
        "kafka": {
            "bootstrap": s.kafka_bootstrap,
            "securityProtocol": s.kafka_security_protocol,
            "saslMechanism": s.kafka_sasl_mechanism,
            "partitions": s.kafka_partitions,
            "credentialsSecret": names["kafka"],
            "topics": {
                "commands": s.topic_commands,
                "observations": s.topic_observations,
                "events": s.topic_events,
                "deadletter": s.topic_deadletter,
            },
            "groups": {"processor": s.processor_group, "executor": s.executor_group},
        },
        "postgres": {
            "host": s.pg_host,
            "port": s.pg_port,
            "database": s.pg_database,
            "user": s.pg_user,
            "schema": s.pg_schema,
            "sslmode": s.pg_sslmode,
            "passwordSecret": {"name": names["postgres"], "key": "password"},
        },
        "credentialsKeySecret": {"name": names["key"], "key": "key"},
        "tokensSecret": {"name": names["tokens"], "key": "tokens.json"},
        "driver": "podman",
        "podmanDriver": {"socket": str(s.podman_socket_path)},
        "hostNetwork": True,
        **one,
    }


def second_processor_values(deployment: LocalDeployment) -> dict[str, Any]:
    """Overrides of chart_values for the release with only a further processor."""
    off = {r: {"enabled": False} for r in PLAYED_ROLES if r != "processor"}
    return {
        **off,
        "prepare": {"enabled": False},
        "processor": {"replicas": 1, "healthPort": deployment.ports.second_processor},
    }


def podman_secret(data: Mapping[str, str]) -> str:
    """A Podman secret's content as kube play 4.3 reads a secretKeyRef: JSON of base64 values."""
    return json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in data.items()})


def job_as_pod(job: Mapping[str, Any]) -> dict[str, Any]:
    """A Job's Pod template as a Pod (kube play runs Pods, not Jobs)."""
    template = job["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": job["metadata"]["name"], "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
    }


INIT_TYPE = "io.podman.annotations.init.container.type"


def for_podman(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A Deployment or Pod as kube play runs it on the host network: no ``ports`` lists, init
    containers that stay, a Deployment's pods restarted on failure only, emptyDirs named after
    their pod."""
    out: dict[str, Any] = json.loads(json.dumps(obj))
    spec = out["spec"]["template"]["spec"] if out["kind"] == "Deployment" else out["spec"]
    if out["kind"] == "Deployment":
        spec["restartPolicy"] = "OnFailure"
    for container in spec["containers"]:
        container.pop("ports", None)
    out["metadata"].setdefault("annotations", {})[INIT_TYPE] = "always"
    own = {v["name"]: f"{out['metadata']['name']}-{v['name']}" for v in spec.get("volumes", [])
           if "emptyDir" in v}  # fmt: skip
    for volume in spec.get("volumes", []):
        volume["name"] = own.get(volume["name"], volume["name"])
    for container in (*spec["containers"], *spec.get("initContainers", [])):
        for mount in container.get("volumeMounts", []):
            mount["name"] = own.get(mount["name"], mount["name"])
    return out


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in, key by key (nested mappings merged too)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------- steps


def up(deployment: LocalDeployment, *, second_processor: bool = False) -> None:
    """Secrets, the prepare Pod (waited for), then the Deployments; a second processor release
    too when asked."""
    settings = deployment.settings
    deployment.home.mkdir(parents=True, exist_ok=True)
    _create_secrets(deployment)
    values = chart_values(deployment, project_version())
    objects = render(settings, deployment.release, values)
    jobs = [o for o in objects if o["kind"] == "Job"]
    plays = [o for o in objects if o["kind"] == "Deployment"]
    if second_processor:
        extra = merged(values, second_processor_values(deployment))
        plays += [
            o
            for o in render(settings, deployment.processor_release, extra)
            if o["kind"] == "Deployment"
        ]
    for job in jobs:
        pod = job_as_pod(job)
        _play(deployment, f"{pod['metadata']['name']}.yaml", [pod])
        _wait_exit(settings, f"{pod['metadata']['name']}-prepare", PREPARE_TIMEOUT)
    _play(deployment, "deployments.yaml", plays)


def down(deployment: LocalDeployment) -> None:
    """Remove the pods ``up`` played (by name, also after a failed play) and the secrets."""
    record = deployment.home / "pods.json"
    pods = json.loads(record.read_text()) if record.exists() else []
    if pods:
        _podman(deployment.settings, ["pod", "rm", "--force", "--ignore", *pods], check=False)
    for name in deployment.secret_names().values():
        _podman(deployment.settings, ["secret", "rm", name], check=False)
    shutil.rmtree(deployment.home, ignore_errors=True)  # the tokens file, the admin token


def pod_names(objects: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pods kube play makes of ``objects``: a Pod's name, ``<deployment>-pod-<i>``."""
    names = []
    for obj in objects:
        name = obj["metadata"]["name"]
        if obj["kind"] == "Pod":
            names.append(name)
        else:
            names += [f"{name}-pod-{i}" for i in range(obj["spec"].get("replicas", 1))]
    return names


def render(settings: Settings, release: str, values: Mapping[str, Any]) -> list[dict[str, Any]]:
    helm = helm_path(settings)
    if not helm.exists():
        raise PlayError(f"no helm at {helm}: run `make helm`")
    args = [f"--set-json={k}={json.dumps(v)}" for k, v in values.items()]
    result = subprocess.run(
        [str(helm), "template", release, str(CHART), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise PlayError(f"helm template failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def secret_data(deployment: LocalDeployment) -> dict[str, dict[str, str]]:
    """The chart's Secrets by name, each key's value: every role's SCRAM credential from the
    local stack's credentials file, the PostgreSQL password, a new credentials key, and a new
    tokens file (its admin token written to ``admin_token_file``)."""
    settings, names = deployment.settings, deployment.secret_names()
    deployment.home.mkdir(parents=True, exist_ok=True)
    credentials = load_credentials(settings)
    kafka: dict[str, str] = {
        role: json.dumps({role: {"username": c.username, "password": c.password}})
        for role, c in credentials.items()
        if role in ROLES
    }
    password = settings.pg_password.get_secret_value() if settings.pg_password else ""
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    tokens = ensure_tokens(settings.model_copy(update={"run_dir": deployment.home}))
    return {
        names["kafka"]: kafka,
        names["postgres"]: {"password": password},
        names["key"]: {"key": key},
        names["tokens"]: {"tokens.json": tokens.tokens_file.read_text()},
    }


def _create_secrets(deployment: LocalDeployment) -> None:
    settings = deployment.settings
    for name, data in secret_data(deployment).items():
        _podman(settings, ["secret", "rm", name], check=False)
        path = deployment.home / f".{name}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(podman_secret(data))
        try:
            _podman(settings, ["secret", "create", name, str(path)])
        finally:
            path.unlink()


def _play(deployment: LocalDeployment, name: str, objects: Sequence[Mapping[str, Any]]) -> None:
    record = deployment.home / "pods.json"
    known = json.loads(record.read_text()) if record.exists() else []
    record.write_text(json.dumps(sorted({*known, *pod_names(objects)})))
    path = deployment.home / name
    path.write_text(yaml.safe_dump_all([for_podman(o) for o in objects], sort_keys=False))
    _podman(deployment.settings, ["kube", "play", "--replace", str(path)])


def _wait_exit(settings: Settings, container: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        state = _podman(
            settings,
            ["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container],
        ).split()
        if state[0] in ("exited", "stopped"):
            if state[1] != "0":
                logs = _podman(settings, ["logs", container], check=False)
                raise PlayError(f"{container} exited with {state[1]}:\n{logs[-3000:]}")
            return
        if time.monotonic() > deadline:
            raise PlayError(f"{container} still {state[0]} after {timeout:.0f}s")
        time.sleep(0.5)  # the poll interval; the deadline above bounds the wait


def _podman(settings: Settings, args: list[str], *, check: bool = True) -> str:
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=podman_env(settings), check=False
    )
    if check and result.returncode != 0:
        raise PlayError(f"podman {' '.join(args[:2])} failed:\n{result.stderr.strip()}")
    return result.stdout + result.stderr


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.localstack.kube_play")
    parser.add_argument("action", choices=["up", "down"])
    args = parser.parse_args(argv)
    deployment = LocalDeployment(load_settings())
    try:
        if args.action == "up":
            up(deployment)
            print(f"sandstream from the image: API {deployment.api_url}, "
                  f"OpenShell 127.0.0.1:{deployment.ports.openshell}, "
                  f"admin token {deployment.admin_token_file}")  # fmt: skip
        else:
            down(deployment)
    except PlayError as exc:
        print(f"kube play: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
