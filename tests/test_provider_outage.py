"""Scenario 4 across a broker outage: a rotation made while Kafka is down restarts every
attached Ready sandbox once Kafka is back, with no retry by the caller, and the answer says
the restarts are pending.

A private broker (the shared one is never touched) is stopped with SIGSTOP, as a paused or
partitioned broker looks to its clients: connections stay open, nothing is answered. Two API
processes (`sandstream api`) serve the same database; the rotation goes through the first,
which is then killed while the broker is still stopped (its producer, and anything it still
held, is gone: what an aiokafka idempotent producer keeps retrying in its buffer dies with its
process). The broker stays stopped until the stored commands have failed to publish at least
three times (each attempt waits the publish timeout), then continues; the second API's relay
delivers them.

Scaled down by settings so that "longer than any producer timeout" takes seconds, not minutes:
``kafka_request_timeout_ms`` 40 s -> 2 s, ``api_publish_timeout_seconds`` 15 s -> 2 s,
``provider_outbox_seconds`` 5 s -> 0.5 s.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from apikit import create_body, unique
from harness import eventually
from pydantic import SecretStr
from role_processes import RoleProcess, Roles, roles_env
from test_providers_e2e import AGENT, env_in

from drivers.podman import PodmanDriver
from services.common.settings import Settings
from services.executor.backends import podman_driver
from services.localstack import private_broker
from services.localstack.stack import StackError
from services.up.control_plane import ControlPlane

SCALED = {
    "kafka_request_timeout_ms": 2000,
    "api_publish_timeout_seconds": 2.0,
    "provider_outbox_seconds": 0.5,
}
KEY = base64.b64encode(secrets.token_bytes(32)).decode()


async def start_api(roles: Roles) -> tuple[RoleProcess, str]:
    port = private_broker.free_port()
    process = roles.start("api", env={
        "SANDSTREAM_API_PORT": str(port),
        "SANDSTREAM_CREDENTIALS_KEY": KEY,
    })  # fmt: skip
    await process.ready()
    return process, f"http://127.0.0.1:{port}"


@dataclass
class Stack:
    roles: Roles
    settings: Settings
    driver: PodmanDriver
    broker: subprocess.Popen[bytes]


@asynccontextmanager
async def stack_on_a_private_broker(
    tmp_path: Path, with_scheduler: bool = False, **more: Any
) -> AsyncIterator[Stack]:
    """A private broker, an isolated environment on it (``more``: settings beyond SCALED), the
    control plane with Podman (and the deadline scheduler, ``with_scheduler``)."""
    shared = Settings()  # PostgreSQL and Podman are the shared stack's, Kafka is our own
    listening = private_broker.private_settings(
        shared,
        tmp_path / "kafka",
        pg_password_file=shared.pg_password_path,
        podman_socket=shared.podman_socket_path,
    )
    broker = private_broker.start(listening)
    try:
        await broker_ready(listening, broker)
        (tmp_path / "run").mkdir()
        async with roles_env(tmp_path / "run", base=listening, **(SCALED | more)) as roles:
            settings = roles.env.settings.model_copy(update={"credentials_key": SecretStr(KEY)})
            driver = podman_driver(settings, stop_timeout=5)
            plane = ControlPlane(
                settings,
                driver,
                roles.env.pool,
                reconcile_interval=3600,
                with_scheduler=with_scheduler,
            )
            await plane.start()
            try:
                yield Stack(roles, settings, driver, broker)
            finally:
                await plane.stop()
                await driver.close()
    finally:
        if broker.poll() is None:
            os.kill(broker.pid, signal.SIGCONT)
        await asyncio.to_thread(private_broker.stop, broker)


async def broker_ready(settings: Settings, broker: subprocess.Popen[bytes]) -> None:
    """Wait for the private broker while its process lives (a loaded machine starts it in
    minutes rather than seconds: each wait gives up after 90 s, so wait up to three times)."""
    for attempt in range(3):
        try:
            await asyncio.to_thread(private_broker.wait_ready, settings, broker)
            return
        except StackError:
            if broker.poll() is not None or attempt == 2:
                raise


async def test_a_rotation_made_while_kafka_is_down_restarts_every_ready_sandbox_once_back(
    tmp_path: Path,
) -> None:
    p = unique("outage-p")
    ready, stopped = [unique("outage-r") for _ in range(2)], unique("outage-s")
    values = {v: f"sekrit-{v}-{secrets.token_hex(6)}" for v in ("one", "two")}
    async with stack_on_a_private_broker(tmp_path) as stack:
        (first, url_a), (_, url_b) = [await start_api(stack.roles) for _ in range(2)]
        headers = {"Authorization": f"Bearer {stack.roles.admin_token()}"}
        env = stack.roles.env
        try:
            async with (
                httpx.AsyncClient(base_url=url_a, headers=headers, timeout=60) as a,
                httpx.AsyncClient(base_url=url_b, headers=headers, timeout=60) as b,
            ):
                credentials = {"name": p, "credentials": {"API_KEY": values["one"]}}
                assert (await a.post("/v1/providers", json=credentials)).status_code == 201
                for name in (*ready, stopped):
                    body = create_body(name, command=AGENT) | {"providers": [p]}
                    body["spec"]["image"] = stack.settings.sandbox_image
                    r = await a.post("/v1/sandboxes", params={"wait": 30}, json=body)
                    assert r.status_code == 201, r.text
                await a.post(f"/v1/sandboxes/{stopped}:stop", params={"wait": 30})
                await phase_is(b, stopped, "Stopped", 1)
                for name in ready:  # a create's wait is for its outcome, not for Ready
                    await phase_is(b, name, "Ready", 1)

                os.kill(stack.broker.pid, signal.SIGSTOP)
                try:
                    rotated = {"credentials": {"API_KEY": values["two"]}}
                    r = await a.put(f"/v1/providers/{p}/credentials", json=rotated)
                    assert r.status_code == 200, r.text
                    receipt = r.json()
                    actions = {line["sandbox"]: line["action"] for line in receipt["sandboxes"]}
                    assert actions == {**dict.fromkeys(ready, "restart"), stopped: "skip"}
                    assert {line["delivery"] for line in receipt["sandboxes"]} == {"pending"}
                    assert len(receipt["unsent"]) == 3

                    first.kill()  # the API that took the update dies, its producer with it
                    await eventually(
                        lambda: env.fetch("SELECT attempts FROM provider_outbox"),
                        lambda rows: len(rows) == 3 and all(r["attempts"] >= 3 for r in rows),
                        timeout=60,
                        what="every stored command failed to publish three times",
                    )
                finally:
                    os.kill(stack.broker.pid, signal.SIGCONT)

                # No retry by the caller: the second API's relay sends what was stored.
                for name in ready:
                    await phase_is(b, name, "Ready", 2, timeout=120)
                    assert await env_in(stack.driver, name, 2, "API_KEY") == values["two"]
                await phase_is(b, stopped, "Stopped", 1)
            await eventually(lambda: env.fetchval("SELECT count(*) FROM provider_outbox"),
                             lambda n: n == 0, what="the outbox drained")  # fmt: skip
            restarts = await env.fetch(
                "SELECT key FROM history WHERE 'AgentRestarted' = ANY(event_types)"
            )
            assert sorted(r["key"] for r in restarts) == sorted(ready)  # once each
        finally:
            for name in (*ready, stopped):
                await stack.driver.delete(name)


async def phase_is(
    client: httpx.AsyncClient, name: str, phase: str, generation: int, timeout: float = 30
) -> Any:
    return await eventually(
        lambda: client.get(f"/v1/sandboxes/{name}"),
        lambda r: (r.json()["phase"], r.json()["generation"]) == (phase, generation),
        timeout=timeout,
        what=f"{name} {phase} at generation {generation}",
    )
