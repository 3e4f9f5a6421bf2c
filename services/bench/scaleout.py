"""Scale-out: two processors in one consumer group, separate processes, on one generated log.

Both processes start on the empty topics; once the group has shared the partitions out between
them (each logs its assignment), the log is produced and drained. Prints their combined
throughput (timed from the first committed batch to the last input applied), the shares, and
the ceiling projector (``services.bench.ceiling``, one process) on the same log right after.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys

from services.bench import ceiling
from services.bench.drained import timed_drain
from services.bench.workload import lifecycle_messages, produce_all
from services.common.settings import Settings
from services.localstack.isolation import isolated

ASSIGNED = re.compile(r"assigned partitions \[([0-9, ]*)\]")


async def _follow(stream: asyncio.StreamReader, shares: list[set[int]]) -> None:
    """Record every assignment the process logs, in order."""
    async for line in stream:
        found = ASSIGNED.search(line.decode(errors="replace"))
        if found:
            shares.append({int(p) for p in found.group(1).split(",") if p.strip()})


async def two_processors(settings: Settings, keys: int) -> None:
    async with isolated(settings, "bench") as (s, _):
        env = {**os.environ, **s.as_env()}
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.processor",
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            for _ in range(2)
        ]
        shares: list[list[set[int]]] = [[], []]
        followers = [
            asyncio.create_task(_follow(p.stderr, shares[i]))  # type: ignore[arg-type]
            for i, p in enumerate(procs)
        ]
        try:
            await asyncio.wait_for(_shared_out(shares, s.kafka_partitions), 120)
            records, total = lifecycle_messages(keys)
            await produce_all(s, records)
            drained = await timed_drain(s, total)
            first, elapsed = drained.first, drained.elapsed
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                await proc.wait()
            await asyncio.gather(*followers)
        roof, _ = await ceiling.measured_drain(s, total, max_records=s.processor_max_records)
        rate = (total - first) / elapsed
        split = "; ".join(f"process {i + 1}: {sorted(sh[-1]) if sh else '?'}"
                          for i, sh in enumerate(shares))  # fmt: skip
        print(
            f"scale-out   {total - first:>7} inputs  two processors  "
            f"{rate:>9,.0f}/s combined  (after sharing out: {split})\n"
            f"            ceiling (one process, same log) {roof:>9,.0f}/s  "
            f"combined/ceiling {rate / roof:.2f}"
        )


async def _shared_out(shares: list[list[set[int]]], partitions: int) -> None:
    """Until each process's latest assignment is its own non-empty half of the partitions."""
    while True:
        latest = [sh[-1] if sh else set() for sh in shares]
        disjoint = all(latest) and not (latest[0] & latest[1])
        if disjoint and len(latest[0] | latest[1]) == partitions:
            return
        await asyncio.sleep(0.05)
