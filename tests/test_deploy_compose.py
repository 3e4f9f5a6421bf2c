"""compose/docker-compose.yml runs with podman-compose, from the image, against the local
stack's Kafka and PostgreSQL in an isolated environment of this test's own (its topics, groups,
schema, ports and compose project), and serves a sandbox round trip through its API."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from deploy_support import create_ready, current_image, delete_gone, podman_cli, wait_api_ready
from pipeline_support import PodmanKeys
from podman import PodmanClient

from services.common.settings import PROJECT_ROOT, Settings
from services.localstack.cluster import free_port_run
from services.localstack.compose_env import ComposePorts, compose_env, local_credentials
from services.localstack.image import podman_env
from services.localstack.isolation import isolated

COMPOSE_FILE = PROJECT_ROOT / "compose" / "docker-compose.yml"

# Minutes on a busy two-core machine: the roles start from the image, one after the other.
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(1200)]


async def test_podman_compose_runs_the_roles_and_serves_a_sandbox_round_trip(
    settings: Settings, podman: PodmanClient
) -> None:
    await current_image(settings)
    async with isolated(settings, "pc") as (env, _pool):
        base = free_port_run(7)
        ports = ComposePorts(api=base, openshell=base + 1, health=base + 2)
        project = f"sst-pc-{uuid.uuid4().hex[:6]}"
        variables = compose_env(env, local_credentials(env), ports)
        run_env = {**podman_env(env), **variables}
        # The virtualenv's podman-compose (a dev dependency): CI does not put .venv/bin on the PATH.
        runner = str(Path(sys.executable).with_name("podman-compose"))
        compose = [runner, "--project-name", project, "--file", str(COMPOSE_FILE)]
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
                base_url=f"http://127.0.0.1:{ports.api}",
                headers={"Authorization": f"Bearer {token}"},
                timeout=90,
            ) as api:
                await wait_api_ready(api)
                name = keys()
                await create_ready(api, podman, env, name)
                await delete_gone(api, podman, name)
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


def _admin_token(settings: Settings, project: str) -> str:
    """The admin token prepare wrote into the project's state volume."""
    volume = podman_cli(settings, "volume", "inspect", "--format", "{{.Mountpoint}}",
                        f"{project}_state")  # fmt: skip
    assert volume.returncode == 0, volume.stderr
    path = os.path.join(volume.stdout.strip(), "admin.token")
    with open(path, encoding="utf-8") as token:
        return token.read().strip()
