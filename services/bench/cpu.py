"""CPU seconds spent per input, beside the wall-clock rates.

On this shared machine other work takes cores away from a run, which halves a rate from one
quarter of an hour to the next; the CPU seconds a drain costs move far less, so a change is
judged by them (paired with the run before it). Counted: this process (the projector runs in
it), the PostgreSQL backends of its connections and the Kafka broker, read from /proc (each
absent when it runs on another machine or in a container of its own). The broker is the local
stack's, shared: whatever else uses it meanwhile counts too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuMark:
    process: float
    backends: dict[int, float] | None  # PostgreSQL backend pid -> its CPU seconds so far
    broker: float | None = None  # the Kafka broker's CPU seconds so far (None: not known)


def mark(backend_pids: Iterable[int], broker_pid: int | None = None) -> CpuMark:
    broker = None
    if broker_pid is not None and (found := _backends([broker_pid])) is not None:
        broker = found[broker_pid]
    return CpuMark(time.process_time(), _backends(backend_pids), broker)


def broker_pid(pidfile: Path) -> int | None:
    """The local broker's pid from its pidfile (None: no broker of this machine's stack)."""
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None


def per_input(start: CpuMark, end: CpuMark, inputs: int) -> str:
    """``N + PostgreSQL M + Kafka K µs CPU/input`` between two marks (a backend that appeared
    in between counts from its start; a part not known is left out)."""
    if inputs <= 0:  # everything was in the first batch: nothing timed
        return "n/a"
    text = f"{(end.process - start.process) / inputs * 1e6:.0f}"
    if start.backends is not None and end.backends is not None:
        spent = sum(cpu - start.backends.get(pid, 0.0) for pid, cpu in end.backends.items())
        text += f" + PostgreSQL {spent / inputs * 1e6:.0f}"
    if start.broker is not None and end.broker is not None:
        text += f" + Kafka {(end.broker - start.broker) / inputs * 1e6:.0f}"
    return text + " µs CPU/input"


def process_cpu(pid: int) -> float:
    """The CPU seconds another process of this machine has spent so far (NaN if unknown)."""
    found = _backends([pid])
    return found[pid] if found else float("nan")


def _backends(pids: Iterable[int]) -> dict[int, float] | None:
    spent = {}
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            spent[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
    return spent
