"""The restart policy on Kubernetes: the real Kubernetes driver, executor, watcher, processor and
scheduler against a real kube-apiserver (kwok as the node; `make k8s` starts it).

kwok runs no containers, so the test plays the kubelet: once a generation's Pod runs (the row
is Ready at that generation) it writes the container's exit through the Pod's status
subresource, with the exit code and ``finishedAt`` now — the watcher reports that time as the
exit's. Delays are asserted on the recorded events (a restart's due time against its exit's
time, the DeadlineDue that started it against the due time), never on the wall clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import factories as f
import pytest_asyncio
from harness import Env, eventually, isolated_env
from kube_support import (
    Admin,
    Keys,
    admin_fixture,  # noqa: F401  (the module's admin client)
    keys_fixture,  # noqa: F401  (the test's sandbox names)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
)
from pipeline_support import (
    command,
    history,
    running_plane,
    wait_phase,
    wait_restart_limit,
    wait_row,
)

from drivers.kube_objects import pod_name
from events.codec import EVENTS, decode
from events.common import RestartBackoff, RestartPolicy, SandboxSpec
from events.decided import (
    DecidedEvent,
    SandboxRestartScheduled,
    SandboxStarting,
)
from events.publisher import CommandPublisher, now
from services.audit.verify import Options, verify
from services.processor.rebuild import rebuild_and_compare

WAIT = 90.0
IMAGE = "registry.example/agent:1"


@pytest_asyncio.fixture(loop_scope="session")
async def plane(admin: Admin, ns: str) -> AsyncIterator[tuple[Env, CommandPublisher]]:
    """A control plane with the scheduler, on the Kubernetes driver, polling for due deadlines
    twice a second (it is also woken by every change of the rows)."""
    driver = new_driver(admin, ns)
    try:
        async with (
            isolated_env(scheduler_poll_seconds=0.5) as env,
            running_plane(env, driver, with_scheduler=True, reconcile_interval=3600),
            await env.publisher() as pub,
        ):
            yield env, pub
    finally:
        await driver.close()


def spec(policy: RestartPolicy, max_restarts: int, initial: float, cap: float) -> SandboxSpec:
    return SandboxSpec(
        image=IMAGE,
        command=["agent"],
        restart_policy=policy,
        restart_backoff=RestartBackoff(initial_seconds=initial, max_seconds=cap),
        max_restarts=max_restarts,
    )


async def exit_generation(env: Env, admin: Admin, ns: str, key: str, gen: int, code: int) -> None:
    """Once generation ``gen`` is Ready, its container exits with ``code`` now."""
    row = await wait_row(
        env,
        key,
        lambda r: r["generation"] > gen or (r["generation"], r["phase"]) == (gen, "Ready"),
        f"Ready at generation {gen}",
        WAIT,
    )
    steps = [(h["message_type"], h["disposition"], h["reason"]) for h in await history(env, key)]
    assert (row["generation"], row["phase"]) == (gen, "Ready"), steps
    await admin.exit_pod(ns, pod_name(key, gen), code, at=now())


async def decided(
    env: Env, key: str, last: str, generation: int | None = None
) -> list[DecidedEvent]:
    """The key's decided events, once the last one published is of type ``last`` (of
    ``generation``, if given: the processor publishes them after it wrote the row)."""

    async def read() -> list[DecidedEvent]:
        records = await env.read_topic(env.settings.topic_events)
        return [decode(EVENTS, r.value) for r in records if r.key == key.encode()]

    found: list[DecidedEvent] = await eventually(
        read,
        lambda es: bool(es) and es[-1].type == last and generation in (None, es[-1].generation),
        timeout=30,
        what=f"{key}: {last}",
    )
    return found


def assert_backoff(events: list[DecidedEvent], policy: str, delays: list[float]) -> None:
    """Each scheduled restart is due its delay after the exit that scheduled it; each restart
    names the policy and its attempt and started no earlier than it was due."""
    scheduled = [e for e in events if isinstance(e, SandboxRestartScheduled)]
    assert [e.deadline.due_at - e.occurred_at for e in scheduled] == [
        timedelta(seconds=s) for s in delays
    ]
    assert [(e.policy, e.deadline.attempt) for e in scheduled] == [
        (policy, n) for n in range(1, len(delays) + 1)
    ]
    starts = [e for e in events if isinstance(e, SandboxStarting)]
    assert [(e.policy, e.attempt, e.generation) for e in starts] == [
        (policy, n, n + 1) for n in range(1, len(delays) + 1)
    ]
    for due, start in zip(scheduled, starts, strict=True):
        assert start.occurred_at >= due.deadline.due_at


async def restart_reasons(env: Env, key: str) -> list[str]:
    """The history's reasons of the restarts (the DeadlineDue that started a generation)."""
    return [
        h["reason"]
        for h in await history(env, key)
        if h["message_type"] == "DeadlineDue" and h["disposition"] == "applied"
    ]


async def test_on_failure_restarts_a_failing_pod_with_growing_delays_until_the_limit(
    plane: tuple[Env, CommandPublisher], admin: Admin, ns: str, keys: Keys
) -> None:
    env, pub = plane
    key = keys()
    await command(
        env, pub, f.create(key, sandbox_spec=spec("OnFailure", 3, 0.5, 1.5), occurred_at=now())
    )
    for gen in range(1, 5):
        await exit_generation(env, admin, ns, key, gen, 1)
    row = await wait_restart_limit(env, key, WAIT)
    assert (row["phase"], row["generation"], row["exit_code"]) == ("Error", 4, 1)
    assert "restart_policy OnFailure made 3 restarts in a row (max_restarts 3)" in row["reason"]
    assert "code 1" in row["reason"]
    events = await decided(env, key, "SandboxRestartsExhausted")
    assert_backoff(events, "OnFailure", [0.5, 1.0, 1.5])
    reasons = await restart_reasons(env, key)
    assert len(reasons) == 3 and all("restart_policy OnFailure" in r for r in reasons)
    # Only the newest generation's Pod is left: each restart replaced the one before.
    assert await admin.pod_names(ns, key) == [pod_name(key, 4)]
    # The rows rebuilt from the decided events alone, and the log re-decided by the audit
    # (with the same limits, the restart reset among them), agree with what was recorded.
    rebuilt = await rebuild_and_compare(env.settings)
    assert rebuilt.equal, rebuilt.differences
    report = await verify(env.settings, Options(key=key))
    assert report.ok and report.divergences == [], report.divergences


async def test_always_restarts_a_pod_that_exited_0(
    plane: tuple[Env, CommandPublisher], admin: Admin, ns: str, keys: Keys
) -> None:
    env, pub = plane
    key = keys()
    await command(
        env, pub, f.create(key, sandbox_spec=spec("Always", 1, 0.5, 0.5), occurred_at=now())
    )
    await exit_generation(env, admin, ns, key, 1, 0)
    await exit_generation(env, admin, ns, key, 2, 0)
    row = await wait_restart_limit(env, key, WAIT)
    assert (row["generation"], row["exit_code"]) == (2, 0)
    events = await decided(env, key, "SandboxRestartsExhausted")
    assert_backoff(events, "Always", [0.5])
    completed = [e.type for e in events if e.type == "SandboxCompleted"]
    assert completed == ["SandboxCompleted", "SandboxCompleted"]  # exit 0, both times
    (reason,) = await restart_reasons(env, key)
    assert "restart_policy Always" in reason


async def test_never_leaves_a_failed_pod_in_error(
    plane: tuple[Env, CommandPublisher], admin: Admin, ns: str, keys: Keys
) -> None:
    env, pub = plane
    key = keys()
    await command(
        env, pub, f.create(key, sandbox_spec=spec("Never", 3, 0.5, 0.5), occurred_at=now())
    )
    await exit_generation(env, admin, ns, key, 1, 1)
    await wait_phase(env, key, "Error", generation=1, timeout=WAIT)
    # Nothing is scheduled: the row holds no deadline the scheduler could act on.
    deadline = await env.fetchval("SELECT deadline FROM sandboxes WHERE key = $1", key)
    assert deadline is None
    events = await decided(env, key, "SandboxFailed")
    assert not [e for e in events if isinstance(e, SandboxRestartScheduled | SandboxStarting)]


async def test_on_failure_restarts_a_pod_deleted_behind_our_back(
    plane: tuple[Env, CommandPublisher], admin: Admin, ns: str, keys: Keys
) -> None:
    """A vanished runtime is a failure: the Pod deleted outside sandstream is restarted."""
    env, pub = plane
    key = keys()
    await command(
        env, pub, f.create(key, sandbox_spec=spec("OnFailure", 1, 0.5, 0.5), occurred_at=now())
    )
    await wait_phase(env, key, "Ready", generation=1, timeout=WAIT)
    await admin.delete_pod_now(ns, pod_name(key, 1))
    await wait_phase(env, key, "Ready", generation=2, timeout=WAIT)
    events = await decided(env, key, "SandboxReady", generation=2)
    assert_backoff(events, "OnFailure", [0.5])
    (scheduled,) = [e for e in events if isinstance(e, SandboxRestartScheduled)]
    assert scheduled.reason == "runtime removed outside sandstream"
    (reason,) = await restart_reasons(env, key)
    assert "restart_policy OnFailure" in reason
    assert await admin.pod_names(ns, key) == [pod_name(key, 2)]


async def test_a_stop_cancels_a_scheduled_restart(
    plane: tuple[Env, CommandPublisher], admin: Admin, ns: str, keys: Keys
) -> None:
    """The failed Pod's restart is scheduled a minute out; a stop takes its place: the row is
    Stopped at the same generation and holds no deadline the scheduler could act on."""
    env, pub = plane
    key = keys()
    await command(
        env, pub, f.create(key, sandbox_spec=spec("OnFailure", 3, 60, 60), occurred_at=now())
    )
    await exit_generation(env, admin, ns, key, 1, 1)
    await eventually(
        lambda: env.fetchval("SELECT deadline->>'kind' FROM sandboxes WHERE key = $1", key),
        lambda kind: kind == "restart",
        timeout=WAIT,
        what="the restart scheduled",
    )
    await command(env, pub, f.stop(key, occurred_at=now()))
    stopped = await wait_phase(env, key, "Stopped", timeout=WAIT)
    assert stopped["generation"] == 1
    assert await env.fetchval("SELECT deadline FROM sandboxes WHERE key = $1", key) is None
    events = await decided(env, key, "SandboxStopped")
    assert [e.type for e in events if isinstance(e, SandboxRestartScheduled)] == [
        "SandboxRestartScheduled"
    ]
    assert not [e for e in events if isinstance(e, SandboxStarting)]
