"""The peer benchmark's warm phase, its pure parts (services/bench/peer_warm*.py): the pool's
refill as each system reports it, sandstream's rows told apart (members, claims), the Pods
verified, the table and issue 38's goals. (The benchmark itself is not part of the suite.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.bench.peer_report import plan
from services.bench.peer_stats import Summary
from services.bench.peer_systems import OURS, PEER, SandstreamApi
from services.bench.peer_warm import (
    WarmFigures,
    kafka_line,
    median_warm,
    verified,
    warm_report,
)
from services.bench.peer_warm_systems import POOL, ClaimTrack, SandstreamClaims
from services.localstack import agent_sandbox


def test_the_refill_ends_when_the_pool_is_full_again_after_it_fell() -> None:
    track = ClaimTrack()
    track.pool = [(0.0, 10), (1.0, 10), (2.0, 4), (3.0, 0), (5.0, 9), (6.5, 10), (7.0, 3)]
    assert track.refilled_at(0.5, 10) == 6.5
    assert track.refilled_at(6.6, 10) is None  # fell at 7.0, not back yet
    still = ClaimTrack()
    still.pool = [(0.0, 10)]
    assert still.refilled_at(0.0, 10) is None  # never fell: no refill to time
    track.pool_now(3)  # the same count again is no change
    assert len(track.pool) == 7 and track.pool_ready == 3


def _row(name: str, phase: str, key: str | None = None, pool: str | None = None) -> dict[str, Any]:
    return {"name": name, "member_key": key or name, "pool": pool, "phase": phase}


def test_sandstream_rows_count_unclaimed_ready_members_and_note_claims() -> None:
    claims = SandstreamClaims(SandstreamApi("http://127.0.0.1:1", "t", "ns", "image"))
    track = claims.track
    for key in ("warm-aaaaaaaa", "warm-bbbbbbbb", "warm-cccccccc"):
        claims._seen(_row(key, "Pending", pool=POOL))
    assert track.pool_ready == 0
    for key in ("warm-aaaaaaaa", "warm-bbbbbbbb", "warm-cccccccc"):
        claims._seen(_row(key, "Ready", pool=POOL))
    assert track.pool_ready == 3
    claims._seen(_row("other-aaaaaaaa", "Ready", pool="other"))  # another pool's member
    assert track.pool_ready == 3
    track.note(track.requested, "c1")
    claims._seen(_row("c1", "Ready", key="warm-bbbbbbbb", pool=POOL))  # adopted as c1
    assert track.pool_ready == 2
    assert "c1" in track.ready and track.pod["c1"] == "warm-bbbbbbbb"
    claims._seen(_row("stranger", "Ready"))  # not a claim of the bench: not noted
    assert "stranger" not in track.ready
    claims._seen(_row("c1", "Deleted", key="warm-bbbbbbbb", pool=POOL))
    assert "c1" in track.gone
    claims._seen(_row("warm-cccccccc", "Deleted", pool=POOL))
    assert track.pool_ready == 1
    # The Pod of a member maps back to the member's key (what track.pod holds).
    assert claims.pod_key("sandstream-warm-aaaaaaaa-g1") == "warm-aaaaaaaa"


def test_a_claim_is_verified_only_with_its_pod_seen_ready() -> None:
    track = ClaimTrack()
    for name, requested, ready in (("a", 1.0, 1.05), ("b", 1.0, 1.2), ("c", 1.0, 2.0)):
        track.requested[name], track.ready[name] = requested, ready
    track.pod.update(a="pa", b="pb", c="pc")
    track.pod_ready_at.update(pa=0.5, pb=1.5)  # b's Pod seen after the report; c's never
    track.requested["d"] = 1.0
    track.failed["d"] = "HTTP 500"
    text = verified(track, ["a", "b", "c", "d"])
    assert text.startswith("Pods seen Running+Ready with an IP: 2/3 of those reported Ready "
                           "(1 seen before the report); 1 requests failed")  # fmt: skip
    track.pod_seen("pa", ready=False)  # no longer Ready: forgotten
    assert "pa" not in track.pod_ready_at


def _figures(p50: float, p90: float, warm: int = 20) -> WarmFigures:
    return WarmFigures(
        ready=Summary(20, 20, p50, p90, p90 * 1.5, p90 * 2),
        warm=warm,
        refill=3.0,
        requests=12.5,
        cpu={"sandstream up": 0.004, "kube-apiserver": 0.01},
    )


def test_the_warm_report_shows_both_medians_and_the_goals() -> None:
    runs = [_figures(0.030, 0.060), _figures(0.040, 0.080, warm=18), _figures(0.050, 0.070)]
    med = median_warm(runs)
    assert (med.ready.p50, med.ready.p90, med.warm) == (0.040, 0.070, 18)
    bursts = {OURS: med, PEER: _figures(0.9, 1.4)}
    steady = {OURS: Summary(200, 200, 0.03, 0.05, 0.2, 0.3)}
    text = warm_report(20, 3, bursts, {OURS: 4.0, PEER: 9.0}, 20, steady)
    lines = text.splitlines()
    p50 = next(line for line in lines if line.startswith("request → Ready p50"))
    assert p50.split()[-2:] == ["40", "900"]
    sustained = next(line for line in lines if line.startswith("sustained 20/s"))
    assert "30 / 50 / 200" in sustained and "not run" in sustained
    goals = [line.split()[0] for line in lines if "warm claim p" in line]
    assert goals == ["MET", "MET"]
    slow = {OURS: _figures(0.060, 1.5), PEER: _figures(0.9, 1.4)}
    text = warm_report(20, 1, slow, {OURS: 4.0, PEER: 9.0}, 20, steady)
    assert [line.split()[0] for line in text.splitlines() if "warm claim p" in line] == [
        "NOT",
        "NOT",
    ]


def test_agent_sandbox_runs_with_its_extensions_only_when_asked_and_has_their_manifests() -> None:
    cmd = agent_sandbox.controller_command(Path("/bin/c"), Path("/k"), 1, 2, extensions=True)
    assert "--extensions" in cmd and "--leader-elect=false" in cmd
    stock = agent_sandbox.controller_command(Path("/bin/c"), Path("/k"), 1, 2)
    assert "--extensions" not in stock  # the cold phases run it as it ships
    names = " ".join(agent_sandbox.MANIFESTS)
    for kind in ("sandboxtemplates", "sandboxwarmpools", "sandboxclaims"):
        assert f"extensions.agents.x-k8s.io_{kind}.yaml" in names
        assert f"{kind}.{agent_sandbox.EXTENSIONS_GROUP}" in agent_sandbox.CRD_NAMES
    assert agent_sandbox.EXTENSIONS_ROLE in agent_sandbox.MANIFESTS


def test_the_quick_plan_runs_small_pools_and_phases_can_be_chosen() -> None:
    quick, full = plan(quick=True), plan(quick=False)
    assert (quick.pool, full.pool) == (20, 100)
    assert full.phases == ("cold", "warm")
    assert plan(quick=True, phases=("warm",), pool=5).pool == 5


def test_the_kafka_line_sums_by_type_and_ranks_by_client() -> None:
    per_claim = {
        ("sandstream-processor", "Fetch"): 6.0,
        ("sandstream-executor", "Fetch"): 2.5,
        ("sandstream-api", "Produce"): 2.0,
    }
    text = kafka_line(per_claim)
    assert text.startswith("Kafka requests / claim 10.5 (Fetch 8.5, Produce 2.0); by client: ")
    assert text.endswith("sandstream-processor Fetch 6.0, sandstream-executor Fetch 2.5, "
                         "sandstream-api Produce 2.0")  # fmt: skip
