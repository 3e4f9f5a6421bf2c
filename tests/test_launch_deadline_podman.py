"""The launch deadline on the real stack (Kafka, PostgreSQL, Podman, the deadline scheduler):
a rotation restart of an agent that ignores SIGTERM first waits out the old generation's grace
period, and its launch must not time out meanwhile.

The windows are scaled down from their defaults, keeping their relation: the launch timeout
300 s -> 3 s, the executor's retry window 600 s -> 6 s, and the agent's grace period (the
issue's 400 s, longer than the launch timeout) -> 6 s.
"""

from __future__ import annotations

import base64
import secrets

import apikit
from apikit import create_body, unique
from harness import eventually
from pipeline_support import IGNORE_TERM, trap_set
from pydantic import SecretStr

from services.common.settings import load_settings
from services.executor.backends import podman_driver

KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
SCALED = {
    "credentials_key": KEY,
    "launch_timeout_seconds": 3.0,
    "executor_retry_seconds": 6.0,
    "scheduler_poll_seconds": 0.5,
}
GRACE = 6


async def test_a_slow_stopping_agent_is_rotated_and_stays_ready() -> None:
    podman = podman_driver(load_settings())
    name, provider = unique("slowstop"), unique("slowstop-p")
    try:
        async with (
            apikit.running_api(podman, settings_update=SCALED, with_scheduler=True) as api,
            api.client() as c,
        ):
            r = await c.post("/v1/providers", json={"name": provider, "credentials": {"K": "1"}})
            assert r.status_code == 201, r.text
            body = create_body(name, command=IGNORE_TERM, stop_timeout_seconds=GRACE)
            body["spec"]["image"] = api.env.settings.sandbox_image
            body["providers"] = [provider]
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await api.wait_phase(name, "Ready")
            await trap_set(podman, name, 1)  # from now on a stop takes the whole grace period

            r = await c.put(
                f"/v1/providers/{provider}/credentials", json={"credentials": {"K": "2"}}
            )
            assert r.status_code == 200, r.text
            row = await eventually(
                lambda: c.get(f"/v1/sandboxes/{name}"),
                lambda resp: (resp.json()["phase"], resp.json()["generation"]) == ("Ready", 2),
                timeout=60,
                what="the rotation restart to be Ready at generation 2",
            )
            assert (row.json()["reason"], row.json()["deadline"]) == (None, None)
            history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
            events = [e for h in history for e in h["events"]]
            assert "AgentRestarted" in events
            assert "SandboxTimedOut" not in events  # no ProvisioningTimeout, no cleanup stop
            assert [(i.generation, i.state) for i in await podman.get(name)] == [(2, "running")]
            await podman.kill(name, 2)  # it ignores SIGTERM: end it before the delete
            await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
            await api.wait_phase(name, "Deleted")
    finally:
        for runtime in await podman.get(name):
            await podman.kill(name, runtime.generation)
        await podman.delete(name)
        await podman.close()
