"""What the scaling benchmark runs on: three Kafka brokers of its own, the roles as processes
(the real ``sandstream processor`` and ``sandstream executor`` commands), the partitions each
process was given, and the CPU of everything that does the work.

The brokers are a KRaft cluster of the bench's own (services/localstack/cluster.py, as the
checker starts one), so no other client counts in their CPU; topics get the product's
replication (3) and min ISR (2). PostgreSQL is the machine's shared one, a schema per run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import tempfile
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from services.bench import cpu
from services.chaos.launch import RoleProcess
from services.common.settings import Settings
from services.localstack import cluster
from services.localstack import cluster_config as cc

ASSIGNED = re.compile(r" assigned (?:partitions )?\[([0-9, ]*)\]")


@dataclass(frozen=True)
class Brokers:
    settings: Settings  # what clients use: every node listed, topics replicated 3 times
    pids: list[int]


@asynccontextmanager
async def three_brokers(
    base: Settings, partitions: int, rebalance_delay_ms: int
) -> AsyncIterator[Brokers]:
    """A three-node cluster of the run's own with the roles' users and ACLs; removed after.

    ``rebalance_delay_ms``: the brokers' ``group.initial.rebalance.delay.ms`` (Kafka's own
    default is 3,000; the local stack's 0): a group's first assignment waits that long after
    each join, so processes started together share the partitions from their first poll."""
    with tempfile.TemporaryDirectory(prefix="sandstream-scaling-") as home:
        port = cluster.free_port_run(6)
        nodes = base.model_copy(update={
            "kafka_bootstrap": f"127.0.0.1:{port}", "kafka_controller_port": port + 1,
            "kafka_brokers": 3, "kafka_partitions": partitions,
            "state_dir": Path(home) / "kafka", "driver_route_prefix": None,
        })  # fmt: skip
        extra = {"group.initial.rebalance.delay.ms": str(rebalance_delay_ms)}
        try:
            started = await asyncio.to_thread(cluster.start, nodes, extra)
            await asyncio.to_thread(cluster.wait, nodes, started)
            await asyncio.to_thread(cluster.secure, nodes)
            pids = [pid for n in cc.nodes(nodes) if (pid := cluster.node_pid(n)) is not None]
            # The clients keep the base's state dir (PostgreSQL's password file is found
            # there) and log in with the cluster's own credentials.
            clients = nodes.model_copy(update={
                "kafka_bootstrap": cc.bootstrap_list(nodes), "state_dir": base.state_dir,
                "kafka_credentials_file": nodes.kafka_credentials_path,
                "pg_password_file": base.pg_password_path,
            })  # fmt: skip
            yield Brokers(clients, pids)
        finally:
            # The run's data is thrown away: no clean shutdown to wait for (a node can take a
            # minute on a busy machine), then the usual stop finds nothing left running.
            for node in cc.nodes(nodes):
                if (pid := cluster.node_pid(node)) is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(cluster.stop, nodes)


@dataclass
class Roles:
    """``count`` processes of one role, started together, their logs in ``logs``."""

    role: str
    count: int
    settings: Settings
    logs: Path

    def __post_init__(self) -> None:
        self.procs = [
            RoleProcess(self.role, i + 1, self.settings, self.logs) for i in range(self.count)
        ]

    def start(self) -> None:
        for proc in self.procs:
            proc.start()

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self.procs))

    @property
    def pids(self) -> list[int]:
        return [p.proc.pid for p in self.procs if p.proc is not None]

    def assignments(self) -> list[list[set[int]]]:
        """Every assignment each process has logged so far, in order."""
        return [_assignments(p.log) for p in self.procs]

    def crashed(self) -> list[str]:
        return [f"{p.name} (exit {p.exit_code()}, {p.log})" for p in self.procs if not p.running()]

    async def shared_out(self, partitions: int, timeout: float = 180) -> list[set[int]]:
        """Wait until each process's latest assignment is a non-empty share of its own and
        the shares cover every partition; the shares."""
        async with asyncio.timeout(timeout):
            while True:
                if dead := self.crashed():
                    raise RuntimeError(f"{self.role} process ended: {', '.join(dead)}")
                latest = [found[-1] if found else set() for found in self.assignments()]
                covered = set().union(*latest)
                disjoint = sum(map(len, latest)) == len(covered)
                if all(latest) and disjoint and len(covered) == partitions:
                    return latest
                await asyncio.sleep(0.05)


def _assignments(log: Path) -> list[set[int]]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    found = (m.group(1) for m in ASSIGNED.finditer(text))
    return [{int(p) for p in part.split(",") if p.strip()} for part in found]


@asynccontextmanager
async def running(roles: Roles) -> AsyncIterator[Roles]:
    roles.start()
    try:
        yield roles
    finally:
        await roles.stop()


async def backends(
    conn: asyncpg.Connection[asyncpg.Record], pids: Iterable[int], port: int
) -> list[int]:
    """The PostgreSQL backends serving the processes ``pids`` (by their connections' ports)."""
    ports = [p for pid in pids for p in cpu.connected_ports(pid, port)]
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE client_port = ANY($1::int[])", ports
    )
    return [r["pid"] for r in rows]


async def parties(
    conn: asyncpg.Connection[asyncpg.Record],
    settings: Settings,
    roles: Sequence[Roles],
    brokers: Brokers,
) -> dict[str, list[int]]:
    """Who does the work: each role's processes, their PostgreSQL backends, the brokers (the
    load generator, this process, is left out)."""
    found: dict[str, list[int]] = {f"{r.role}s": r.pids for r in roles}
    every = [pid for r in roles for pid in r.pids]
    found["PostgreSQL"] = await backends(conn, every, settings.pg_port)
    found["Kafka"] = brokers.pids
    return found
