"""compose/docker-compose.yml with its TLS override runs with podman-compose, from the image,
against the local stack's Kafka and PostgreSQL in an isolated environment of this test's own
(its topics, groups, schema, ports and compose project): both APIs serve https with a
certificate from compose secrets (signed by a CA of the test's own), a sandbox makes a round
trip through the API, and only the roles that need it hold the credentials key."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
import tlskit
from deploy_support import create_ready, current_image, delete_gone, podman_cli, wait_api_ready
from pipeline_support import PodmanKeys
from podman import PodmanClient

from services.common.settings import PROJECT_ROOT, Settings
from services.localstack.cluster import free_port_run
from services.localstack.compose_env import ComposePorts, compose_env, local_credentials
from services.localstack.image import podman_env
from services.localstack.isolation import isolated
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.openshell_pb2_grpc import OpenShellStub

COMPOSE_FILE = PROJECT_ROOT / "compose" / "docker-compose.yml"
TLS_FILE = PROJECT_ROOT / "compose" / "docker-compose.tls.yml"
IMAGE_UID = 10001  # the image's user: it must own the key file (mode 0600)
KEYED = {"prepare", "api", "openshell", "executor"}

# Minutes on a busy two-core machine: the roles start from the image, one after the other.
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(1200)]


async def test_podman_compose_runs_the_roles_over_tls_and_serves_a_sandbox_round_trip(
    settings: Settings, podman: PodmanClient, tmp_path: Path
) -> None:
    await current_image(settings)
    async with isolated(settings, "pc") as (env, _pool):
        base = free_port_run(7)
        ports = ComposePorts(api=base, openshell=base + 1, health=base + 2)
        project = f"sst-pc-{uuid.uuid4().hex[:6]}"
        variables = compose_env(env, local_credentials(env), ports)
        issued = tlskit.issue_for_localhost(tmp_path)
        os.chown(issued.key, IMAGE_UID, IMAGE_UID)
        tls = {"SANDSTREAM_TLS_CERT_FILE": str(issued.cert),
               "SANDSTREAM_TLS_KEY_FILE": str(issued.key)}  # fmt: skip
        run_env = {**podman_env(env), **variables, **tls}
        # The virtualenv's podman-compose (a dev dependency): CI does not put .venv/bin on the PATH.
        runner = str(Path(sys.executable).with_name("podman-compose"))
        compose = [runner, "--project-name", project,
                   "--file", str(COMPOSE_FILE), "--file", str(TLS_FILE)]  # fmt: skip
        keys = PodmanKeys(podman, "deploy")  # the sandboxes: their containers are the host's
        try:
            started = await asyncio.to_thread(
                subprocess.run, [*compose, "up", "--detach"], env=run_env,
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
            prepared = podman_cli(env, "inspect", "--format", "{{.State.ExitCode}}",
                                  f"{project}_prepare_1")  # fmt: skip
            assert prepared.stdout.strip() == "0", prepared.stderr
            token = _admin_token(env, project)
            async with httpx.AsyncClient(
                base_url=f"https://127.0.0.1:{ports.api}",
                headers={"Authorization": f"Bearer {token}"},
                timeout=90,
                verify=ssl.create_default_context(cafile=str(issued.ca)),
            ) as api:
                await wait_api_ready(api)
                name = keys()
                await create_ready(api, podman, env, name)
                await delete_gone(api, podman, name)
            await _grpc_health_over_tls(f"127.0.0.1:{ports.openshell}", issued.ca.read_bytes())
            for service in KEYED | {"processor", "watcher", "scheduler"}:
                names = _environment(env, f"{project}_{service}_1")
                assert ("SANDSTREAM_CREDENTIALS_KEY" in names) == (service in KEYED), service
        finally:
            try:
                await asyncio.to_thread(
                    subprocess.run, [*compose, "down", "--volumes"], env=run_env,
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
            finally:
                await asyncio.to_thread(keys.cleanup)
        left = podman_cli(env, "ps", "--all", "--filter", f"name={project}", "--format", "json")
        assert json.loads(left.stdout or "[]") == []


def _environment(settings: Settings, container: str) -> set[str]:
    """The names of a container's environment variables."""
    found = podman_cli(settings, "inspect", "--format", "{{json .Config.Env}}", container)
    assert found.returncode == 0, found.stderr
    return {entry.partition("=")[0] for entry in json.loads(found.stdout)}


async def _grpc_health_over_tls(address: str, ca: bytes) -> None:
    """The OpenShell API answers Health over TLS to a client that trusts the CA (it may still
    be starting: the call waits for it)."""
    trusting = grpc.ssl_channel_credentials(root_certificates=ca)
    async with grpc.aio.secure_channel(address, trusting) as channel:
        health = OpenShellStub(channel).Health(pb.HealthRequest(), timeout=90, wait_for_ready=True)
        assert (await health).status == pb.SERVICE_STATUS_HEALTHY


def _admin_token(settings: Settings, project: str) -> str:
    """The admin token prepare wrote into the project's state volume."""
    volume = podman_cli(settings, "volume", "inspect", "--format", "{{.Mountpoint}}",
                        f"{project}_state")  # fmt: skip
    assert volume.returncode == 0, volume.stderr
    path = os.path.join(volume.stdout.strip(), "admin.token")
    with open(path, encoding="utf-8") as token:
        return token.read().strip()
