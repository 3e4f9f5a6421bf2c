"""A "running" that comes after the exit that ended its generation, dated before that exit, is
late, not news: it lifts no Error (projections.lifecycle.observations.ran_before_its_exit).

Two suite runs failed the way such a running does (likely a start Podman 4.3 sent again after
rotating its event log): the row went from Error back to Ready, which dropped the restart the
policy had scheduled (four restarts for three) or decided the exit a second time (three
SandboxCompleted for two). The pipeline side, on real Podman, is in
tests/test_restart_pipeline.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import factories as f

from drivers.labels import runtime_labels
from drivers.podman_events import observation_from_event, snapshot_from_list
from drivers.podman_objects import Container, read_container
from drivers.protocol import LaunchSpec
from events.common import Phase, RestartBackoff, RestartPolicy, SandboxSpec
from events.observations import RuntimeSnapshot
from services.executor.reconcile import LiveRow, reconcile

P = Phase


def spec(policy: RestartPolicy | None = None) -> SandboxSpec:
    return SandboxSpec(
        image=f.IMAGE,
        restart_policy=policy,
        restart_backoff=RestartBackoff(initial_seconds=1, max_seconds=1),
        max_restarts=1,
    )


def exited_at_10(policy: RestartPolicy | None, code: int) -> f.Harness:
    """A sandbox Ready from t=1 whose runtime exited with ``code`` at t=10."""
    h = f.Harness()
    h.send(f.create(sandbox_spec=spec(policy), occurred_at=f.at(0)))
    h.send(f.running(occurred_at=f.at(1)))
    h.send(f.exited(exit_code=code, occurred_at=f.at(10)))
    return h


def test_a_running_dated_before_the_exit_lifts_no_error_and_keeps_the_scheduled_restart() -> None:
    h = exited_at_10("OnFailure", 1)
    before = h.row()
    assert before.phase is P.ERROR and before.deadline is not None
    for t in (1, 10):  # the start, and a report dated the exit's own second
        d = h.send(f.running(occurred_at=f.at(t), source="list"))
        assert d.disposition == "ignored" and d.events == ()
        assert d.reason.startswith("late: ") and "from before the exit" in d.reason
    assert h.row() == before  # still Error, the restart still scheduled


def test_a_running_dated_before_the_exit_does_not_decide_an_exhausted_exit_again() -> None:
    h = exited_at_10("Always", 0)
    h.send(f.due(deadline="restart", due_at=h.row().deadline.due_at, occurred_at=f.at(11)))  # type: ignore[union-attr]
    h.send(f.running(generation=2, occurred_at=f.at(12)))
    h.send(f.exited(generation=2, exit_code=0, occurred_at=f.at(13)))
    assert (h.row().phase, h.row().generation) == (P.ERROR, 2)  # max_restarts 1: exhausted
    d = h.send(f.running(generation=2, occurred_at=f.at(12), source="list"))
    assert d.disposition == "ignored"
    h.send(f.exited(generation=2, exit_code=0, occurred_at=f.at(13), source="list"))
    assert [e.type for e in h.events()].count("SandboxCompleted") == 2


def test_a_running_after_the_exit_still_lifts_error() -> None:
    h = exited_at_10(None, 1)
    d = h.send(f.running(occurred_at=f.at(11)))
    assert (d.disposition, h.row().phase, h.row().exit_code) == ("applied", P.READY, None)


def test_the_exit_time_decides_not_a_later_change_of_the_row() -> None:
    """A command after the exit (a hold at t=30) does not make a running from between the two
    late; Ready again forgets the exit, and the rebuild from the log keeps all of it."""
    h = exited_at_10(None, 1)
    assert h.row().exited_at == f.at(10)
    h.send(f.hold(occurred_at=f.at(30)))
    d = h.send(f.running(occurred_at=f.at(20)))
    assert (d.disposition, h.row().phase, h.row().exited_at) == ("applied", P.READY, None)
    assert h.rebuilt() == {f.KEY: h.row()}


def test_a_launch_that_failed_without_an_exit_is_still_lifted_by_its_runtime_running() -> None:
    """No exit code: nothing says the runtime ended, so its running (however dated) is news."""
    h = f.Harness()
    h.send(f.create(sandbox_spec=spec(), occurred_at=f.at(0)))
    h.send(f.result(operation="launch", outcome="failed", reason="timed out", occurred_at=f.at(5)))
    assert (h.row().phase, h.row().exit_code) == (P.ERROR, None)
    d = h.send(f.running(occurred_at=f.at(3), source="list"))
    assert (d.disposition, h.row().phase) == ("applied", P.READY)


def listed_exit(h: f.Harness, exited_at: int) -> Container:
    """The row's runtime as a Podman 4.3 list item shows it exited with code 3: its times in
    whole unix seconds (only the fields the driver reads)."""
    row = h.row()
    spec = LaunchSpec(row.key, row.sandbox_id, row.generation, "rid", SandboxSpec(image="x"))
    attrs: dict[str, Any] = {
        "Id": "c0ffee", "Names": ["sbx"], "Created": exited_at - 1,
        "Labels": runtime_labels(spec), "State": "exited", "ExitCode": 3,
        "StartedAt": exited_at, "ExitedAt": exited_at,
    }  # fmt: skip
    container = read_container(attrs)
    assert container is not None
    return container


def watched_start(h: f.Harness, nanos: int) -> RuntimeSnapshot:
    """The watch's report of the row's runtime starting, dated to the nanosecond."""
    row = h.row()
    labels = runtime_labels(
        LaunchSpec(row.key, row.sandbox_id, row.generation, "rid", SandboxSpec(image="x"))
    )
    event = {"Type": "container", "Action": "start", "timeNano": nanos,
             "Actor": {"ID": "c0ffee", "Attributes": labels}}  # fmt: skip
    start = observation_from_event(event)
    assert isinstance(start, RuntimeSnapshot) and start.state == "running"
    return start


def test_a_start_sent_again_lifts_no_error_decided_by_a_listed_exit_of_its_own_second() -> None:
    """Found in CI (the replayed-start test of tests/test_reconcile.py): a runtime exited in
    the second it started, and the reconcile loop's listing reported the exit before the
    watch's `died`. A list item dates an exit to the whole second, so the exit (12:00:05)
    came before the watch's start (12:00:05.4): Podman sending that start again lifted the
    Error to Ready. A listed exit now counts as the end of its second, bounded by the reader's
    clock; the watcher's own listing after a reconnect reads it the same way."""
    second = int(f.at(5).timestamp())
    for report in ("reconcile", "watcher"):
        h = f.Harness()
        h.send(f.create(sandbox_spec=spec(), occurred_at=f.at(0)))
        start = watched_start(h, second * 1_000_000_000 + 400_000_000)
        assert h.send(start).disposition == "applied"
        row = h.row()
        container = listed_exit(h, second)
        if report == "reconcile":
            live = LiveRow(row.key, row.sandbox_id, row.generation, row.phase, row.version)
            [exit_seen] = reconcile([live], [container.info], now=f.at(5.9))
        else:
            exit_seen = snapshot_from_list(container)
        assert h.send(exit_seen).disposition == "applied"
        assert (h.row().phase, h.row().exit_code) == (P.ERROR, 3)
        again = h.send(start.model_copy(update={"observation_id": "sent-again"}))
        assert (again.disposition, h.row().phase) == ("ignored", P.ERROR), report
        assert again.reason.startswith("late: ")
        # The pass's clock bounds the end of the second; the watcher's (now) is past it.
        bound = f.at(5.9) if report == "reconcile" else f.at(6) - timedelta(microseconds=1)
        assert exit_seen.occurred_at == bound
