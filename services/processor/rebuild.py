"""Rebuild the phase rows from the events topic and compare them with the live rows.

The events topic is the audit log: folding it with ``evolve`` in offset order (per key the
events are in one partition, in version order) must reproduce every live row. An event whose
version is not above the row's is a republished duplicate (outbox crash window) and is skipped.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import asyncpg

from events.codec import EVENTS, decode
from events.log_reader import LogTruncated, read_to_end
from projections.lifecycle import Sandbox, evolve
from projections.store import SANDBOX_COLUMNS, BatchWrite, sandbox_from_record, write_batch
from services.common.kafka_clients import kafka_client_args
from services.common.migrations import apply_migrations
from services.common.settings import Settings
from services.processor.gc_thresholds import collect_less_often


async def fold_events_topic(settings: Settings) -> dict[str, Sandbox]:
    """Read the events topic from the beginning to its current end and fold it.

    Raises LogTruncated if the topic no longer starts at offset 0 (retention deleted its
    oldest events): folding what is left would produce wrong rows, not a rebuild."""
    rows: dict[str, Sandbox] = {}
    topic, partitions = settings.topic_events, settings.kafka_partitions
    async for record in read_to_end(kafka_client_args(settings, "audit"), topic, partitions):
        event = decode(EVENTS, record.value)
        current = rows.get(event.key)
        if current is None or event.version > current.version:
            rows[event.key] = evolve(current, event)
    return rows


@dataclass(frozen=True)
class RebuildReport:
    schema: str
    rebuilt: int
    live: int
    differences: list[str]

    @property
    def equal(self) -> bool:
        return not self.differences


def compare_rows(live: dict[str, Sandbox], rebuilt: dict[str, Sandbox]) -> list[str]:
    diffs = []
    for key in sorted(live.keys() | rebuilt.keys()):
        a, b = live.get(key), rebuilt.get(key)
        if a != b:
            diffs.append(f"{key}: live={a!r} rebuilt={b!r}")
    return diffs


async def rebuild_and_compare(settings: Settings, keep_schema: bool = False) -> RebuildReport:
    """Fold the log into a fresh schema, then compare it with the live rows."""
    rebuilt = await fold_events_topic(settings)
    schema = f"rebuild_{uuid.uuid4().hex[:12]}"
    conn = await write_rows(settings, schema, rebuilt)
    try:
        fresh = await conn.fetch(f"SELECT {SANDBOX_COLUMNS} FROM {schema}.sandboxes")
        live_rows = await conn.fetch(
            f"SELECT {SANDBOX_COLUMNS} FROM {_quote(settings.pg_schema)}.sandboxes"
        )
        diffs = compare_rows(
            {r["key"]: sandbox_from_record(r) for r in live_rows},
            {r["key"]: sandbox_from_record(r) for r in fresh},
        )
        return RebuildReport(schema, len(fresh), len(live_rows), diffs)
    finally:
        if not keep_schema:
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        await conn.close()


async def write_rows(
    settings: Settings, schema: str, rows: dict[str, Sandbox]
) -> asyncpg.Connection[asyncpg.Record]:
    """Write ``rows`` into a fresh schema (all migrations applied); the open connection."""
    await apply_migrations(settings.pg_dsn, schema=schema)
    conn = await asyncpg.connect(settings.pg_dsn, server_settings={"search_path": schema})
    async with conn.transaction():
        for partition_rows in _chunks(list(rows.values()), 1000):
            write = BatchWrite([(-1, r) for r in partition_rows], [], [], [], {})
            await write_batch(conn, write)
    return conn


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _chunks(items: list[Sandbox], size: int) -> list[list[Sandbox]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def main() -> None:
    collect_less_often()
    try:
        report = asyncio.run(rebuild_and_compare(Settings()))
    except LogTruncated as exc:
        raise SystemExit(f"cannot rebuild: {exc}") from None
    print(f"rebuilt {report.rebuilt} rows, live {report.live} rows")
    for line in report.differences:
        print("DIFF", line)
    raise SystemExit(0 if report.equal else 1)


if __name__ == "__main__":
    main()
