"""A shadow read model: rebuilt from the log into a side schema while the live one serves,
compared with it, and switched in atomically with the processor fenced.

- ``build``: replay every recorded input (in the live history's decision order, bytes from the
  log) into a fresh schema made by the migrations, through the processor's own read and plan
  stages: read the rows, outcomes, chain heads and offsets from that schema, fold, plan, write
  with the offsets compare-and-set. Nothing is published: the shadow's outbox is marked as
  published.
- ``diff``: decisions, rows and command outcomes that differ, and how far the live is ahead.
- ``promote``: in one transaction on the live schema: lock its input offsets (the processor's
  writes wait; reads go on), catch the shadow up to them, refuse if they differ and a processor
  is running, copy the live outbox records not yet published and the owner epochs (the running
  processors' assignments stand), poison the old offsets (a writer
  that still reaches the old tables fails its compare-and-set), move the live tables to
  ``<shadow>_previous`` and the shadow's into the live schema, carry the id sequences over and
  renumber the change feed so watchers see every row once. A waiting processor write is then
  planned again against the promoted tables, whose offsets are the ones it read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient

from events.topics import CHANGES_CHANNEL
from projections.fold import Rules
from projections.lifecycle import decide
from projections.store import write_batch
from services.audit.entries import ENTRY_COLUMNS, entry_from_record
from services.audit.log import read_partition
from services.common.kafka_clients import kafka_client_args
from services.common.migrations import apply_migrations
from services.common.settings import Settings
from services.processor.intake import Item, input_topics, inputs_of, parse
from services.processor.read import Reader
from services.processor.row_cache import RowCache

if TYPE_CHECKING:
    from projections.store import Connection

TABLES = (
    "sandboxes", "history", "command_outcomes", "outbox", "outbox_cursor", "outbox_set_aside",
    "input_offsets", "schema_migrations",
)  # fmt: skip
SEQUENCES = ("sandbox_changes", "history_id_seq", "outbox_id_seq")  # carried over on promote
CHUNK = 1000


class ShadowError(RuntimeError):
    """The shadow cannot be built or promoted; the message says why."""


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def _connect(settings: Settings, schema: str) -> asyncpg.Connection[Any]:
    return await asyncpg.connect(settings.pg_dsn, server_settings={"search_path": schema})


async def _offsets(conn: Connection, schema: str) -> dict[tuple[str, int], int]:
    rows = await conn.fetch(f"SELECT topic, partition, next_offset FROM {_q(schema)}.input_offsets")
    return {(r["topic"], r["partition"]): r["next_offset"] for r in rows}


async def apply(out: Connection, settings: Settings, items: Sequence[Item], rules: Rules) -> None:
    """Decide ``items`` (of one partition, in order) into ``out``'s schema as the processor
    does; items below that schema's stored offsets are skipped (already applied)."""
    if not items:
        return
    inputs = inputs_of([i.record for i in items], list(items), input_topics(settings))
    decided = await Reader(settings, RowCache(0), rules).decide(out, inputs)
    if decided is not None:
        await write_batch(out, decided.plan)


async def replay_partition(
    settings: Settings, live: Connection, out: Connection, shadow: str, p: int, rules: Rules
) -> int:
    """Replay partition ``p``'s recorded inputs that the shadow does not have yet."""
    topics = [settings.topic_commands, settings.topic_observations]
    have = await _offsets(out, shadow)
    since = {t: have.get((t, p), 0) for t in topics}
    rows = await live.fetch(
        f"SELECT {ENTRY_COLUMNS} FROM history WHERE partition = $1 AND ("
        '(topic = $2 AND "offset" >= $3) OR (topic = $4 AND "offset" >= $5)) ORDER BY id',
        p, topics[0], since[topics[0]], topics[1], since[topics[1]],
    )  # fmt: skip
    if not rows:
        return 0
    log = await read_partition(kafka_client_args(settings, "audit"), topics, p, start=since)
    records = {(r.topic, r.offset): r for t in topics for r in log[t]}
    entries = [entry_from_record(r) for r in rows]
    missing = [e for e in entries if (e.topic, e.offset) not in records]
    if missing:
        e = missing[0]
        raise ShadowError(
            f"{e.topic}[{p}]@{e.offset} is recorded but no longer in the log (retention): "
            "a shadow cannot be rebuilt from the log alone"
        )
    s = settings
    items = [
        parse(
            records[(e.topic, e.offset)],
            s.topic_commands,
            s.kafka_partitions,
            max_bytes=s.processor_max_input_bytes,
        )
        for e in entries
    ]
    for start in range(0, len(items), CHUNK):
        await apply(out, settings, items[start : start + CHUNK], rules)
    return len(items)


async def _mark_published(conn: Connection, schema: str) -> None:
    await conn.execute(
        f"INSERT INTO {_q(schema)}.outbox_cursor (partition, published_id) "
        f"SELECT partition, max(id) FROM {_q(schema)}.outbox GROUP BY partition "
        "ON CONFLICT (partition) DO UPDATE SET published_id = EXCLUDED.published_id"
    )


async def build(settings: Settings, shadow: str, rules: Rules = decide) -> int:
    """Create ``shadow`` and replay the whole recorded log into it; returns the inputs."""
    if shadow == settings.pg_schema:
        raise ShadowError("the shadow must be another schema than the live one")
    live = await _connect(settings, settings.pg_schema)
    try:
        taken = await live.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = $1", shadow)
        if taken:
            raise ShadowError(f"schema {shadow!r} already has tables: drop it or pick another")
        await apply_migrations(settings.pg_dsn, schema=shadow)
        out = await _connect(settings, shadow)
        try:
            total = 0
            for p in range(settings.kafka_partitions):
                total += await replay_partition(settings, live, out, shadow, p, rules)
            await _mark_published(out, shadow)
            return total
        finally:
            await out.close()
    finally:
        await live.close()


@dataclass(slots=True)
class Diff:
    ahead: int = 0  # inputs the live schema has decided that the shadow has not
    decisions: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.decisions or self.rows or self.outcomes)


_DECISION = "disposition, reason, phase, generation, version, event_types, sandbox_id"
_ROW = (
    "sandbox_id, phase, generation, version, spec::text, providers, identity, exit_code, reason, "
    "created_at, updated_at"
)


async def diff(conn: Connection, live: str, shadow: str) -> Diff:
    """What differs between the live and the shadow schema, over what both have decided."""
    result = Diff()
    mine, theirs = await _offsets(conn, live), await _offsets(conn, shadow)
    result.ahead = sum(max(0, n - theirs.get(tp, 0)) for tp, n in mine.items())
    behind = {p for (t, p), n in mine.items() if theirs.get((t, p), 0) != n}
    level = sorted({p for _, p in mine} - behind)  # partitions the shadow has caught up on
    L, S = _q(live), _q(shadow)
    for r in await conn.fetch(
        f'SELECT l.key, l.topic, l.partition, l."offset", row({_l(_DECISION)})::text AS a, '
        f"row({_s(_DECISION)})::text AS b FROM {L}.history l "
        f'JOIN {S}.history s USING (topic, partition, "offset") '
        f"WHERE row({_l(_DECISION)}) IS DISTINCT FROM row({_s(_DECISION)}) ORDER BY l.id"
    ):
        result.decisions.append(
            f"{r['key']} at {r['topic']}[{r['partition']}]@{r['offset']}: live {r['a']}, "
            f"shadow {r['b']}"
        )
    for r in await conn.fetch(
        f"SELECT coalesce(l.key, s.key) AS key, row({_l(_ROW)})::text AS a, "
        f"row({_s(_ROW)})::text AS b FROM {L}.sandboxes l FULL JOIN {S}.sandboxes s "
        f"USING (key) WHERE coalesce(l.partition, s.partition) = ANY($1::int[]) "
        f"AND row({_l(_ROW)}) IS DISTINCT FROM row({_s(_ROW)}) ORDER BY 1",
        level,
    ):
        result.rows.append(f"{r['key']}: live {r['a']}, shadow {r['b']}")
    for r in await conn.fetch(
        f"SELECT coalesce(l.key, s.key) AS key, coalesce(l.command_id, s.command_id) AS id, "
        f"l.outcome::text AS a, s.outcome::text AS b FROM {L}.command_outcomes l "
        f"FULL JOIN {S}.command_outcomes s USING (key, command_id) "
        "WHERE l.outcome IS DISTINCT FROM s.outcome ORDER BY 1, 2"
    ):
        if r["b"] is None and result.ahead:
            continue  # decided by the live only: the shadow has not caught up yet
        result.outcomes.append(f"{r['key']} command {r['id']}: live {r['a']}, shadow {r['b']}")
    return result


def _l(columns: str) -> str:
    return ", ".join(f"l.{c.strip()}" for c in columns.split(","))


def _s(columns: str) -> str:
    return ", ".join(f"s.{c.strip()}" for c in columns.split(","))


async def processors_running(settings: Settings) -> int:
    """Members of the processor consumer group (0: no processor is running)."""
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "audit"))
    await admin.start()
    try:
        [response] = await admin.describe_consumer_groups([settings.processor_group])
        groups = response.to_object()["groups"]
        return sum(len(g["members"]) for g in groups)
    finally:
        await admin.close()


async def promote(settings: Settings, shadow: str, rules: Rules = decide) -> Diff:
    """Catch the shadow up and switch it in atomically (see the module docstring); returns
    what differed. Refuses a shadow that differs while a processor runs: its row cache holds
    the live rows, which would no longer be the rows."""
    live_name = settings.pg_schema
    previous = f"{shadow}_previous"
    live = await _connect(settings, live_name)
    out = await _connect(settings, shadow)
    L, S, P = _q(live_name), _q(shadow), _q(previous)
    try:
        running = await processors_running(settings)
        async with live.transaction():
            await live.execute(f"LOCK TABLE {L}.input_offsets IN EXCLUSIVE MODE")
            for p in range(settings.kafka_partitions):
                await replay_partition(settings, live, out, shadow, p, rules)
            found = await diff(live, live_name, shadow)
            if found.ahead:
                raise ShadowError(f"the shadow is still {found.ahead} inputs behind")
            if not found.equal and running:
                raise ShadowError(
                    f"the shadow differs from the live read model ({len(found.decisions)} "
                    f"decisions, {len(found.rows)} rows) and {running} processors are running: "
                    "stop them, promote, start them again"
                )
            await _mark_published(live, shadow)
            await live.execute(
                f"INSERT INTO {S}.outbox (partition, topic, key, value) "
                f"SELECT o.partition, o.topic, o.key, o.value FROM {L}.outbox o "
                f"LEFT JOIN {L}.outbox_cursor c USING (partition) "
                "WHERE o.id > coalesce(c.published_id, 0) ORDER BY o.id"
            )
            # The running processors' assignments carry over: their batches check the epochs.
            await live.execute(
                f"INSERT INTO {S}.input_offsets (topic, partition, next_offset, owner_epoch) "
                f"SELECT topic, partition, 0, owner_epoch FROM {L}.input_offsets "
                "ON CONFLICT (topic, partition) DO UPDATE SET owner_epoch = EXCLUDED.owner_epoch"
            )
            await live.execute(f"UPDATE {L}.input_offsets SET next_offset = -1")
            await live.execute(f"CREATE SCHEMA {P}")
            for table in TABLES:
                await live.execute(f"ALTER TABLE {L}.{table} SET SCHEMA {P}")
            await live.execute(f"ALTER SEQUENCE {L}.sandbox_changes SET SCHEMA {P}")
            for table in TABLES:
                await live.execute(f"ALTER TABLE {S}.{table} SET SCHEMA {L}")
            await live.execute(f"ALTER SEQUENCE {S}.sandbox_changes SET SCHEMA {L}")
            for seq in SEQUENCES:
                await live.execute(
                    f"SELECT setval('{L}.{seq}', greatest((SELECT last_value FROM {P}.{seq}), "
                    f"(SELECT last_value FROM {L}.{seq})))"
                )
            await live.execute(
                f"UPDATE {L}.sandboxes SET change_seq = nextval('{L}.sandbox_changes')"
            )
            await live.execute("SELECT pg_notify(notify_channel($1), '')", CHANGES_CHANNEL)
        return found
    finally:
        await out.close()
        await live.close()


def describe(found: Diff) -> list[str]:
    return (
        [f"decision differs: {d}" for d in found.decisions]
        + [f"row differs: {r}" for r in found.rows]
        + [f"outcome differs: {o}" for o in found.outcomes]
    )
