"""An idle timeout on a sandbox the backend cannot keep a workspace for through a suspend
(Kubernetes without a storage class: the default chart). Each idle suspend failed, put the
sandbox back to Ready, and the next scan found it idle again, for as long as it lived. The API
now refuses such a timeout (tests/test_api_suspend.py); the scheduler does not act on one a
row already has (real PostgreSQL and Kafka, the processor deciding)."""

from __future__ import annotations

from datetime import timedelta

from test_idle_after_outage import FLUSH, Clock, idle_messages, ready_on_a_plane

from events.publisher import now
from services.scheduler.scheduler import Scheduler


async def scan(scheduler: Scheduler, clock: Clock) -> None:
    """Rounds until one idle scan ran (the first is held two flush intervals)."""
    scans = scheduler.idle_scans
    await scheduler.start()
    try:
        while scheduler.idle_scans == scans:
            await scheduler.round()
            clock.at += FLUSH
    finally:
        await scheduler.stop()


async def test_the_scheduler_sends_no_idle_message_for_a_sandbox_it_cannot_suspend() -> None:
    key = "kube-idle"
    async with ready_on_a_plane(key, 60) as env:  # made on the log: no API check on the way
        clock = Clock(now() + timedelta(hours=1))  # an hour unused, its timeout a minute
        routed = {"driver_route_prefix": "kube-", "driver_route": "kubernetes"}
        cannot = env.settings.model_copy(update=routed)
        assert cannot.kube_storage_class is None
        await scan(Scheduler(cannot, env.pool, clock=clock), clock)
        assert await idle_messages(env, key) == []
        # The same row where the backend can suspend it: the scan finds it idle.
        await scan(Scheduler(env.settings, env.pool, clock=clock), clock)
        assert [m.key for m in await idle_messages(env, key)] == [key]
