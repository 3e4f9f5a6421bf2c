"""`sandstream up` supervises its long-running parts: a crash is restarted and reported, and
the API stays up meanwhile (its /readyz says which part is down and why)."""

from __future__ import annotations

import asyncio
import logging
import re

import apikit
import factories as f
import httpx
import pytest
from harness import eventually, isolated_env
from test_exactly_once import publish

from drivers.fake import FakeDriver
from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.server import start_api
from services.common import metrics
from services.common.tasks import Tasks
from services.up.control_plane import ControlPlane


def restarts(task: str) -> float:
    return metrics.TASK_RESTARTS.labels(task)._value.get()  # type: ignore[no-any-return]


async def test_a_crashed_processor_is_started_again_while_the_api_reports_it() -> None:
    async with isolated_env(partitions=2) as env:
        # The processor fails at every start while its offsets table is away.
        await env.fetchval("ALTER TABLE input_offsets RENAME TO input_offsets_away")
        before = restarts("processor")
        plane = ControlPlane(
            env.settings, FakeDriver(), env.pool, reconcile_interval=3600, supervised=True
        )
        await plane.start()
        publisher = CommandPublisher(
            env.settings.kafka_bootstrap, topic=env.settings.topic_commands
        )
        await publisher.__aenter__()
        app = create_app(env.settings, env.pool, publisher, apikit.tokens(), down=plane.down)
        server = await start_api(app, "127.0.0.1", 0, access_log=False)
        try:
            admin = {"Authorization": f"Bearer {apikit.ADMIN}"}  # the checks need ops:read
            async with httpx.AsyncClient(base_url=server.url, headers=admin, timeout=30) as client:
                response = await eventually(
                    lambda: client.get("/readyz"),
                    lambda r: (
                        r.status_code == 503 and not r.json()["checks"]["control_plane"]["ok"]
                    ),
                    what="/readyz to report the crashed processor",
                )
                assert (
                    "processor restarting after"
                    in response.json()["checks"]["control_plane"]["detail"]
                )
                assert (await client.get("/healthz")).status_code == 200  # the API is still up
                assert not plane.stopping.is_set()
                await eventually(
                    lambda: restarts("processor"), lambda n: n >= before + 2, timeout=60,
                    what="the processor to be started again after its crashes",
                )  # fmt: skip

                await env.fetchval("ALTER TABLE input_offsets_away RENAME TO input_offsets")
                await publish(env, [f.create("a", command_id="c1")])
                await env.wait_applied(1, timeout=90)  # the next restart runs for good
                await eventually(
                    lambda: client.get("/readyz"),
                    lambda r: r.status_code == 200 and r.json()["checks"]["control_plane"]["ok"],
                    what="/readyz to be ready again",
                )
            assert plane.down() == {}
        finally:
            await server.stop()
            await publisher.__aexit__()
            await plane.stop()


async def test_a_supervised_task_that_keeps_crashing_is_started_again_with_a_doubling_delay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="sandstream.tasks")
    tasks = Tasks()
    starts = 0

    async def crash(stop: asyncio.Event) -> None:
        nonlocal starts
        starts += 1
        raise RuntimeError("boom")

    tasks.supervise("crasher", crash, first_delay=0.1)
    await eventually(lambda: starts, lambda n: n >= 4, what="four starts")
    assert "crasher" in tasks.down() and "boom" in tasks.down()["crasher"]
    await tasks.finish()
    delays = re.findall(r"crasher crashed: .*; starting it again in ([0-9.]+)s", caplog.text)
    assert [float(d) for d in delays[:3]] == [0.1, 0.2, 0.4]  # backing off, not a hot loop
