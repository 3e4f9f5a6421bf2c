"""A rotation stored while Kafka is down for longer than the whole launch window still ends with
the agent Ready on the new value: issue "Trust, round four", item 1, reproduced as reported.

The broker (a private one) is stopped with SIGSTOP during a credentials update and continued
only once the launch window of the restart, counted from when the update stored it, has
passed. The API that took the update stays up, so its idempotent producer delivers the copy
it kept, stamped before the outage, and the relay's copies follow: the first one decided is the
oldest. Old code: the restart was decided with its deadline long past, the scheduler timed it
out at once (SandboxTimedOut), the cleanup stop ended the new generation (exit 143), Error.

Scaled through settings as the report did: the launch timeout 300 s -> 15 s, the executor's
retry window 600 s -> 1 s, the agent's grace period 1 s: a window of 17 s against a pause of
more than that. The path is the one a 15-minute outage against the real window takes
(tests/test_outage_deadlines.py runs that path at the real scale): the processor sees a
rotation whose own time lies more than the window before its append time, and nothing else of
the outage.
"""

from __future__ import annotations

import os
import secrets
import signal
from datetime import timedelta
from pathlib import Path

import httpx
from apikit import create_body, unique
from harness import eventually
from test_provider_outage import phase_is, stack_on_a_private_broker, start_api
from test_providers_e2e import AGENT, env_in

from events.publisher import now

# 15 s, not less: after the pause the executor's consumer finds its coordinator and rejoins its
# group before the restart's launch runs, which took more than 2 s, then more than 7 s, in
# loaded suite runs (a wait the real 300 s never meets; on a quiet machine it is 0.5 s).
LAUNCH = 15.0
WINDOW = {"launch_timeout_seconds": LAUNCH, "executor_retry_seconds": 1.0}
GRACE = 1
PAUSE_PAST_WINDOW = timedelta(seconds=LAUNCH + 1.0 + GRACE + 3.0)  # the window, and 3 s more


async def test_a_rotation_stored_during_an_outage_longer_than_the_launch_window_ends_ready(
    tmp_path: Path,
) -> None:
    p, name = unique("outwin-p"), unique("outwin")
    values = {v: f"sekrit-{v}-{secrets.token_hex(6)}" for v in ("one", "two")}
    async with stack_on_a_private_broker(tmp_path, with_scheduler=True, **WINDOW) as stack:
        _, url = await start_api(stack.roles)
        headers = {"Authorization": f"Bearer {stack.roles.admin_token()}"}
        env = stack.roles.env
        try:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as api:
                credentials = {"name": p, "credentials": {"API_KEY": values["one"]}}
                assert (await api.post("/v1/providers", json=credentials)).status_code == 201
                body = create_body(name, command=AGENT, stop_timeout_seconds=GRACE)
                body["spec"]["image"] = stack.settings.sandbox_image
                body["providers"] = [p]
                r = await api.post("/v1/sandboxes", params={"wait": 30}, json=body)
                assert r.status_code == 201, r.text
                await phase_is(api, name, "Ready", 1, timeout=60)

                os.kill(stack.broker.pid, signal.SIGSTOP)
                try:
                    stored = now()
                    rotated = {"credentials": {"API_KEY": values["two"]}}
                    r = await api.put(f"/v1/providers/{p}/credentials", json=rotated)
                    assert r.status_code == 200, r.text
                    assert [line["delivery"] for line in r.json()["sandboxes"]] == ["pending"]
                    # The outage outlasts the window the restart would have had from `stored`.
                    await eventually(
                        lambda: env.fetch("SELECT attempts FROM provider_outbox"),
                        lambda rows: len(rows) == 1 and now() - stored > PAUSE_PAST_WINDOW,
                        timeout=60,
                        what="the outage to outlast the launch window",
                    )
                finally:
                    os.kill(stack.broker.pid, signal.SIGCONT)

                await phase_is(api, name, "Ready", 2, timeout=120)
                # Old code reached this Ready too, for a moment: after SandboxTimedOut, before
                # its cleanup stop ended the generation (exit 143).
                decided = await env.fetch(
                    "SELECT event_types FROM history WHERE key = $1 ORDER BY id", name
                )
                types = [t for row in decided for t in row["event_types"]]
                assert types.count("AgentRestarted") == 1 and "SandboxTimedOut" not in types
                assert await env_in(stack.driver, name, 2, "API_KEY") == values["two"]
        finally:
            await stack.driver.delete(name)
