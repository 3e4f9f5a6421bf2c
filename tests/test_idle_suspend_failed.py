"""An idle suspend that fails after its stop ended the runtime, through the real pipeline
(Kafka, PostgreSQL, the scheduler, the processor, the executor; the fake driver, whose suspend
the test holds and then fails with the runtime exited).

The fold decided such a failure Stopped: nothing ran, yet no wake on access resumed it (a wake
resumes only Suspended) and no restart policy restarted it (the suspend's stop is no exit).
It is Suspended now, its row still saying it was an idle suspend, and the next call wakes it
(projections/lifecycle/observations.py, OBSERVED_PHASE; the rule in tests/test_suspend_rules.py).
"""

from __future__ import annotations

import apikit
from apikit import create_body, phase_is, row, unique
from pipeline_support import history

from drivers.fake import FakeDriver

IDLE = 1  # seconds
SCALED = {"use_flush_seconds": 1.0, "scheduler_poll_seconds": 0.5}


async def test_an_idle_suspend_that_failed_with_the_runtime_exited_is_woken_by_the_next_call() -> (
    None
):
    driver = FakeDriver()
    async with apikit.running_api(driver, settings_update=SCALED, with_scheduler=True) as api:
        name = unique("idlefail")
        suspends = driver.block("suspend", name)
        body = create_body(name, idle_suspend_seconds=IDLE, restart_policy="Always")
        body["on_exit"] = "delete"
        async with api.client() as c:
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await suspends.entered(timeout=60)  # found idle: Suspending, its suspend under way
            assert (await row(api, name))["phase"] == "Suspending"
            driver.runtime_exited(name, 1, 143)  # the suspend's stop ended the agent ...
            driver.fail("suspend", name, "removal failed", retryable=False)  # ... then it failed
            suspends.release()
            suspended = await phase_is(api, name, "Suspended", 1)
            assert suspended["reason"].startswith("IdleSuspend: no use since"), suspended
            assert suspended["reason"].endswith("; the suspend failed: removal failed")
            failed = [
                h["message"] for h in await history(api.env, name)
                if h["message_type"] == "DriverOperationResult" and h["phase"] == "Suspended"
            ]  # fmt: skip
            assert [(m["outcome"], m.get("observed")) for m in failed] == [("failed", "exited")]
            # The next call wakes it (past the wake to the runtime, which the fake driver
            # has none of for the API's files door).
            r = await c.get(f"/v1/sandboxes/{name}/files/stat", params={"path": "/workspace"})
            assert r.status_code == 409 and "runtime is not running" in r.text, r.text
        await phase_is(api, name, "Ready", 2)
        entries = await history(api.env, name)
        assert [h["disposition"] for h in entries if h["message_type"] == "ResumeSandbox"] == [
            "applied"
        ]
        # The suspend's stop was no exit: neither policy acted on it.
        assert not [h for h in entries if h["phase"] in ("Error", "Completed", "Deleting")], [
            (h["message_type"], h["phase"]) for h in entries
        ]
