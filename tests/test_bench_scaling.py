"""The scaling benchmark (services/bench/scaling.py) at its smallest, end to end: the
processor and the executor as one and two processes of the real role commands on three brokers
of its own. Behaviour, not speed: each process held a share of the work, every input was
recorded once and moved its row once, every create was launched once and came Ready, and the
steady creates all reached their rows."""

from __future__ import annotations

from pathlib import Path

from services.bench import scaling
from services.common.settings import Settings


async def test_the_scaling_bench_shares_the_work_out_and_applies_every_input_once(
    settings: Settings, tmp_path: Path
) -> None:
    # Two processes started together join within the brokers' initial rebalance delay (a
    # later join would only move partitions: the checks below hold either way).
    plan = scaling.Plan(counts=(1, 2), keys=100, creates=40, seconds=0.5, idle_seconds=0.5,
                        rebalance_delay_ms=1500, logs=tmp_path)  # fmt: skip
    figures = await scaling.run(settings, plan)
    assert [(f.role, f.count) for f in figures] == [
        ("processor", 1), ("processor", 2), ("executor", 1), ("executor", 2)
    ]  # fmt: skip
    for f in figures:
        assert f.correct, f"{f.role} x{f.count}: {f.checked}"
        assert len(f.shares) == f.count and min(f.shares) > 0, (f.role, f.shares)
        assert sum(f.shares) == (4 * plan.keys if f.role == "processor" else plan.creates)
        assert f.steady is not None and len(f.steady.ms) == f.steady.count, f.steady
        # At this size the processes can drain the whole backlog before the timed window
        # opens (once they all hold their shares): then nothing is timed, the bench prints
        # "0 inputs at 0/s", and there is no CPU per input to check.
        if f.window[1]:
            assert f.cpu_us["Kafka"] > 0 and f.cpu_us[f"{f.role}s"] > 0, f.cpu_us
