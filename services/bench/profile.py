"""Profile of the processor's hot path: one processor drains a generated log under cProfile in
this process; the profile is written to a file (``python -m pstats FILE`` or snakeviz read it)
and the CPU per input is printed by stage.

Stages are functions of the processor's path; for a coroutine cProfile counts only the time
its frames run, so a stage is CPU spent, never time spent waiting for Kafka or PostgreSQL.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import time
from pathlib import Path
from typing import Final

from services.bench.drained import applied
from services.bench.workload import lifecycle_messages, produce_all
from services.common.settings import Settings
from services.localstack.isolation import isolated
from services.processor.consumer import Processor

# stage -> (file suffix, function name) whose cumulative time the stage is.
STAGES: Final = {
    "decode + validate": ("events/codec.py", "decode"),
    "parse (all)": ("services/processor/intake.py", "parse"),
    "decide (fold)": ("projections/fold.py", "fold"),
    "encode": ("events/codec.py", "encode"),
    "plan (all)": ("services/processor/plan.py", "plan_batch"),
    "write": ("projections/store.py", "write_batch"),
    "publish": ("services/processor/publish.py", "publish"),
    "apply (all)": ("services/processor/write.py", "apply"),
}


async def _drain(settings: Settings, keys: int, profiler: cProfile.Profile) -> tuple[int, float]:
    async with isolated(settings, "bench") as (s, pool):
        records, total = lifecycle_messages(keys)
        await produce_all(s, records)
        # cProfile sees this thread only, and a poll decided ahead is decided in another.
        serial = s.model_copy(update={"processor_decide_ahead": False})
        processor = Processor(serial, pool, max_records=5000, name="bench")
        await processor.start()
        stop = asyncio.Event()
        profiler.enable()
        started = time.perf_counter()
        task = asyncio.create_task(processor.run(stop))
        while await applied(pool) < total:
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - started
        profiler.disable()
        stop.set()
        await task
        await processor.stop()
        return total, elapsed


def stage_table(stats: pstats.Stats, inputs: int) -> list[tuple[str, float]]:
    """(stage, µs of CPU per input) for each stage found in the profile."""
    table = []
    raw = stats.stats  # type: ignore[attr-defined]
    for stage, (suffix, name) in STAGES.items():
        cumulative = sum(
            entry[3]
            for (filename, _, function), entry in raw.items()
            if function == name and filename.endswith(suffix)
        )
        table.append((stage, cumulative / inputs * 1e6))
    return table


async def profile(settings: Settings, keys: int, out: Path) -> None:
    profiler = cProfile.Profile()
    inputs, elapsed = await _drain(settings, keys, profiler)
    out.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(out)
    stats = pstats.Stats(str(out))
    print(f"profile     {inputs:,} inputs in {elapsed:.1f} s under cProfile; written to {out}")
    for stage, micros in stage_table(stats, inputs):
        print(f"  {stage:<18} {micros:8.1f} µs/input")
