"""The peer benchmark's pure parts (services/bench/peer*.py): what Ready and gone mean, the
latency figures, the apiserver's counter, the manifests it applies, the table and the goals.
(The benchmark itself, ``make bench-peer``, is not part of the suite.)"""

from __future__ import annotations

import asyncio
import math
from typing import Any
from uuid import uuid4

import httpx
import pytest

from drivers.kube_objects import PodSettings, pod_manifest
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.bench import cpu, create_steps, peer_burst
from services.bench.api_rate import Sums
from services.bench.peer import Bench, above_idle, orders
from services.bench.peer_kube import yaml_documents
from services.bench.peer_report import (
    RATES,
    Plan,
    Sustained,
    goals,
    highest_rate,
    median_figures,
    plan,
    report,
)
from services.bench.peer_setup import SANDSTREAM_RBAC
from services.bench.peer_stats import (
    BurstFigures,
    Summary,
    counts_delta,
    latencies,
    pod_ready,
    quantile,
    request_counts,
    sandbox_ready,
    span,
    sse_events,
    summarize,
    top_requests,
)
from services.bench.peer_systems import (
    CONNECTIONS,
    FLOOR,
    OURS,
    PEER,
    SandstreamApi,
    Track,
    pod_spec,
)

RUNNING: dict[str, Any] = {
    "status": {
        "phase": "Running",
        "podIP": "10.244.0.7",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
}


def test_a_pod_is_ready_only_running_ready_and_with_an_ip() -> None:
    assert pod_ready(RUNNING)
    no_ip = {"status": {**RUNNING["status"], "podIP": None}}
    unready = [{"type": "Ready", "status": "False"}]
    not_ready = {"status": {**RUNNING["status"], "conditions": unready}}
    pending = {"status": {**RUNNING["status"], "phase": "Pending"}}
    assert not any(pod_ready(p) for p in (no_ip, not_ready, pending, {}))
    assert sandbox_ready({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert not sandbox_ready({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert not sandbox_ready({})


def test_server_sent_events_are_cut_at_blank_lines_and_the_rest_is_kept() -> None:
    text = ': hello\nretry: 2000\n\nid: 4\nevent: sandbox\ndata: {"a": 1}\n\nid: 5\nevent: sa'
    events, rest = sse_events(text)
    assert events == [("sandbox", '{"a": 1}')]
    assert rest == "id: 5\nevent: sa"
    more, rest = sse_events(rest + 'ndbox\ndata: {"b":\ndata: 2}\n\n')
    assert more == [("sandbox", '{"b":\n2}')] and rest == ""


def test_sandstream_pods_map_back_to_their_sandbox() -> None:
    api = SandstreamApi("http://127.0.0.1:1", "t", "ns", "img")
    assert api.item_of("sandstream-b0-12-g1") == "b0-12"
    assert api.item_of("sandstream-x-g12") == "x"
    assert api.item_of("other") is None


def test_latency_figures_are_nearest_rank_of_what_was_measured() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 50 and quantile(values, 0.9) == 90
    assert quantile(values, 0.99) == 99 and quantile([3.0], 0.99) == 3
    assert math.isnan(quantile([], 0.5))
    started = {"a": 0.0, "b": 1.0, "c": 2.0}
    done = {"a": 0.5, "b": 3.0}
    assert sorted(latencies(started, done)) == [0.5, 2.0]
    assert math.isnan(span(started, done))  # c never got there
    assert span(started, {**done, "c": 2.25}) == 3.0
    s = summarize(latencies(started, done), expected=3)
    assert (s.count, s.expected, s.complete, s.max) == (2, 3, False, 2.0)


LABELS = 'component="apiserver",group="",resource="pods",scope="resource",version="v1"'
METRICS = f"""# HELP apiserver_request_total ...
# TYPE apiserver_request_total counter
apiserver_request_total{{code="201",{LABELS},subresource="",verb="POST"}} 300
apiserver_request_total{{code="409",{LABELS},subresource="",verb="POST"}} 2
apiserver_request_total{{code="200",{LABELS},subresource="status",verb="PATCH"}} 600
apiserver_request_latencies_summary{{verb="POST"}} 7
"""


def test_apiserver_requests_are_summed_by_verb_and_resource() -> None:
    counts = request_counts(METRICS)
    assert counts == {("POST", "pods"): 302.0, ("PATCH", "pods"): 600.0}
    later = {("POST", "pods"): 602.0, ("PATCH", "pods"): 600.0, ("GET", "nodes"): 3.0}
    delta = counts_delta(counts, later)
    assert delta == {("POST", "pods"): 300.0, ("GET", "nodes"): 3.0}
    assert top_requests(delta, 300, n=1) == "POST pods 1.0"


def test_manifests_are_cut_into_documents_with_their_kind_and_namespace() -> None:
    docs = yaml_documents(SANDSTREAM_RBAC.read_text(), namespace="bench-x")
    assert [kind for kind, _ in docs] == ["ServiceAccount", "Role", "RoleBinding"]
    lines = [line.strip() for _, text in docs for line in text.splitlines()]
    assert "namespace: sandstream" not in lines and lines.count("namespace: bench-x") == 4
    assert docs[2][1].count("namespace: bench-x") == 2  # the binding and its subject
    assert yaml_documents("# only a comment\n---\n") == []


def test_every_system_gets_the_pod_sandstreams_driver_makes() -> None:
    spec = pod_spec("localhost/img:1")
    image = SandboxSpec(image="localhost/img:1", command=["sleep", "3600"])
    launch = LaunchSpec(key="k", sandbox_id=uuid4(), generation=1, identity="rid-x", spec=image)
    theirs = pod_manifest(launch, PodSettings())["spec"]
    assert spec["volumes"] == theirs["volumes"] and spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == theirs["terminationGracePeriodSeconds"]
    [container] = spec["containers"]
    assert container["image"] == "localhost/img:1" and container["command"] == ["sleep", "3600"]
    assert container["volumeMounts"] == theirs["containers"][0]["volumeMounts"]
    assert "env" not in container and "hostname" not in spec


def test_a_process_connections_are_found_by_inode_and_remote_port() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        "   0: 0100007F:A1B2 0100007F:1538 01 00000000:00000000 00:00000000 00000000 0 0 111\n"
        "   1: 0100007F:0002 0100007F:1538 01 00000000:00000000 00:00000000 00000000 0 0 222\n"
        "   2: 0100007F:0003 0100007F:4E20 01 00000000:00000000 00:00000000 00000000 0 0 333\n"
    )
    assert cpu.ports_to(table, {111, 333}, 5432) == [0xA1B2]
    assert cpu.connected_ports(2**22 + 12345, 5432) == []  # no such process


def _figures(
    p90: float, all_ready: float, requests: float, gone: float = 2.0, own: float = 0.002
) -> BurstFigures:
    return BurstFigures(
        Summary(300, 300, p90 / 2, p90, p90, p90), all_ready, gone, requests,
        {"kube-apiserver": 0.01, "sandstream up": own, "agent-sandbox controller": own},
    )  # fmt: skip


def test_the_report_shows_the_three_side_by_side_with_ratios_and_the_goals() -> None:
    bursts = {
        FLOOR: _figures(2.0, 2.5, 4.5),
        PEER: _figures(8.0, 9.0, 10.0, gone=3.0, own=0.006),
        OURS: _figures(2.8, 3.5, 5.0),
    }
    full = Summary(900, 900, 0.3, 0.5, 0.9, 1.2)
    slow = Summary(900, 900, 1.0, 2.0, 3.0, 4.0)
    missing = Summary(800, 2700, 1.0, 2.0, 3.0, 4.0)
    sustained: dict[int, dict[str, Summary | None]] = {
        20: {FLOOR: full, PEER: full, OURS: full},
        45: {FLOOR: full, PEER: slow, OURS: full},
        90: {FLOOR: full, PEER: None, OURS: missing},  # None: not run (failed at 45/s)
    }
    assert highest_rate(sustained, OURS) == 45 and highest_rate(sustained, PEER) == 20
    text = report(Plan(rounds=3), bursts, sustained)
    lines = text.splitlines()
    # Where each highest rate stands: bounded by the next rate run, or by none run above it.
    assert (
        "  sandstream: highest rate with p90 < 1 s: 45/s (not at 90/s: p90 2.00 (800/2700) s)"
        in lines
    )
    assert "  agent-sandbox: highest rate with p90 < 1 s: 20/s (not at 45/s: p90 2.00 s)" in lines
    assert "  bare Pods: highest rate with p90 < 1 s: 90/s or more (the highest rate run)" in lines
    header = next(line for line in lines if "sandstream/agent-sandbox" in line)
    assert header.split()[:4] == ["bare", "Pods", "agent-sandbox", "sandstream"]
    p90 = next(line for line in lines if line.startswith("request → Ready p90"))
    assert p90.split()[-5:] == ["2.00", "8.00", "2.80", "0.35", "1.40"]
    assert any(line.startswith("CPU ms / sandbox: kube-apiserver") for line in lines)
    at_90 = next(line for line in lines if line.startswith("90/s"))
    assert "2.00 (800/2700)" in at_90 and "not run" in at_90
    met = goals(bursts, sustained)
    assert [line.split()[0] for line in met] == ["MET"] * 12
    # sandstream 12 ms of CPU per sandbox against 16: 0.75 x
    assert met[-1].endswith("12.0 ms <= 0.8 x agent-sandbox's 16.0 ms (0.75 x)")
    worse = {**bursts, OURS: _figures(4.5, 9.5, 11.0, gone=3.5, own=0.003)}
    assert [line.split()[0] for line in goals(worse, sustained)] == [
        "MET", "NOT", "NOT", "NOT", "MET", "MET", "MET", "NOT", "NOT", "NOT", "NOT", "NOT",
    ]  # fmt: skip


def test_the_sustained_goals_of_issue_42_ask_twice_the_peers_rate_and_its_p90_at_20() -> None:
    bursts = {FLOOR: _figures(2.0, 2.5, 4.0), PEER: _figures(8.0, 9.0, 10.0),
              OURS: _figures(2.8, 3.5, 5.0)}  # fmt: skip
    fast, slow = Summary(600, 600, 0.1, 0.2, 0.3, 0.4), Summary(600, 600, 1.0, 2.0, 3.0, 4.0)

    def sustained(ours: list[Summary | None], peer: list[Summary | None]) -> Sustained:
        return {
            r: {FLOOR: fast, PEER: p, OURS: o} for r, o, p in zip(RATES, ours, peer, strict=True)
        }

    def statuses(s: Sustained) -> list[str]:
        return [line.split()[0] for line in goals(bursts, s)[4:7]]

    # agent-sandbox up to 45/s, sandstream up to 90/s: twice; sandstream's p90 at 20/s 0.2 s
    # against agent-sandbox's 0.1.
    ours = [fast] * 6 + [slow, None, None]
    peer = [Summary(600, 600, 0.05, 0.1, 0.2, 0.3)] * 3 + [slow] + [None] * 5
    assert RATES[5] == 90 and RATES[2] == 45
    assert statuses(sustained(ours, peer)) == ["MET", "NOT", "MET"]
    # sandstream up to 75/s only: above agent-sandbox's, short of twice it.
    assert statuses(sustained([fast] * 5 + [slow] + [None] * 3, peer)) == ["MET", "NOT", "NOT"]
    # sandstream not at the lowest rate: nothing met; agent-sandbox not at it: twice "none".
    assert statuses(sustained([slow] + [None] * 8, [fast] * 9)) == ["NOT", "NOT", "NOT"]
    assert statuses(sustained([fast] + [slow] + [None] * 7, [slow] + [None] * 8))[2] == "MET"


def test_rounds_alternate_the_order_and_medians_combine_them() -> None:
    assert [[*o] for o in orders(["a", "b", "c"], 3)] == [
        ["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"],
    ]  # fmt: skip
    runs = [_figures(1.0, 2.0, 4.0), _figures(3.0, 1.0, 6.0), _figures(2.0, 5.0, 5.0)]
    med = median_figures(runs)
    assert (med.ready.p90, med.all_ready, med.requests) == (2.0, 2.0, 5.0)
    quick, full = plan(quick=True), plan(quick=False)
    assert (quick.rounds, quick.seconds, full.rounds, full.seconds) == (1, 10.0, 3, 60.0)
    assert full.rates == RATES == quick.rates and full.sandboxes == 300
    assert RATES[:3] == (20, 30, 45) and RATES[-1] == 180 and list(RATES) == sorted(RATES)


def test_cpu_per_sandbox_leaves_out_what_each_process_spends_idle() -> None:
    used = {"sandstream up": 20.0, "kube-apiserver": 9.0}
    idle = {"sandstream up": 0.05, "kube-apiserver": 0.01}  # CPU s per s
    per = above_idle(used, idle, seconds=100.0, sandboxes=300)
    assert per == {"sandstream up": 15.0 / 300, "kube-apiserver": 8.0 / 300}
    assert above_idle({"x": 3.0}, {}, 10.0, 3) == {"x": 1.0}


def test_a_watch_listed_again_counts_what_was_asked_to_go_and_is_missing_as_gone() -> None:
    """After a 410 the deletions in the gap are not delivered: a name asked to go that the new
    listing lacks is gone; one still listed, or never asked to go, is not."""
    track = Track(deleting={"a": 1.0, "b": 1.0})
    track.listed("pod_gone", "gone")([{"metadata": {"name": "b"}}, {"metadata": {"name": "c"}}])
    assert set(track.pod_gone) == set(track.gone) == {"a"}
    pods = Track(deleting={"x": 1.0})
    api = SandstreamApi("http://127.0.0.1:1", "t", "ns", "img")
    pods.listed("pod_gone", None, name_of=api.item_of)([{"metadata": {"name": "sandstream-x-g1"}}])
    assert pods.pod_gone == {}


def test_a_phase_waits_for_no_sandbox_whose_request_failed() -> None:
    """A create or delete that failed never goes: waiting for it held a phase for its whole
    timeout."""
    track = Track(deleting={"a": 1.0, "b": 1.0}, gone={"a": 2.0}, pod_gone={"a": 2.0})
    assert not track.all_gone(["a", "b"])
    track.failed["b"] = "ReadError: "
    assert track.all_gone(["a", "b"])
    assert math.isnan(span(track.deleting, track.gone_at()))  # and all gone stays unmeasured


async def test_sandstream_requests_are_sent_again_once_after_a_dropped_connection() -> None:
    """The server closes idle connections: a create or delete that meets one is sent again;
    a second drop is a failure."""
    sent: list[str] = []

    def dropping_first(request: httpx.Request) -> httpx.Response:
        sent.append(request.method)
        if len(sent) % 2:
            raise httpx.ReadError("closed", request=request)
        return httpx.Response(202, json={})

    api = SandstreamApi("http://127.0.0.1:1", "t", "ns", "img")
    api.client._transport = httpx.MockTransport(dropping_first)
    await api.delete("a")
    await api.create("a")
    assert sent == ["DELETE", "DELETE", "POST", "POST"]
    api.client._transport = httpx.MockTransport(
        lambda r: (_ for _ in ()).throw(httpx.ReadError("closed", request=r))
    )
    with pytest.raises(httpx.ReadError):
        await api.delete("a")
    await api.close()


def test_the_burst_summary_shows_own_cpu_by_process_beside_the_floor_and_the_medians() -> None:
    ours = BurstFigures(
        Summary(300, 300, 1.0, 3.0, 4.0, 5.0), 6.0, 7.0, 7.1,
        {"sandstream up": 0.012, "sandstream Kafka": 0.009, "sandstream PostgreSQL": 0.003,
         "kube-apiserver": 0.020, "etcd": 0.010, "bench client": 0.5},
    )  # fmt: skip
    floor = BurstFigures(
        Summary(300, 300, 0.5, 1.0, 2.0, 2.5), 3.0, 2.5, 7.0, {"kube-apiserver": 0.015}
    )
    lines = peer_burst.summary({FLOOR: [floor], OURS: [ours, ours]}).splitlines()
    ours_row = next(line for line in lines if line.startswith("1") and "sandstream" in line)
    # own: up + broker + PostgreSQL (the load generator is no one's); total adds the cluster
    assert "24.0 (12.0, 9.0, 3.0)" in ours_row and ours_row.split()[-2:] == ["30.0", "54.0"]
    floor_row = next(line for line in lines if line.startswith("1") and "bare" in line)
    assert floor_row.split()[-3:] == ["—", "15.0", "15.0"]
    median_row = next(line for line in lines if line.startswith("median") and "sandstream" in line)
    assert median_row.split()[2:5] == ["3.00", "s", "6.00"]


def test_a_creates_steps_are_timed_from_its_request_and_count_only_those_seen() -> None:
    track = Track()
    track.requested = {"s-1": 10.0, "s-2": 20.0}
    track.answered = {"s-1": 10.010, "s-2": 20.030}
    track.pod_ready = {"s-1": 10.030}  # s-2's Pod never seen Ready
    track.ready = {"s-1": 10.050, "s-2": 20.070}
    found = {"create stamped by the API": {"s-1": 10.002, "s-2": 20.004},
             "create committed": {"s-1": 10.008, "s-2": 20.012},
             "launch returned (executor's clock)": {"s-1": 10.031},
             "launch result committed": {"s-1": 10.040},
             "running snapshot committed": {"s-1": 10.041, "s-2": 20.061}}  # fmt: skip
    table = create_steps.steps_table(track, ["s-1", "s-2"], found).splitlines()[1:]
    rows = {line.rsplit(None, 3)[0]: line.split()[-3:] for line in table}
    assert [name for name, _ in create_steps.STEPS] == list(rows)
    assert rows["create committed"] == ["8.0", "12.0", "2"]
    assert rows["Pod Running+Ready (cluster)"] == ["30.0", "30.0", "1"]
    assert rows["Ready in the watch"][2] == "2"
    assert create_steps.STAMPED == (
        "create stamped by the API",
        "launch returned (executor's clock)",
    )


def test_a_bursts_deletes_are_timed_from_their_requests_and_the_slowest_named() -> None:
    track = Track()
    track.deleting = {"b0-1": 10.0, "b0-2": 10.0, "b1-1": 50.0}
    track.delete_answered = {"b0-1": 11.0, "b0-2": 12.0, "b1-1": 51.0}
    track.pod_gone = {"b0-1": 12.0, "b0-2": 13.0, "b1-1": 52.0}
    track.gone = {"b0-1": 13.0, "b0-2": 17.0, "b1-1": 90.0}
    line = peer_burst.delete_line(track, "b0-")
    assert "answered 1.00 / 2.00 / 2.00" in line and "reported gone 3.00 / 7.00 / 7.00" in line
    assert peer_burst.slowest(track, "b0-") == "b0-2"
    track.pod_gone["b0-3"], track.deleting["b0-3"] = 11.0, 10.0  # never reported gone
    assert peer_burst.slowest(track, "b0-") == "b0-3"


class _HeldSystem:
    """A system whose creates are held until released: how many are under way at once."""

    label = "held"
    namespace = "held"

    def __init__(self, track: Track) -> None:
        self.track = track
        self.release = asyncio.Event()
        self.full = asyncio.Event()  # CONNECTIONS creates under way
        self.under_way = 0
        self.most = 0

    async def create(self, name: str) -> None:
        self.under_way += 1
        self.most = max(self.most, self.under_way)
        if self.under_way >= CONNECTIONS:
            self.full.set()
        await self.release.wait()
        self.under_way -= 1
        self.track.note(self.track.ready, name)

    async def delete(self, name: str) -> None:
        self.track.note(self.track.gone, name)
        self.track.note(self.track.pod_gone, name)


class _NoKube:
    async def get(self, path: str, **params: Any) -> None:
        return None


async def test_a_sustained_phase_sends_no_more_creates_at_once_than_its_connections() -> None:
    """A system that falls behind: the load generator's creates past its 50 connections wait
    in the bench, counted from their due time, not all at once in httpx's pool (whose queue
    cost the load generator CPU on every request, in proportion to its length)."""
    track = Track()
    system = _HeldSystem(track)
    count = 4 * CONNECTIONS
    quick = Plan(seconds=count / 10_000, gap=0.0, settle=60.0, timeout=60.0)
    bench = Bench(quick, _NoKube(), _NoKube(), None, [system], {system.label: track})  # type: ignore[arg-type, list-item]
    phase = asyncio.ensure_future(bench.sustained(system, 10_000, "s"))  # type: ignore[arg-type]
    async with asyncio.timeout(60):  # every create due (noted so), and the first ones sent
        while len(track.requested) < count:
            await track.changed.wait()
            track.changed.clear()
        await system.full.wait()
    for _ in range(10):  # every task started has run to its first wait (no timing involved)
        await asyncio.sleep(0)
    assert system.under_way == CONNECTIONS
    system.release.set()
    summary = await asyncio.wait_for(phase, 60)
    assert summary.count == count and system.most == CONNECTIONS


def test_a_bursts_deletes_show_the_spread_of_their_requests_and_the_apis_own_times() -> None:
    track = Track()
    track.deleting = {"b0-1": 10.0, "b0-2": 12.5}
    line = peer_burst.delete_line(track, "b0-")
    assert "sent over 2.50 s" in line
    step = "sandstream_api_command_step_seconds"
    before = Sums({peer_burst.DELETE_ROUTE: (1.0, 2.0), (step, "pool_wait"): (0.5, 10.0)})
    after = Sums({peer_burst.DELETE_ROUTE: (1.6, 5.0), (step, "pool_wait"): (0.54, 18.0)})
    line = peer_burst.api_steps(before, after)
    assert "a delete in the app 200.0 (of 3)" in line and "pool wait 5.0" in line
