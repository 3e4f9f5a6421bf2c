"""``python -m services.bench create-steps [--rate R] [--rounds N] [--quick]``: where a
create's time goes at a steady low rate, the peer bench's sustained goal at 20/s (sandstream's
p90 request → Ready within agent-sandbox's).

The burst's set-up (services/bench/peer_burst.py: a cluster and a broker of its own,
``sandstream up --driver kubernetes``, bare Pods beside it), creates offered open loop at the
rate for ten seconds (``--quick`` five), sandstream and bare Pods alternating round by round.
For each sandstream create, its steps from the request (p50 / p90 ms): the API's answer, its
``CreateSandbox`` committed in the history (API → Kafka → processor), the launch's result
committed (the outbox relayed → executor → Pod created → result → processor), the Pod seen
Running and Ready by the load generator's own watch (the cluster), the running snapshot
committed (the driver's watch → Kafka → processor) and the row Ready in the API's watch (the
change feed). Bare Pods' request → Pod Ready at the same rate is the reference."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from services.bench import peer_setup
from services.bench.peer import orders
from services.bench.peer_burst import stage
from services.bench.peer_report import Plan, ready_line
from services.bench.peer_stats import render_rows, summarize
from services.bench.peer_systems import CONNECTIONS, FLOOR, OURS, SandstreamApi, Track
from services.common.settings import Settings

Item = Mapping[str, Any]
# Steps timed by the message's own time (its producer's clock), not by its commit.
STAMPED = ("create stamped by the API", "launch returned (executor's clock)")


def _launch(item: Item) -> bool:
    return bool(
        item["message_type"] == "DriverOperationResult"
        and item["message"].get("operation") == "launch"
    )


# A step: its name, and how to know it in a history item (None: not from the history).
STEPS: tuple[tuple[str, Callable[[Item], bool] | None], ...] = (
    ("API answered", None),
    ("create stamped by the API", lambda i: i["message_type"] == "CreateSandbox"),
    ("create committed", lambda i: i["message_type"] == "CreateSandbox"),
    ("Pod Running+Ready (cluster)", None),
    ("launch returned (executor's clock)", _launch),
    ("launch result committed", _launch),
    ("running snapshot committed", lambda i: i["message_type"] == "RuntimeSnapshot"
     and i["message"].get("state") == "running"),
    ("Ready in the watch", None),
)  # fmt: skip


async def history_steps(api: SandstreamApi, names: list[str]) -> dict[str, dict[str, float]]:
    """Each step's perf_counter time per name, from the histories' recorded times."""
    offset = time.time() - time.perf_counter()  # recorded_at is wall-clock
    found: dict[str, dict[str, float]] = {step: {} for step, known in STEPS if known}
    gate = asyncio.Semaphore(CONNECTIONS)

    async def one(name: str) -> None:
        async with gate:
            response = await api.client.get(f"/v1/sandboxes/{name}/history", params={"limit": 100})
        for item in response.json().get("items", []) if response.status_code == 200 else []:
            for step, known in STEPS:
                if known and known(item) and name not in found[step]:
                    stamp = item["message"]["occurred_at"] if step in STAMPED else None
                    at = datetime.fromisoformat(stamp or item["recorded_at"]).timestamp()
                    found[step][name] = at - offset

    await asyncio.gather(*(one(n) for n in names))
    return found


def steps_table(track: Track, names: list[str], found: Mapping[str, Mapping[str, float]]) -> str:
    """p50 / p90 ms from the request, each step."""
    times = {**found, "API answered": track.answered, "Ready in the watch": track.ready,
             "Pod Running+Ready (cluster)": track.pod_ready}  # fmt: skip
    rows = [["step (from the request)", "p50 ms", "p90 ms", "of"]]
    for step, _ in STEPS:
        at = times[step]
        got = [at[n] - track.requested[n] for n in names if n in at and n in track.requested]
        s = summarize(got, len(names))
        rows.append([step, f"{s.p50 * 1000:.1f}", f"{s.p90 * 1000:.1f}", str(s.count)])
    return render_rows(rows)


async def main(settings: Settings, rate: int, seconds: float, rounds: int) -> None:
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    home = settings.state_dir / "bench" / f"create-steps-{run_id}"
    home.mkdir(parents=True)
    plan = Plan(sandboxes=50, rounds=rounds, seconds=seconds, gap=3.0, settle=30.0)
    print(
        f"creates at {rate}/s for {seconds:.0f} s, {rounds} rounds, sandstream beside bare "
        f"Pods ({os.cpu_count()} cores, load average {_load()} at the start)",
        flush=True,
    )
    async with stage(settings, plan, home) as on:
        for i, order in enumerate(orders(on.bench.systems, rounds)):
            print(f"round {i + 1} of {rounds}", flush=True)
            for system in order:
                tag = f"r{i}{'f' if system.label == FLOOR else 's'}"
                summary = await on.bench.sustained(system, rate, tag)
                track = on.tracks[system.label]
                names = [n for n in track.requested if n.startswith(f"{tag}-")]
                if system.label == FLOOR:
                    pods = summarize(
                        [track.pod_ready[n] - track.requested[n] for n in names
                         if n in track.pod_ready], len(names),
                    )  # fmt: skip
                    print(f"  {'':<14} Pod Running+Ready {ready_line(pods)}")
                    continue
                found = await history_steps(on.api, names)
                print(f"  {OURS}: {ready_line(summary)}")
                print(steps_table(track, names, found), flush=True)
    print(f"(load average {_load()} at the end)")
    peer_setup.remove(home)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())
