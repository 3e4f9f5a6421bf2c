"""The chart's rendered Deployments run for real: `podman kube play` of `helm template`'s
output (services/localstack/kube_play.py says what kube play cannot express and what is done
instead), from the image, against the local stack's Kafka and PostgreSQL in an isolated
environment of this test's own. The Podman driver runs sandboxes as sibling containers on the
host's Podman, through its socket mounted into the executor and the watcher."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from typing import Any

import httpx
import pytest
from deploy_support import create_ready, current_image, delete_gone, podman_cli, wait_api_ready
from harness import eventually
from pipeline_support import PodmanKeys
from podman import PodmanClient

from services.common.entrypoint import EXIT_STOPPED
from services.common.settings import Settings
from services.localstack import kube_play
from services.localstack.cluster import free_port_run
from services.localstack.isolation import isolated

# Minutes on a busy two-core machine: the roles start from the image, one after the other.
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(1200)]


async def test_the_chart_on_podman_serves_a_sandbox_and_a_stopped_processor_hands_over(
    settings: Settings, podman: PodmanClient
) -> None:
    await current_image(settings)
    async with isolated(settings, "kp") as (env, _pool):
        base = free_port_run(9)
        ports = kube_play.Ports(
            api=base,
            openshell=base + 1,
            health={r: base + 2 + i for i, r in enumerate(kube_play.PLAYED_ROLES)},
            second_processor=base + 8,
        )
        deployment = kube_play.LocalDeployment(
            env, release=f"sst-kp-{uuid.uuid4().hex[:6]}", ports=ports
        )
        keys = PodmanKeys(podman, "deploy")  # the sandboxes: their containers are the host's
        try:
            await asyncio.to_thread(kube_play.up, deployment, second_processor=True)
            token = deployment.admin_token_file.read_text().strip()
            auth = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(
                base_url=deployment.api_url, headers=auth, timeout=90
            ) as api:
                await wait_api_ready(api)
                first = f"http://127.0.0.1:{ports.health['processor']}"
                second = f"http://127.0.0.1:{ports.second_processor}"
                every = env.kafka_partitions
                shares = await eventually(
                    lambda: _partitions(api, first, second),
                    lambda s: bool(s[0]) and bool(s[1]) and len(s[0] | s[1]) == every,
                    timeout=120, interval=0.5, what="two processors sharing the partitions",
                )  # fmt: skip
                assert not shares[0] & shares[1]
                # Every pod's tokens step ran once and stayed exited: restarted under the
                # running roles, it rewrote their tokens file and they refused every token.
                for release, role in _played(deployment):
                    step = f"{deployment.pod(role, release=release)}-tokens"
                    assert _restarts_and_state(env, step) == (0, "exited"), step

                name = keys()
                await create_ready(api, podman, env, name)

                # A role that fails (here: its process SIGKILLed from outside Podman, which
                # `podman kill` would count as a stop by the user) is restarted.
                scheduler = deployment.container("scheduler")
                pid = podman_cli(env, "inspect", "--format", "{{.State.Pid}}", scheduler)
                os.kill(int(pid.stdout), signal.SIGKILL)
                await eventually(
                    lambda: asyncio.to_thread(_restarts_and_state, env, scheduler),
                    lambda found: found[0] >= 1 and found[1] == "running",
                    timeout=120, interval=0.5, what="the killed scheduler restarted",
                )  # fmt: skip

                # SIGTERM (podman stop) to the first processor's container: it drains and leaves
                # the group, and the second one takes every partition.
                stopped = podman_cli(env, "stop", "--time", "90", deployment.container("processor"))
                assert stopped.returncode == 0, stopped.stderr
                code = podman_cli(
                    env, "inspect", "--format", "{{.State.ExitCode}}",
                    deployment.container("processor"),
                )  # fmt: skip
                assert code.stdout.strip() == str(EXIT_STOPPED)
                await eventually(
                    lambda: _partitions(api, second),
                    lambda s: len(s[0]) == env.kafka_partitions,
                    timeout=60, interval=0.5, what="the second processor owning every partition",
                )  # fmt: skip

                # the delete is decided by the processor that took over
                await delete_gone(api, podman, name)
        finally:
            try:
                await asyncio.to_thread(kube_play.down, deployment)
            finally:
                await asyncio.to_thread(keys.cleanup)
        leftovers = podman_cli(env, "pod", "ps", "--filter", f"name={deployment.release}")
        assert deployment.release not in leftovers.stdout


async def _partitions(api: httpx.AsyncClient, *health_urls: str) -> list[set[int]]:
    """The partitions each processor owns, from its /readyz (details for the admin token)."""
    found = []
    for url in health_urls:
        try:
            body: dict[str, Any] = (await api.get(f"{url}/readyz")).json()
        except (httpx.HTTPError, ValueError):
            body = {}
        found.append(set(body.get("partitions") or []))
    return found


def _played(deployment: kube_play.LocalDeployment) -> list[tuple[str, str]]:
    """(release, role) of every pod the test plays: each role, and the second processor."""
    return [(deployment.release, r) for r in kube_play.PLAYED_ROLES] + [
        (deployment.processor_release, "processor")
    ]


def _restarts_and_state(env: Settings, container: str) -> tuple[int, str]:
    found = podman_cli(
        env, "inspect", "--format", "{{.RestartCount}} {{.State.Status}}", container
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    count, state = found.stdout.split()
    return int(count), state
