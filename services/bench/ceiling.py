"""The ceiling: what this machine allows an exactly-once projector to do on the same log.

A minimal correct projector, written for the benchmark and never used by the product: it
consumes the input topics with aiokafka (no group: every partition assigned, resumed from the
offsets it stored), decodes each JSON record, folds the latest phase per key in memory, and per
poll writes, in one transaction, the changed rows (COPY into a temporary table, one upsert), one
history row per input (COPY) and the partitions' offsets, moved by compare-and-set as the
processor does. It skips everything that makes sandstream sandstream (validation, the lifecycle
rules, outcomes, the outbox, dead letters): the processor's throughput divided by this one's,
measured on the same log in the same run, says how much the product's work costs.
"""

from __future__ import annotations

import heapq
import json
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.bench import cpu
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings

DDL = """
CREATE TABLE IF NOT EXISTS ceiling_rows (
    key text PRIMARY KEY, phase text NOT NULL, version bigint NOT NULL);
CREATE TABLE IF NOT EXISTS ceiling_history (
    key text NOT NULL, version bigint NOT NULL, topic text NOT NULL, part int NOT NULL,
    "offset" bigint NOT NULL, phase text NOT NULL, PRIMARY KEY (key, version));
CREATE TABLE IF NOT EXISTS ceiling_offsets (
    topic text NOT NULL, part int NOT NULL, next_offset bigint NOT NULL,
    PRIMARY KEY (topic, part));
"""
# The phase each benchmark input leads to (the workload of services/bench/processor.py).
PHASES = {
    ("CreateSandbox", None): "Provisioning",
    ("StopSandbox", None): "Stopping",
    ("RuntimeSnapshot", "running"): "Ready",
    ("RuntimeSnapshot", "exited"): "Stopped",
}
CAS_OFFSETS = """
WITH moved AS (
    INSERT INTO ceiling_offsets AS o (topic, part, next_offset)
    SELECT * FROM unnest($1::text[], $2::int[], $4::bigint[])
    ON CONFLICT (topic, part) DO UPDATE SET next_offset = EXCLUDED.next_offset
    WHERE o.next_offset = (SELECT e FROM unnest($1::text[], $2::int[], $3::bigint[]) AS x(t, p, e)
                           WHERE x.t = o.topic AND x.p = o.part)
    RETURNING 1)
SELECT count(*) FROM moved
"""


class Fenced(Exception):
    """Another writer moved the offsets: this projector's view is stale."""


@dataclass
class Ceiling:
    settings: Settings
    conn: asyncpg.Connection[asyncpg.Record]
    rows: dict[str, tuple[str, int]] = field(default_factory=dict)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    applied: int = 0

    async def apply(self, batch: dict[TopicPartition, list[Any]]) -> None:
        changed: dict[str, tuple[str, str, int]] = {}
        history: list[tuple[str, int, str, int, int, str]] = []
        moved: dict[tuple[str, int], int] = {}
        by_partition: dict[int, list[list[Any]]] = {}
        for tp, records in batch.items():
            by_partition.setdefault(tp.partition, []).append(records)
            moved[(tp.topic, tp.partition)] = records[-1].offset + 1
        for lists in by_partition.values():  # a partition's two topics by record time, as the
            for record in heapq.merge(*lists, key=lambda r: r.timestamp):  # processor does
                message = json.loads(record.value)
                key = message["key"]
                phase = PHASES[(message["type"], message.get("state"))]
                version = self.rows.get(key, ("", 0))[1] + 1
                self.rows[key] = (phase, version)
                changed[key] = (key, phase, version)
                history.append((key, version, record.topic, record.partition, record.offset, phase))
        async with self.conn.transaction():
            # The offsets first, by compare-and-set: a fenced writer writes nothing.
            parts = list(moved)
            count = await self.conn.fetchval(
                CAS_OFFSETS,
                [t for t, _ in parts],
                [p for _, p in parts],
                [self.offsets.get(tp, 0) for tp in parts],
                [moved[tp] for tp in parts],
            )
            if count != len(parts):
                raise Fenced(f"offsets of {len(parts) - count} partitions moved by another writer")
            await self.conn.copy_records_to_table("ceiling_changed", records=changed.values())
            await self.conn.execute(
                "INSERT INTO ceiling_rows SELECT * FROM ceiling_changed ON CONFLICT (key) DO "
                "UPDATE SET phase = EXCLUDED.phase, version = EXCLUDED.version"
            )
            await self.conn.copy_records_to_table("ceiling_history", records=history)
        self.offsets.update(moved)
        self.applied += len(history)


async def drain(settings: Settings, total: int, max_records: int = 5000) -> float:
    """Project the isolated environment's whole input log; inputs per second, timed from the
    first committed batch (like the processor's figure)."""
    return (await measured_drain(settings, total, max_records))[0]


async def measured_drain(
    settings: Settings, total: int, max_records: int = 5000, broker: int | None = None
) -> tuple[float, str]:
    """``drain``'s rate and the CPU it cost per input over the same inputs (the ``broker``
    process's too, if given)."""
    dsn, schema = settings.pg_dsn, settings.pg_schema
    conn = await asyncpg.connect(dsn, server_settings={"search_path": schema})
    await conn.execute(DDL)
    await conn.execute(
        "CREATE TEMP TABLE ceiling_changed (key text, phase text, version bigint) "
        "ON COMMIT DELETE ROWS"
    )
    consumer = AIOKafkaConsumer(
        **kafka_client_args(settings, "audit"),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=settings.processor_fetch_max_wait_ms,
    )
    await consumer.start()
    try:
        topics = [settings.topic_commands, settings.topic_observations]
        # The isolated environment created them with the configured partition count.
        consumer.assign(
            [TopicPartition(t, p) for t in topics for p in range(settings.kafka_partitions)]
        )
        ceiling = Ceiling(settings, conn)
        started: float | None = None
        first = 0
        while ceiling.applied < total:
            batch = await consumer.getmany(timeout_ms=200, max_records=max_records)
            if not batch:
                continue
            await ceiling.apply(batch)
            if started is None:
                started, first = time.perf_counter(), ceiling.applied
                cpu_started = cpu.mark([conn.get_server_pid()], broker)
        elapsed = time.perf_counter() - (started or time.perf_counter())
        used = cpu.per_input(cpu_started, cpu.mark([conn.get_server_pid()], broker), total - first)
        return ((total - first) / elapsed if elapsed > 0 else float("nan")), used
    finally:
        await consumer.stop()
        await conn.close()
