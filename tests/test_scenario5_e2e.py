"""Scenario 5 of the brief end to end: Stopped does not regress.

The whole pipeline with the real Podman driver (processor, executor, watcher, reconciler) and
the HTTP API. After the sandbox reached Stopped, the snapshots that describe the stop itself
arrive late (the died event delivered again, a listing taken before the stop, the executor's
stop result repeated): the row stays Stopped at the same version and change position. A
second stop is an idempotent success; a genuine start still brings it back to Ready.
"""

from __future__ import annotations

from datetime import timedelta

import apikit
import factories as f
from apikit import create_body, unique
from harness import eventually

from services.common.settings import load_settings
from services.executor.backends import podman_driver


async def test_a_stop_time_snapshot_after_stopped_does_not_move_the_row() -> None:
    name = unique("s5")
    driver = podman_driver(load_settings())
    try:
        async with apikit.running_api(driver) as api, api.client() as c:
            settings = api.env.settings
            body = create_body(name, command=["sleep", "3600"], stop_timeout_seconds=5)
            body["spec"]["image"] = settings.sandbox_image
            created = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert created.status_code == 201, created.text
            await api.wait_phase(name, "Ready")

            stop = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30})
            assert stop.status_code == 200 and stop.json()["phase"] == "Stopping"
            await api.wait_phase(name, "Stopped")
            stopped = (await c.get(f"/v1/sandboxes/{name}")).json()
            generation, version = stopped["generation"], stopped["version"]
            assert stopped["phase"] == "Stopped" and generation == 1

            # The stop, described again, delivered after Stopped.
            late = [
                f.exited(name, generation, exit_code=143, observation_id=f"late-died-{name}",
                         actor="podman-watcher"),
                f.running(name, generation, source="list", observation_id=f"late-list-{name}",
                          occurred_at=f.at(0) - timedelta(days=1)),
                f.stopped(name, generation, observation_id=f"late-result-{name}"),
                f.removed(name, generation, observation_id=f"late-removed-{name}",
                          source="reconcile"),
            ]  # fmt: skip
            await api.env.observe(*late)
            late_ids = {o.observation_id for o in late}

            async def recorded() -> list[dict[str, object]]:
                page = await c.get(f"/v1/sandboxes/{name}/history", params={"limit": 1000})
                return [
                    h for h in page.json()["items"]
                    if h["message"] and h["message"].get("observation_id") in late_ids
                ]  # fmt: skip

            entries = await eventually(recorded, lambda hs: len(hs) == len(late),
                                       what="the late snapshots in the history")  # fmt: skip
            assert {h["disposition"] for h in entries} == {"ignored"}
            assert all(h["phase"] == "Stopped" and h["version"] == version for h in entries)
            assert all("no effect in phase Stopped" in str(h["reason"]) for h in entries)

            after = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert (after["phase"], after["version"], after["change_seq"]) == (
                "Stopped", version, stopped["change_seq"],
            )  # fmt: skip
            assert (await driver.get(name))[0].state == "exited"

            # A second stop succeeds, idempotently: nothing changes.
            again = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30})
            assert again.status_code == 200, again.text
            outcome = again.json()
            assert (outcome["status"], outcome["code"], outcome["phase"]) == (
                "accepted", "OK", "Stopped",
            )  # fmt: skip
            assert outcome["version"] == version
            assert outcome["message"] == f"nothing to do: sandbox {name!r} is Stopped"

            # A genuine start recovers it, at a new generation.
            start = await c.post(f"/v1/sandboxes/{name}:start", params={"wait": 30})
            assert start.status_code == 200 and start.json()["generation"] == generation + 1
            await api.wait_phase(name, "Ready")
            runtimes = await driver.get(name)
            assert [(r.generation, r.state) for r in runtimes] == [(generation + 1, "running")]

            delete = await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
            assert delete.status_code == 200
            await api.wait_phase(name, "Deleted")
            assert await driver.get(name) == []
    finally:
        await driver.delete(name)
        await driver.close()
