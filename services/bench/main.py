"""``python -m services.bench [all|processor|latency|decided|claim|idle|idle-use|scaleout|
rebuild|profile|fold|stages|drivers|peer|kube-requests|burst|warm|exec|scaling|api-rate|
create-steps|handoff]
[--quick]``: the benchmarks, each printed beside its same-run reference (see
docs/benchmarks.md). ``latency`` is the latency part of ``processor`` alone; ``decided`` is
request → decided outcome at low load, through the HTTP API; ``claim`` (not part of ``all``) a
warm claim at low load, step by step, beside ``decided``'s figure; ``idle`` (not part of
``all``) the broker's CPU for an idle control plane on a broker of its own; ``idle-use`` (not
part of ``all``) what idle suspend costs
PostgreSQL at 10,000 busy sandboxes; ``peer`` (services/bench/peer.py, ``make bench-peer``) is
not part of ``all``: it starts a Kubernetes cluster of its own and takes about a quarter of an
hour. ``kube-requests`` (services/bench/kube_requests.py) counts the Kubernetes driver's
apiserver requests per sandbox beside bare Pods' on the local cluster (`make k8s`), in a minute.
``burst`` (services/bench/peer_burst.py) is the peer bench's cold burst for sandstream beside
bare Pods alone, with sandstream's CPU, records and rows per sandbox broken down. ``warm``
(services/bench/warm.py) times a warm claim beside a cold create on Podman, each to an exec's
answer; ``exec`` (services/bench/exec_route.py, not part of ``all``) an exec through the HTTP
API step by step, beside the driver's exec alone. ``scaling`` (services/bench/scaling.py, not
part of ``all``) runs the processor and the executor as 1, 2 and 4 processes on three brokers
of its own. ``api-rate`` (services/bench/api_rate.py, not part of ``all``) offers creates to
``sandstream up`` (fake driver) at rising rates, beside its trivial endpoint and Kafka's own
produce at each rate. ``create-steps`` (services/bench/create_steps.py, not part of ``all``)
times each create's steps at a steady low rate (``--rate``, 20/s) beside bare Pods. ``handoff``
(services/bench/handoff.py, not part of ``all``) times creates one at a time to Ready with the
processor's hand-over to the executor and without it, beside Kafka's own round trip."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from services.bench import create_steps, exec_route, kube_requests, peer, peer_burst, scaling, warm
from services.bench import drivers as bench_drivers
from services.bench import kube as bench_kube
from services.bench import wake as bench_wake
from services.bench.api_rate import api_rate_figures
from services.bench.claim import claim_figures
from services.bench.decided import decided_figures
from services.bench.fold import fold_figures
from services.bench.handoff import handoff_figures
from services.bench.idle import idle_figures
from services.bench.idle_use import idle_use_figures
from services.bench.processor import latency, throughput
from services.bench.profile import profile
from services.bench.rebuild import rebuild_figures
from services.bench.scaleout import two_processors
from services.bench.stages import stage_figures
from services.common.settings import Settings
from services.processor.gc_thresholds import collect_less_often

CHOICES = (
    "all",
    "processor",
    "latency",
    "decided",
    "claim",
    "idle",
    "idle-use",
    "scaleout",
    "rebuild",
    "profile",
    "fold",
    "stages",
    "drivers",
    "peer",
    "kube-requests",
    "burst",
    "warm",
    "exec",
    "scaling",
    "api-rate",
    "create-steps",
    "handoff",
)


async def run(
    which: str,
    quick: bool,
    latency_rate: int = 1000,
    peer_plan: peer.Plan | None = None,
    sandboxes: int | None = None,
    profile_dir: Path | None = None,
    rate: int = 20,
) -> None:
    settings = Settings()
    if which == "create-steps":
        rounds = peer_plan.rounds if peer_plan else 3
        await create_steps.main(settings, rate, 5.0 if quick else 10.0, rounds)
        return
    if which == "burst":
        rounds = peer_plan.rounds if peer_plan else 3
        await peer_burst.main(settings, sandboxes or 300, rounds, profile_dir)
        return
    if which == "kube-requests":
        await kube_requests.main(settings, sandboxes or (10 if quick else 30))
        return
    if which == "peer":
        await peer.run(settings, peer_plan or peer.plan(quick))
        return
    if which == "warm":
        await warm.main(settings, sandboxes or (10 if quick else 30))
        return
    if which == "exec":
        await exec_route.main(settings, sandboxes or (30 if quick else 100))
        return
    if which == "scaling":
        await scaling.main(settings, quick)
        return
    if which == "api-rate":
        await api_rate_figures(settings, quick)
        return
    print(f"sandstream benchmarks  (partitions={settings.kafka_partitions}, one processor)")
    keys = 5_000 if quick else 25_000
    if which in ("all", "processor"):
        for max_records in (1000, 5000):
            await throughput(settings, keys, max_records)
    if which in ("all", "processor", "latency"):
        await latency(settings, rate=latency_rate, seconds=5 if quick else 15)
    if which in ("all", "decided"):
        await decided_figures(settings, 100 if quick else 400)
    if which == "handoff":
        await handoff_figures(settings, 50 if quick else 200)
    if which == "claim":
        await claim_figures(settings, 50 if quick else 200)
    if which == "idle":
        await idle_figures(settings, 10 if quick else 30)
    if which == "idle-use":
        await idle_use_figures(settings, sandboxes or 10_000, 5 if quick else 20)
    if which in ("all", "scaleout"):
        await two_processors(settings, keys)
    if which in ("all", "rebuild"):
        await rebuild_figures(settings, 25_000 if quick else 250_000)
    if which == "fold":
        fold_figures(keys, runs=7)
    if which == "stages":
        stage_figures(settings, keys, runs=7)
    if which == "profile":
        # A file per run: the state directory is shared, and runs at the same time would
        # overwrite one file. The path is printed.
        run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        await profile(settings, keys, settings.state_dir / "bench" / f"processor-{run_id}.prof")
    if which in ("all", "drivers"):
        await bench_drivers.main(settings)
        await bench_kube.main(settings)
        await bench_wake.main(settings)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.bench", description=__doc__)
    parser.add_argument(
        "which",
        nargs="?",
        default="all",
        choices=CHOICES,
    )
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke check")
    parser.add_argument(
        "--sandboxes",
        type=int,
        default=None,
        help="peer, burst: sandboxes per burst (default 300); kube-requests: sandboxes "
        "(default 30); idle-use: busy sandboxes (default 10000)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="peer, burst: burst rounds (default 3, --quick 1)",
    )
    parser.add_argument(
        "--phases",
        default="cold,warm",
        help="peer: cold (bursts of creates, sustained rates), warm (pools and claims), or both",
    )
    parser.add_argument(
        "--pool", type=int, default=None, help="peer: warm pool size and burst (100, --quick 20)"
    )
    parser.add_argument(
        "--claim-rate", type=int, default=10, help="peer: warm claims a second, sustained (10)"
    )
    parser.add_argument("--rate", type=int, default=20, help="create-steps: creates a second (20)")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="burst: py-spy records `sandstream up` through each burst into this directory",
    )
    args = parser.parse_args()
    phases = tuple(p for p in args.phases.split(",") if p)
    if not phases or set(phases) - {"cold", "warm"}:
        parser.error(f"--phases: cold, warm or cold,warm (got {args.phases!r})")
    collect_less_often()  # as the processor's own process does (the ceiling runs under it too)
    peer_plan = peer.plan(
        args.quick, args.sandboxes or 300, args.rounds, phases, args.pool, args.claim_rate
    )
    asyncio.run(
        run(args.which, args.quick, peer_plan=peer_plan, sandboxes=args.sandboxes,
            profile_dir=args.profile, rate=args.rate)
    )  # fmt: skip
