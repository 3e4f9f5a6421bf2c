"""Regression tests for the brief's scenarios (the pure state part): 1, 2, 3 and 5."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from uuid import uuid4

import factories as f
import pytest

from events.codec import EVENTS, decode, encode
from events.common import Phase
from events.decided import (
    SandboxDeleted,
    SandboxDeleteRetried,
    SandboxOperationFailed,
    SandboxReady,
    SandboxStarting,
)
from events.observations import ObservedState
from events.outcomes import Code
from projections.fold import fold
from projections.lifecycle import DEFAULT_LIMITS, Limits, Message, decide, evolve, identity_for
from services.common.settings import Settings

P = Phase


def assert_still(h: f.Harness, phase: Phase, version: int, *messages: Message) -> None:
    """Each message leaves the row exactly as it is: same phase, same version, no event."""
    for message in messages:
        decision = h.send(message)
        assert decision.events == (), (message, decision.reason)
        assert (h.row().phase, h.row().version) == (phase, version), message


# ---------------------------------------------------------------------------------------------
# 1. Restart identity


def test_scenario_1_restart_identity() -> None:
    h = f.harness_in(P.STOPPED)
    before = h.row()

    first = f.start(command_id="start-1")
    decision = h.send(first)
    # The rotation and the Starting transition are one event.
    (event,) = decision.events
    assert isinstance(event, SandboxStarting)
    assert event.reason == "start"
    assert event.generation == before.generation + 1 == 2
    assert event.previous_generation == before.generation
    assert event.identity == identity_for(before.sandbox_id, 2, "start-1")
    assert event.identity != before.identity
    row = h.row()
    assert (row.phase, row.generation, row.identity) == (P.STARTING, 2, event.identity)
    assert decision.outcome is not None and decision.outcome.identity == event.identity
    version = row.version

    # A retry with the same command id gets the same outcome, hence the same identity.
    retry = h.send(first)
    assert retry.disposition == "duplicate"
    assert retry.outcome == decision.outcome
    assert h.row().version == version

    # A concurrent start (another command id) while Starting reuses the identity that won.
    other = h.send(f.start(command_id="start-2"))
    assert other.disposition == "idempotent"
    assert other.outcome is not None and other.outcome.accepted
    assert other.outcome.identity == event.identity
    assert (h.row().version, h.row().identity) == (version, event.identity)

    # The launch intent is the event: what the executor reads off the log is the persisted
    # identity, and the generation it launches reports back into the same row.
    intent = decode(EVENTS, encode(event))
    assert isinstance(intent, SandboxStarting)
    assert intent.identity == h.row().identity
    h.send(f.launched(generation=intent.generation, identity=intent.identity))
    assert (h.row().phase, h.row().identity) == (P.READY, event.identity)

    # Replaying the same inputs mints the same identity: nothing random, no clock.
    replay = fold({}, {}, [(s.cause, s.message) for s in h.steps])
    assert replay.states[f.KEY] == h.row()


def test_scenario_1_restart_rotates_once_per_accepted_command() -> None:
    h = f.harness_in(P.READY)
    identities = {h.row().identity}
    for n in range(3):
        decision = h.send(f.restart(command_id=f"restart-{n}"))
        (event,) = decision.events
        assert isinstance(event, SandboxStarting) and event.reason == "restart"
        identities.add(event.identity)
        h.send(f.running(generation=event.generation))
    assert len(identities) == 4
    assert h.row().generation == 4


# ---------------------------------------------------------------------------------------------
# 2. Transient conflicts


@pytest.mark.parametrize(
    ("command_type", "to"),
    [
        ("StopSandbox", P.STOPPING),
        ("RestartSandbox", P.STARTING),
        ("DeleteSandbox", P.DELETING),
        ("AttachProvider", P.READY),
    ],
)
def test_scenario_2_server_updates_never_fail_a_user_command(command_type: str, to: Phase) -> None:
    h = f.Harness()
    created = h.send(f.create(providers=["github"]))
    assert created.outcome is not None
    seen_by_client = created.outcome.version
    assert seen_by_client is not None
    # Server-owned updates move the version under the client's feet.
    h.send(f.running(), f.attach(provider="gitlab", actor="provider-sync"))
    assert h.row().version > seen_by_client

    build = f.VERSIONED_COMMANDS[command_type]
    extra = {"provider": "aws"} if command_type == "AttachProvider" else {}
    decision = h.send(build(**extra))  # no expected_version: never a conflict
    assert decision.outcome is not None and decision.outcome.accepted
    assert decision.outcome.code is Code.OK
    assert h.row().phase is to


def test_scenario_2_explicit_stale_version_fails_fast() -> None:
    h = f.Harness()
    created = h.send(f.create())
    assert created.outcome is not None
    seen = created.outcome.version
    assert seen is not None
    h.send(f.running())  # an internal update
    current = h.row().version
    assert current == seen + 1

    decision = h.send(f.stop(command_id="stale", expected_version=seen))
    assert decision.outcome is not None
    assert decision.outcome.code is Code.ABORTED and not decision.outcome.accepted
    assert decision.outcome.message == (
        f"expected version {seen} but sandbox {f.KEY!r} is at version {current}"
    )
    assert decision.events == () and h.row().phase is P.READY
    # Never retried: resending the same command gets the same rejection, even once it would fit.
    again = h.send(f.stop(command_id="stale", expected_version=seen))
    assert again.disposition == "duplicate" and again.outcome == decision.outcome
    # A fresh command with the current version goes through.
    fresh = h.send(f.stop(expected_version=current))
    assert fresh.outcome is not None and fresh.outcome.accepted
    assert h.row().phase is P.STOPPING


# ---------------------------------------------------------------------------------------------
# 3. Delete


def test_scenario_3_deleting_is_monotonic() -> None:
    h = f.harness_in(P.DELETING)
    version = h.row().version
    assert_still(
        h,
        P.DELETING,
        version,
        f.exited(exit_code=0),
        f.exited(exit_code=137),  # SIGTERM ignored, killed
        f.running(),
        f.created_snapshot(),
        f.stopped(),
        f.result(operation="stop", outcome="already_absent"),
        f.launched(),
        f.delete(),  # a second delete: accepted, nothing to do
    )
    rejected = h.send(f.stop())
    assert rejected.outcome is not None
    assert rejected.outcome.code is Code.FAILED_PRECONDITION
    assert rejected.outcome.message.endswith("to stop (current phase: Deleting)")
    assert (h.row().phase, h.row().version) == (P.DELETING, version)


@pytest.mark.parametrize(
    "finish",
    [
        pytest.param(lambda: f.deleted(), id="delete-succeeded"),
        pytest.param(lambda: f.result(operation="delete", outcome="already_absent"), id="absent"),
    ],
)
def test_scenario_3_delete_finalizes_to_a_tombstone(finish: Callable[[], Message]) -> None:
    h = f.harness_in(P.DELETING)
    version = h.row().version
    decision = h.send(finish())
    (event,) = decision.events
    assert isinstance(event, SandboxDeleted)
    tomb = h.row()
    assert tomb.tombstoned and tomb.version == version + 1 and tomb.generation == 1

    # Nothing after the tombstone touches it: late snapshots of any generation, results, and
    # commands other than a create.
    assert_still(
        h,
        P.DELETED,
        tomb.version,
        f.running(),  # the late snapshot that used to resurrect deleted sandboxes
        f.running(generation=2),
        f.exited(exit_code=137),
        f.removed(),
        f.launched(),
        f.failed(operation="delete", observed="running"),
    )
    for command in (f.start(), f.stop(), f.delete(), f.attach()):
        rejected = h.send(command)
        assert rejected.outcome is not None and rejected.outcome.code is Code.NOT_FOUND
    assert h.row() == tomb


def test_scenario_3_a_removed_runtime_does_not_finalize_a_delete() -> None:
    """The delete removes the runtime first; its workspace may still be held (another container
    mounting the volume). Only the delete's own report that nothing is left tombstones."""
    h = f.harness_in(P.DELETING)
    version = h.row().version
    decision = h.send(f.removed())
    assert decision.disposition == "ignored" and decision.events == ()
    assert (h.row().phase, h.row().version) == (P.DELETING, version)
    (event,) = h.send(f.deleted()).events
    assert isinstance(event, SandboxDeleted) and h.row().tombstoned


@pytest.mark.parametrize("observed", [None, "running", "created", "exited", "absent"])
def test_scenario_3_a_failed_delete_stays_deleting_with_its_retries(
    observed: ObservedState | None,
) -> None:
    """Whatever the backend looked like, a failed delete is recorded and retried, never undone
    (it used to follow the observed phase: Ready, Stopped or Error, its deadline cleared)."""
    h = f.harness_in(P.DELETING)
    first = h.row().deadline
    assert first is not None and first.attempt == 0
    decision = h.send(f.failed(operation="delete", observed=observed, reason="volume in use"))
    (event,) = decision.events
    assert isinstance(event, SandboxOperationFailed)
    assert (event.operation, event.phase) == ("delete", P.DELETING)
    row = h.row()
    assert (row.phase, row.deadline) == (P.DELETING, first)
    assert row.reason == (
        "DeleteFailed: still Deleting (retries so far: 0; next retry at "
        f"{first.due_at.isoformat()}): volume in use"
    )
    # The deadline it kept asks for the delete again, and the next failure counts that retry.
    (retried,) = h.send(f.due(deadline="delete", due_at=first.due_at)).events
    assert isinstance(retried, SandboxDeleteRetried) and retried.deadline.attempt == 1
    h.send(f.failed(operation="delete", observed=observed, reason="volume in use"))
    assert (h.row().reason or "").startswith("DeleteFailed: still Deleting (retries so far: 1;")
    assert h.row().deadline == retried.deadline
    for command in (f.start(), f.stop(), f.restart()):  # still refused: nothing undid it
        refused = h.send(command)
        assert refused.outcome is not None and refused.outcome.code is Code.FAILED_PRECONDITION
    (event,) = h.send(f.result(operation="delete", outcome="already_absent")).events
    assert isinstance(event, SandboxDeleted) and h.row().tombstoned


@pytest.mark.parametrize("why", ["ttl", "on_exit"])
def test_scenario_3_a_decided_expiry_or_completion_delete_survives_its_failure(why: str) -> None:
    """A time to live (on_expiry: delete) or completion policy (on_exit: delete) consumed its
    trigger when it decided the delete; a failure must not leave the sandbox alive for good."""
    h = f.Harness()
    h.send(f.create(ttl_seconds=60, on_expiry="delete", on_exit="delete"), f.running())
    expires_at = h.row().expires_at
    assert expires_at is not None
    if why == "ttl":
        h.send(f.due(deadline="ttl", due_at=expires_at))
    else:
        h.send(f.exited(exit_code=0))
    assert h.row().phase is P.DELETING
    first = h.row().deadline
    assert first is not None
    # The executor reports a failure after its retry window (600 s), the backend still running.
    later = first.due_at + timedelta(seconds=600)
    h.send(f.failed(operation="delete", observed="running", occurred_at=later))
    assert (h.row().phase, h.row().deadline) == (P.DELETING, first)
    (retried,) = h.send(f.due(deadline="delete", due_at=first.due_at, occurred_at=later)).events
    assert isinstance(retried, SandboxDeleteRetried)
    assert h.row().phase is P.DELETING


def test_scenario_3_a_failed_delete_keeps_the_exit_code_of_the_agent() -> None:
    """on_exit: delete after the agent exited 3: the failed delete's report (with the code of
    whatever the backend showed) does not change what the row says about the agent's exit."""
    h = f.Harness()
    h.send(f.create(on_exit="delete"), f.running(), f.exited(exit_code=3))
    assert (h.row().phase, h.row().exit_code) == (P.DELETING, 3)
    h.send(f.failed(operation="delete", observed="exited", exit_code=137))
    assert (h.row().phase, h.row().exit_code) == (P.DELETING, 3)


def test_scenario_3_an_expiry_during_a_failing_delete_keeps_the_failure_as_the_reason() -> None:
    """A sandbox deleted by hand keeps its time to live; when that falls due while the delete
    is failing, the row still says why it is not deleted yet (it said "Expired")."""
    h = f.Harness()
    h.send(f.create(ttl_seconds=60), f.running(), f.delete())
    h.send(f.failed(operation="delete", reason="volume in use"))
    reason = h.row().reason
    assert reason is not None and reason.startswith("DeleteFailed: ")
    expires_at = h.row().expires_at
    assert expires_at is not None
    decision = h.send(f.due(deadline="ttl", due_at=expires_at))
    assert [e.type for e in decision.events] == ["SandboxExpired"]
    assert (h.row().phase, h.row().reason, h.row().expires_at) == (P.DELETING, reason, None)


def delete_timeline(limits: Limits, grace: int, retry_window: float) -> list[tuple[str, int]]:
    """The decided events of a delete whose first call keeps failing transiently: every
    deadline falls due on time, and the executor reports the failure once its retry window
    has passed (then the next deadline retries). (event type, deadline attempt after it)"""
    h = f.Harness()
    spec = f.spec(f.IMAGE).model_copy(update={"stop_timeout_seconds": grace})
    h.send(f.create(sandbox_spec=spec), f.running())
    out: list[tuple[str, int]] = []

    def send(message: Message) -> None:
        decision = decide(h.row(), message, f.cause(message), limits)
        assert decision.state is not None
        h.states[f.KEY] = decision.state
        out.extend(
            (e.type, getattr(decision.state.deadline, "attempt", -1)) for e in decision.events
        )

    send(f.delete())
    report_at, reported = f.T0 + timedelta(seconds=retry_window), False
    while True:
        deadline = h.row().deadline
        assert deadline is not None and h.row().phase is P.DELETING
        if reported:
            send(f.due(deadline="delete", due_at=deadline.due_at))
            return out
        if report_at < deadline.due_at:
            send(f.failed(operation="delete", observed="absent", occurred_at=report_at))
            reported = True
        else:
            send(f.due(deadline="delete", due_at=deadline.due_at))


def test_scenario_3_the_scaled_delete_timeline_is_the_real_one() -> None:
    """tests/test_delete_finishes.py runs a failing delete on Podman with its windows divided
    by 100; with the defaults (600 s of executor retries, 120 s to 1800 s of delete back-off,
    the driver's 10 s grace) the same events are decided in the same order."""
    real = delete_timeline(DEFAULT_LIMITS, grace=10, retry_window=600)
    scaled_settings = Settings(
        executor_retry_seconds=6.0, delete_retry_seconds=1.2, delete_retry_max_seconds=18.0
    )
    scaled = delete_timeline(scaled_settings.lifecycle_limits, grace=1, retry_window=6.0)
    assert (
        real
        == scaled
        == [
            ("SandboxDeleting", 0),
            ("SandboxDeleteRetried", 1),
            ("SandboxDeleteRetried", 2),
            ("SandboxOperationFailed", 2),  # still Deleting, the deadline of retry 3 kept
            ("SandboxDeleteRetried", 3),
        ]
    )


def test_scenario_3_old_failed_delete_events_replay_as_they_were() -> None:
    """A failed delete decided by the older rules (it followed the observed phase) rebuilds to
    that phase: the rebuild from the log never rewrites history."""
    h = f.harness_in(P.DELETING)
    row = h.row()
    old = SandboxOperationFailed(
        type="SandboxOperationFailed", event_id=uuid4(), key=row.key,
        sandbox_id=row.sandbox_id, version=row.version + 1, generation=row.generation,
        occurred_at=f.T0, actor="executor", cause=h.steps[-1].cause, operation="delete",
        phase=P.READY, reason="timeout",
    )  # fmt: skip
    rebuilt = evolve(row, old)
    assert (rebuilt.phase, rebuilt.deadline, rebuilt.reason) == (P.READY, None, "timeout")


def test_scenario_3_recreate_is_untouched_by_the_old_incarnation() -> None:
    h = f.harness_in(P.DELETED)
    tomb = h.row()
    h.send(f.create(image="new:2"))
    row = h.row()
    assert (row.phase, row.generation) == (P.PROVISIONING, tomb.generation + 1)
    assert row.sandbox_id != tomb.sandbox_id
    # Late news of generation 1 cannot touch generation 2.
    assert_still(h, P.PROVISIONING, row.version, f.removed(generation=1), f.exited(generation=1))
    h.send(f.running(generation=2))
    assert h.row().phase is P.READY


def test_scenario_3_a_slow_delete_does_not_affect_another_sandbox() -> None:
    """Deciding B never depends on A's messages: B's events are the same with or without them."""
    a: list[Message] = [*f.path_to(P.DELETING, key="a"), f.exited("a", exit_code=137)]
    b: list[Message] = [*f.path_to(P.READY, key="b"), f.stop("b"), f.stopped("b")]
    mixed = [m for pair in zip(a, b, strict=False) for m in pair] + a[len(b) :] + b[len(a) :]
    causes = f.Causes()
    inputs = [(causes(m), m) for m in mixed]
    together = fold({}, {}, inputs)
    alone = fold({}, {}, [(c, m) for c, m in inputs if m.key == "b"])
    b_events = [e for s in together.steps for e in s.decision.events if e.key == "b"]
    assert [e.model_dump() for e in b_events] == [
        e.model_dump() for s in alone.steps for e in s.decision.events
    ]
    assert together.states["b"] == alone.states["b"]
    assert together.states["b"] is not None and together.states["b"].phase is P.STOPPED
    assert together.states["a"] is not None and together.states["a"].phase is P.DELETING


# ---------------------------------------------------------------------------------------------
# 5. Stopped regression


def test_scenario_5_stopped_stays_stopped() -> None:
    h = f.harness_in(P.READY)
    h.send(f.stop(command_id="stop-1"))
    h.send(f.exited(exit_code=143))  # the stop itself, seen by the watcher: Stopping -> Stopped
    assert h.row().phase is P.STOPPED
    version = h.row().version

    # Snapshots of the stop's generation, in any order and repeated, only confirm it.
    late: list[Message] = [
        f.exited(exit_code=0),
        f.exited(exit_code=143),
        f.exited(exit_code=None),
        f.removed(),
        f.created_snapshot(),
        f.running(source="list"),  # a list taken before the stop, delivered late
        f.stopped(),
        f.result(operation="stop", outcome="already_absent"),
        f.failed(operation="stop", observed="running"),
        f.launched(),
    ]
    assert_still(h, P.STOPPED, version, *late)

    # A second StopSandbox is accepted idempotently: no new version, for as long as it is Stopped.
    for n in range(2):
        decision = h.send(f.stop(command_id=f"stop-again-{n}"))
        assert decision.disposition == "idempotent"
        assert decision.outcome is not None and decision.outcome.accepted
        assert decision.outcome.code is Code.OK and decision.outcome.version == version
        assert_still(h, P.STOPPED, version, f.exited(), f.removed())

    # A genuine start still recovers it: new generation, and only its snapshots count.
    started = h.send(f.start())
    assert started.outcome is not None and started.outcome.accepted
    assert (h.row().phase, h.row().generation) == (P.STARTING, 2)
    assert_still(h, P.STARTING, h.row().version, f.exited(generation=1), f.removed(generation=1))
    (ready,) = h.send(f.running(generation=2)).events
    assert isinstance(ready, SandboxReady)
    assert h.row().phase is P.READY

    # Once started, a stop is a real stop again.
    stop = h.send(f.stop())
    assert len(stop.events) == 1 and h.row().phase is P.STOPPING


def test_scenario_5_stop_before_the_runtime_came_up() -> None:
    """Stop while Provisioning: the late launch success and running snapshot do not revive it."""
    h = f.Harness()
    h.send(f.create(), f.stop())
    assert h.row().phase is P.STOPPING
    assert_still(h, P.STOPPING, h.row().version, f.launched(), f.running())
    h.send(f.stopped())
    assert_still(h, P.STOPPED, h.row().version, f.running(), f.launched(), f.exited())
