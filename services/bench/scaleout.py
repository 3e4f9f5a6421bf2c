"""Scale-out: two processors in one consumer group, separate processes, on one generated log.

Prints their combined throughput (timed from the first committed batch to the last input
applied) and how the group shared the partitions out (each process logs its assignment).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys

from services.bench.processor import lifecycle_messages, produce_all, timed_drain
from services.common.settings import Settings
from services.localstack.isolation import isolated

ASSIGNED = re.compile(r"(\S+) assigned partitions \[([0-9, ]*)\]")


async def two_processors(settings: Settings, keys: int) -> None:
    async with isolated(settings, "bench") as (s, pool):
        records, total = lifecycle_messages(keys)
        await produce_all(s, records)
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
        try:
            first, elapsed = await timed_drain(pool, total)
        finally:
            for proc in procs:
                proc.terminate()
            logs = [(await proc.communicate())[1].decode(errors="replace") for proc in procs]
        shares = []
        for number, log in enumerate(logs, 1):
            found = ASSIGNED.findall(log)
            last = found[-1][1] if found else "?"
            shares.append(f"process {number}: [{last}] ({len(found)} assignments)")
        print(
            f"scale-out   {total - first:>7} inputs  two processors  "
            f"{(total - first) / elapsed:>9,.0f}/s combined  " + "; ".join(shares)
        )
