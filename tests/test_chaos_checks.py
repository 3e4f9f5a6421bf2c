"""The checker's end checks find what they must: each planted loss, duplicate or divergence."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

from drivers.protocol import RuntimeInfo
from services.chaos import checks
from services.chaos.workload import Sent
from services.common.settings import Settings

SID = uuid.uuid4()


def kinds(found: list[checks.Finding]) -> list[tuple[str, str]]:
    return [(f.kind, f.check) for f in found]


def test_an_acknowledged_command_without_an_outcome_is_lost_and_one_decided_twice_duplicated() -> (
    None
):
    sent = [Sent("c1", "a", "create", 202, True), Sent("c2", "a", "stop", None, False)]
    clean = checks.command_findings(sent, Counter({"c1": 1}), Counter({"c1": 1}))
    assert clean == []  # c2 got no answer: having no outcome is allowed
    assert kinds(checks.command_findings(sent, Counter(), Counter())) == [("lost", "commands")]
    twice = checks.command_findings(sent, Counter({"c1": 1}), Counter({"c1": 2}))
    assert kinds(twice) == [("duplicated", "commands")]
    stranger = checks.command_findings(sent, Counter({"c1": 1, "zz": 1}), Counter({"c1": 1}))
    assert kinds(stranger) == [("divergence", "commands")]


def test_history_versions_must_be_contiguous_per_sandbox() -> None:
    def entry(i: int, disposition: str, version: int, key: str = "a") -> dict[str, object]:
        return {"id": i, "key": key, "disposition": disposition, "version": version}

    good = [entry(1, "rejected", 0), entry(2, "applied", 1), entry(3, "ignored", 1),
            entry(4, "applied", 2), entry(5, "applied", 1, key="b")]  # fmt: skip
    assert checks.history_findings(good) == []
    gap = [entry(1, "applied", 1), entry(2, "applied", 3)]
    assert kinds(checks.history_findings(gap)) == [("divergence", "history")]
    again = [entry(1, "applied", 1), entry(2, "applied", 2), entry(3, "applied", 2)]
    assert kinds(checks.history_findings(again)) == [("duplicated", "history")]


def test_decided_events_must_all_be_published_in_order_and_repeats_are_counted() -> None:
    decided = {"a": [("e1", 1), ("e2", 2), ("e3", 3)]}
    assert checks.event_findings(decided, {"a": ["e1", "e2", "e3"]}) == ([], 0)
    assert checks.event_findings(decided, {"a": ["e1", "e2", "e1", "e3", "e2"]}) == ([], 2)
    found, _ = checks.event_findings(decided, {"a": ["e1", "e3"]})
    assert kinds(found) == [("lost", "events")]
    found, _ = checks.event_findings(
        decided, {"a": ["e2", "e1", "e2", "e3"]}, {"a": ["0@4", "0@5", "0@6", "0@7"]}
    )
    assert kinds(found) == [("divergence", "events")]
    # The evidence: each publication's version and place, repeats marked.
    assert found[0].detail == (
        "a: published out of order: decided v1..v3; on the topic v2@0@4 v1@0@5 v2@0@6(again) v3@0@7"
    )
    found, _ = checks.event_findings({"a": [("e1", 1), ("e2", 3)]}, {"a": ["e1", "e2"]})
    assert kinds(found) == [("divergence", "events")]
    found, _ = checks.event_findings(decided, {"a": ["e1", "e2", "e3"], "b": ["x"]})
    assert kinds(found) == [("divergence", "events")]


def runtime(key: str, generation: int, state: str = "running") -> RuntimeInfo:
    return RuntimeInfo(key, SID, generation, state, None, f"rt-{key}-{generation}", None)  # type: ignore[arg-type]


def test_the_backend_must_run_every_ready_generation_and_nothing_stopped_or_deleted() -> None:
    def row(key: str, phase: str, generation: int = 2) -> dict[str, object]:
        return {"key": key, "sandbox_id": SID, "generation": generation, "phase": phase}

    rows = [row("r", "Ready"), row("s", "Stopped"), row("d", "Deleted"), row("e", "Error")]
    agreeing = [runtime("r", 2), runtime("s", 2, "exited"), runtime("e", 2)]
    assert checks.backend_findings(rows, agreeing) == []
    for runtimes, why in (
        ([runtime("r", 1)], "Ready, nothing runs"),  # an older generation is not this one
        ([runtime("r", 2), runtime("s", 2)], "Stopped, yet"),
        ([runtime("r", 2), runtime("d", 1)], "Deleted, yet"),
        ([runtime("r", 2), runtime("x", 1)], "runs without a row"),
    ):
        [finding] = checks.backend_findings(rows, runtimes)
        assert why in finding.detail
    [stuck] = checks.backend_findings([row("p", "Starting")], [])
    assert "still Starting" in stuck.detail


def test_the_backend_stats_count_the_podman_rows_containers_and_divergences_by_prefix() -> None:
    rows = [
        {"key": "cxp1-0", "sandbox_id": SID, "generation": 1, "phase": "Ready"},
        {"key": "cxp1-1", "sandbox_id": SID, "generation": 1, "phase": "Stopped"},
        {"key": "cx-0", "sandbox_id": SID, "generation": 1, "phase": "Ready"},
    ]
    runtimes = [runtime("cxp1-1", 1), runtime("cx-0", 1)]  # cxp1-0 missing, cxp1-1 running
    found = checks.backend_findings(rows, runtimes)
    stats = checks.backend_stats(rows, runtimes, found, "cxp1-")
    assert stats == checks.BackendStats(rows=3, podman_rows=2, podman_running=1,
                                        podman_divergences=2)  # fmt: skip


async def test_the_backend_is_judged_once_it_agrees_or_at_the_deadline() -> None:
    """A stale runtime the executors' reconcile loop stops a pass later is waited for; one
    still running at the deadline is judged as it is."""
    stopped = [{"key": "s", "sandbox_id": SID, "generation": 2, "phase": "Stopped"}]
    listings = [[runtime("s", 1)], [runtime("s", 1)], [runtime("s", 1, "exited")]]
    seen: list[list[RuntimeInfo]] = []

    async def snapshot() -> tuple[checks.Rows, list[RuntimeInfo]]:
        seen.append(listings[min(len(seen), len(listings) - 1)])
        return stopped, seen[-1]

    assert await checks.agreeing_runtimes(snapshot, within=60, every=0) == listings[2]
    assert len(seen) == 3
    seen.clear()
    judged = await checks.agreeing_runtimes(snapshot, within=0, every=0)
    assert judged == listings[0]
    assert [f.detail for f in checks.backend_findings(stopped, judged)] == [
        "s: Stopped, yet ['rt-s-1'] run"
    ]


def test_a_role_process_that_exited_after_healing_is_a_finding_naming_it_and_its_code(
    tmp_path: Path,
) -> None:
    """The CI run where both processors died of a PostgreSQL restart reported only what their
    absence caused (lost commands, a run that never settled); the crash itself is named."""
    from services.chaos.launch import RoleProcess

    roles = [RoleProcess(role, 1, Settings(), tmp_path) for role in ("processor", "executor")]
    unstarted = RoleProcess("watcher", 1, Settings(), tmp_path)
    roles[0].proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    roles[0].proc.wait()
    # Runs until its stdin is closed.
    running = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)  # fmt: skip
    roles[1].proc = running
    try:
        ended = [(r.name, c) for r in [*roles, unstarted] if (c := r.exit_code()) is not None]
    finally:
        assert running.stdin is not None
        running.stdin.close()
        running.wait()
    assert ended == [("processor-1", 3)]
    [finding] = checks.ended_roles(ended)
    assert (finding.kind, finding.check) == ("ended", "roles")
    assert finding.detail == (
        "processor-1 ended by itself with exit code 3 (its log: logs/processor-1.log)"
    )
