"""CPU seconds spent per input, beside the wall-clock rates.

On this shared machine other work takes cores away from a run, which halves a rate from one
quarter of an hour to the next; the CPU seconds a drain costs move far less, so a change is
judged by them (paired with the run before it). Counted: this process (the projector runs in
it), the PostgreSQL backends of its connections and the Kafka broker, read from /proc (each
absent when it runs on another machine or in a container of its own). The broker is the local
stack's, shared: whatever else uses it meanwhile counts too.

For a paced run, ``machine_mark``/``machine_budget`` also count the cores' busy ticks
(/proc/stat) and the CPU of every party sharing them (processes given by pid), per command.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterable, Mapping
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


@dataclass(frozen=True, slots=True)
class PerInput:
    """µs of CPU per input between two marks: this process, its PostgreSQL backends, the
    broker (None: not known)."""

    process: float
    postgres: float | None
    broker: float | None

    def __str__(self) -> str:
        text = f"{self.process:.0f}"
        if self.postgres is not None:
            text += f" + PostgreSQL {self.postgres:.0f}"
        if self.broker is not None:
            text += f" + Kafka {self.broker:.0f}"
        return text + " µs CPU/input"


def spent(start: CpuMark, end: CpuMark, inputs: int) -> PerInput | None:
    """The CPU per input between two marks (a backend that appeared in between counts from
    its start; a part not known is None); None when nothing was timed."""
    if inputs <= 0:  # everything was in the first batch: nothing timed
        return None
    postgres = broker = None
    if start.backends is not None and end.backends is not None:
        used = sum(cpu - start.backends.get(pid, 0.0) for pid, cpu in end.backends.items())
        postgres = used / inputs * 1e6
    if start.broker is not None and end.broker is not None:
        broker = (end.broker - start.broker) / inputs * 1e6
    return PerInput((end.process - start.process) / inputs * 1e6, postgres, broker)


def per_input(start: CpuMark, end: CpuMark, inputs: int) -> str:
    """``N + PostgreSQL M + Kafka K µs CPU/input`` between two marks (``spent``)."""
    return str(spent(start, end, inputs) or "n/a")


@dataclass(frozen=True, slots=True)
class MachineMark:
    """Everything that shares the cores during a paced run, at one moment."""

    cores: tuple[int, int] | None  # (busy, all) clock ticks of every core since boot
    parties: dict[str, dict[int, float]]  # party -> pid -> its CPU seconds so far


def machine_mark(parties: Mapping[str, Iterable[int]]) -> MachineMark:
    """The cores' ticks and the CPU of each party's processes (those that could be read)."""
    return MachineMark(_cores(), {name: _readable(pids) for name, pids in parties.items()})


def machine_budget(start: MachineMark, end: MachineMark, commands: int) -> str:
    """``N cores M % busy; CPU per command (µs): party K, ...`` between two marks: a party
    counts the processes read at both (none read: left out); no cores figure off Linux."""
    spent = party_seconds(start, end)
    per = ", ".join(f"{name} {cpu / commands * 1e6:.0f}" for name, cpu in spent.items())
    text = f"CPU per command (µs): {per or 'n/a'}"
    if (busy := cores_busy(start, end)) is not None:
        text = f"{os.cpu_count()} cores {busy * 100:.0f} % busy; {text}"
    return text


def party_seconds(start: MachineMark, end: MachineMark) -> dict[str, float]:
    """Each party's CPU seconds between two marks, over the processes read at both (a party
    with none is left out)."""
    spent = {}
    for name, before in start.parties.items():
        after = end.parties.get(name, {})
        if pids := before.keys() & after.keys():
            spent[name] = sum(after[pid] - before[pid] for pid in pids)
    return spent


def cores_busy(start: MachineMark, end: MachineMark) -> float | None:
    """The share (0..1) of the cores' time busy between two marks (None off Linux)."""
    if start.cores is None or end.cores is None:
        return None
    busy, every = (e - s for s, e in zip(start.cores, end.cores, strict=True))
    return busy / max(every, 1)


def _cores() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as stat:
            ticks = [int(t) for t in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return sum(ticks) - idle, sum(ticks)


def _readable(pids: Iterable[int]) -> dict[int, float]:
    return {pid: cpu for pid in pids if not math.isnan(cpu := process_cpu(pid))}


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


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (any of its threads'; none if it is gone)."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                found += [int(child) for child in listed.read().split()]
    except OSError:
        return found
    return found


def connected_ports(pid: int, remote_port: int) -> list[int]:
    """The local ports of process ``pid``'s TCP connections to ``remote_port`` (IPv4 and IPv6;
    empty when /proc cannot tell): how a process's PostgreSQL backends are found, by the
    client ports pg_stat_activity shows."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        tables = [Path(f"/proc/{pid}/net/{name}").read_text() for name in ("tcp", "tcp6")]
    except OSError:
        return []
    return [port for table in tables for port in ports_to(table, inodes, remote_port)]


def ports_to(tcp_table: str, inodes: set[int], remote_port: int) -> list[int]:
    """From a /proc/net/tcp table: the local ports of the sockets ``inodes`` whose remote port
    is ``remote_port``."""
    ports = []
    for line in tcp_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, remote, inode = fields[1], fields[2], int(fields[9])
        if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == remote_port:
            ports.append(int(local.rsplit(":", 1)[1], 16))
    return ports
