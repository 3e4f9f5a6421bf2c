"""The launch rules every driver keeps (drivers/launch_precheck.py), checked on the pure
function the Podman, Kubernetes and fake drivers all act on."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from drivers.launch_precheck import launch_precheck
from drivers.protocol import LaunchSpec, RuntimeInfo
from events.common import SandboxSpec
from events.observations import RuntimeState

SID = uuid.UUID("00000000-0000-4000-8000-000000000001")
OTHER = uuid.UUID("00000000-0000-4000-8000-000000000002")


@dataclass(frozen=True)
class Seen:
    info: RuntimeInfo
    terminating: bool = False


def spec(generation: int) -> LaunchSpec:
    return LaunchSpec("box", SID, generation, f"rid-{generation}", SandboxSpec(image="i"))


def runtime(
    generation: int,
    state: RuntimeState = "running",
    *,
    exit_code: int | None = None,
    sandbox_id: uuid.UUID = SID,
    identity: str | None = None,
    terminating: bool = False,
) -> Seen:
    info = RuntimeInfo(
        "box", sandbox_id, generation, state, exit_code, f"r{generation}{state}",
        identity if identity is not None else f"rid-{generation}",
    )  # fmt: skip
    return Seen(info, terminating)


def test_nothing_there_creates_and_starts() -> None:
    nothing: list[Seen] = []
    plan = launch_precheck(spec(1), nothing)
    assert (plan.replace, plan.current, plan.refusal, plan.starts) == ((), None, None, True)


def test_a_newer_generation_refuses_at_once_and_removes_nothing() -> None:
    older, newer = runtime(1), runtime(3, "exited", exit_code=143)
    plan = launch_precheck(spec(2), [newer, older])
    assert plan.replace == () and plan.current is None
    assert plan.refusal is not None and not plan.refusal.retryable
    assert "superseded" in plan.refusal.reason and "generation 3" in plan.refusal.reason
    assert (plan.refusal.observed, plan.refusal.exit_code) == ("exited", 143)


def test_older_and_foreign_runtimes_are_replaced_and_the_current_one_adopted() -> None:
    older = runtime(1)
    current = runtime(2, "created")
    plan = launch_precheck(spec(2), [current, older])
    assert plan.replace == (older,) and plan.current is current and plan.refusal is None
    assert plan.starts  # created, never started: the launch starts it
    running = runtime(2)
    assert not launch_precheck(spec(2), [running]).starts  # an idempotent repeat
    for foreign in (
        runtime(2, identity="rid-someone-else"),
        runtime(2, sandbox_id=OTHER),
        runtime(2, terminating=True),  # a stop raced the launch
    ):
        plan = launch_precheck(spec(2), [foreign])
        assert plan.replace == (foreign,) and plan.current is None and plan.starts


def test_a_generation_that_ran_and_exited_is_refused_after_the_older_ones_go() -> None:
    older, done = runtime(1), runtime(2, "exited", exit_code=0)
    plan = launch_precheck(spec(2), [done, older])
    assert plan.replace == (older,) and plan.current is None
    assert plan.refusal is not None and "already ran and exited" in plan.refusal.reason
    assert (plan.refusal.retryable, plan.refusal.observed, plan.refusal.exit_code) == (
        False,
        "exited",
        0,
    )
