"""The cleanup stop the executor makes after a launch fails (services/executor/intents.py,
pure): what a failed launch may leave behind goes once the failure is decided. A review found
a Kubernetes Pod whose image cannot be pulled left Pending for good (its node's resources and
its Secret held, and a later pull that worked would have lifted the Error row to Ready); the
real kubelet's run is in tests/test_kubernetes_real_node.py."""

from __future__ import annotations

import factories as f

from events.decided import SandboxFailed
from services.executor.intents import intent_of, unwanted


def failure(**failed: object) -> tuple[f.Harness, SandboxFailed]:
    h = f.Harness()
    h.send(f.create(occurred_at=f.at(0)))
    [event] = [e for e in h.send(f.failed(**failed)).events if isinstance(e, SandboxFailed)]  # type: ignore[arg-type]
    return h, event


def test_a_failed_launch_is_followed_by_a_cleanup_stop_of_its_generation() -> None:
    h, event = failure(observed="created", reason="cannot pull image")
    intent = intent_of(event)
    assert intent is not None
    assert (intent.operation, intent.cleanup, intent.generation) == ("stop", True, 1)
    assert unwanted(intent, h.row()) is None  # the row is Error: still wanted


def test_a_failure_the_launch_did_not_report_asks_for_no_cleanup() -> None:
    """An exit (with its code or without), or a removal: the runtime ran, and a launch may
    still be under way (a memory restore that failed falls back to a fresh container: the
    cleanup stopped that one, in a suite run)."""
    for ended in (f.exited(exit_code=3), f.exited(exit_code=None), f.removed()):
        h = f.Harness()
        h.send(f.create(occurred_at=f.at(0)), f.running(occurred_at=f.at(1)))
        [event] = [e for e in h.send(ended).events if isinstance(e, SandboxFailed)]
        assert not event.launch_failed and intent_of(event) is None, ended
    h = f.Harness()
    h.send(f.create(occurred_at=f.at(0)))
    [event] = [e for e in h.send(f.exited(exit_code=None)).events if isinstance(e, SandboxFailed)]
    assert intent_of(event) is None  # Provisioning: the launch is still under way
