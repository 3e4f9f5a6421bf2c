"""The same-work ceiling (services/bench/same_work.py) writes what the processor writes: on one
generated log, the processor (its own process, ``python -m services.processor``) in one schema
and the ceiling in another, every table compared row by row — the rows, the history with its
hash chains, the outcomes, the outbox in each partition's order, the offsets — and every outbox
record published by both. Only what the database assigns differs: sequence numbers (row
change_seq, history and outbox ids: commit order, which depends on how the polls fell) and
the clock columns (recorded_at, decided_at, updated_at)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from typing import Any

import asyncpg
from aiokafka import ConsumerRecord
from harness import eventually

from events.codec import encode
from events.commands import CreateSandbox
from events.observations import RuntimeSnapshot
from events.topics import partition_for
from services.bench import same_work, same_work_drain
from services.bench.workload import SPEC, T0, lifecycle_messages, produce_all
from services.common.settings import PROJECT_ROOT, Settings
from services.localstack.isolation import isolated

KEYS = 150  # 600 inputs, and 4 more
EARLY = [k for k in range(KEYS) if k % 7 == 3]  # exited before running (exit 0 where k % 3 == 0)

# Each table as compared: its columns but the database's own (sequences, clocks), in an order
# that does not depend on how the inputs were batched.
TABLES = {
    "sandboxes": "SELECT key, sandbox_id, phase, generation, version, spec, providers, identity, "
    "exit_code, reason, created_at, updated_at, partition, deadline, deadline_at, expires_at, "
    "on_expiry, on_exit, hold, awaited FROM sandboxes ORDER BY key",
    "history": 'SELECT key, topic, partition, "offset", message_type, command_id, disposition, '
    "reason, phase, generation, version, event_types, message::text AS message, occurred_at, "
    "sandbox_id, prev_hash, entry_hash FROM history ORDER BY key, id",
    "command_outcomes": "SELECT command_id, key, command_type, status, code, message, "
    "outcome FROM command_outcomes ORDER BY key, command_id",
    "outbox": "SELECT partition, topic, key, value FROM outbox ORDER BY partition, id",
    "input_offsets": "SELECT topic, partition, next_offset FROM input_offsets "
    "ORDER BY topic, partition",
}
CHECKPOINTS_SUFFIX = "checkpoints"  # the run's own chain checkpoints topic
UNPUBLISHED = (
    "SELECT count(*) FROM outbox o LEFT JOIN outbox_cursor c ON c.partition = o.partition "
    "WHERE o.id > coalesce(c.published_id, 0)"
)


async def tables(settings: Settings) -> dict[str, list[dict[str, Any]]]:
    conn = await asyncpg.connect(
        settings.pg_dsn, server_settings={"search_path": settings.pg_schema}
    )
    try:
        assert await conn.fetchval(UNPUBLISHED) == 0, "outbox records left unpublished"
        return {name: [dict(r) for r in await conn.fetch(sql)] for name, sql in TABLES.items()}
    finally:
        await conn.close()


def checkpointed(found: dict[str, list[dict[str, Any]]]) -> dict[tuple[int, str | None], str]:
    """The newest checkpointed head of every chain, and the checkpoints taken out of the
    outbox rows (found is changed)."""
    heads: dict[tuple[int, str | None], str] = {}
    kept = []
    for row in found["outbox"]:
        if not row["topic"].endswith(CHECKPOINTS_SUFFIX):
            kept.append(row)
            continue
        checkpoint = json.loads(row["value"])
        for label, head in checkpoint["heads"]:
            heads[(checkpoint["partition"], label)] = head
    found["outbox"] = kept
    return heads


def running(observation_id: str, key: str) -> RuntimeSnapshot:
    return RuntimeSnapshot(
        type="RuntimeSnapshot",
        observation_id=observation_id,
        key=key,
        generation=1,
        state="running",
        occurred_at=T0,
        actor="bench",
    )


def waves(keys: int) -> list[list[tuple[str, bytes, bytes]]]:
    """The benchmark's log (varied) cut into its four phases, each on one topic, so that its
    order does not depend on how the polls fall; with inputs off the common path mixed in: a
    snapshot of an unknown sandbox, sandboxes whose runtime exits before running (Error, then
    stopped), a running snapshot after the stop, a repeated command id and a create of an
    existing name."""
    records, _ = lifecycle_messages(keys, varied=True)
    phases = [records[i * keys : (i + 1) * keys] for i in range(4)]
    exited_early = [r for r in phases[3] if int(r[1].decode().rsplit("-", 1)[1]) in EARLY]
    early = {r[1] for r in exited_early}
    phases[1] = [r for r in phases[1] if r[1] not in early] + exited_early
    ghost = running("ghost", "ghost-1")
    phases[1].append(("observations", b"ghost-1", encode(ghost)))
    late = running("late", "bench-2")
    phases[3].insert(0, ("observations", b"bench-2", encode(late)))  # ignored while Stopping
    repeated = next(r for r in phases[0] if r[1] == b"bench-0")
    taken = CreateSandbox(
        type="CreateSandbox",
        command_id="c-again",
        key="bench-1",
        spec=SPEC,
        occurred_at=T0,
        actor="bench",
    )
    phases[2] += [repeated, ("commands", b"bench-1", encode(taken))]
    return phases


async def applied(conn: asyncpg.Connection[asyncpg.Record], total: int, what: str) -> None:
    """Until ``total`` inputs are applied and the outbox is all published."""
    await eventually(
        lambda: conn.fetchval("SELECT coalesce(sum(next_offset), 0) FROM input_offsets"),
        lambda n: n == total,
        timeout=120,
        what=f"{what} to apply {total} inputs",
    )
    await eventually(
        lambda: conn.fetchval(UNPUBLISHED), lambda n: n == 0, timeout=60,
        what=f"{what} to publish its outbox",
    )  # fmt: skip


async def test_the_same_work_ceiling_writes_exactly_what_the_processor_writes(
    settings: Settings,
) -> None:
    async with (
        isolated(settings, "same", kafka_partitions=4) as (s, _),
        isolated(settings, "same-small", kafka_partitions=4) as (small, _),
        isolated(settings, "same-large", kafka_partitions=4) as (large, _),
    ):
        # The same log, into schemas of their own: polls small enough for the single
        # statement, and large enough for the COPY path. The small polls' drain keeps fewer
        # rows than the log has sandboxes, as the processor's row cache would: the rows it
        # lets go are read back.
        small_s = s.model_copy(update={"pg_schema": small.pg_schema, "processor_row_cache": 50})
        large_s = s.model_copy(update={"pg_schema": large.pg_schema})
        processor = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.processor", cwd=PROJECT_ROOT,
            env={**os.environ, **s.as_env()}, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        conn = await asyncpg.connect(s.pg_dsn, server_settings={"search_path": s.pg_schema})
        total = 0
        try:
            async with (
                same_work_drain.Drain(small_s, max_records=40) as few,
                same_work_drain.Drain(large_s, max_records=5000) as many,
            ):
                for wave in waves(KEYS):
                    await produce_all(s, wave)
                    total += len(wave)
                    await applied(conn, total, "the processor")
                    await few.until(total)
                    await many.until(total)
                # The off-path inputs went through the rules (the early exits and the stops
                # after them, the repeat, the taken name), the rest took the common path, and
                # every row is plain again at the end.
                for drain in (few, many):
                    assert drain.ceiling.by_rules == 2 * len(EARLY) + 2
                    assert not drain.ceiling.general
                assert len(many.ceiling.rows) == KEYS
                assert few.ceiling.kept_size == 50 and len(few.ceiling.rows) <= 50
        finally:
            await conn.close()
            processor.terminate()
            _, err = await asyncio.wait_for(processor.communicate(), 60)
        assert processor.returncode in (0, -15), err.decode()[-2000:]
        expected = await tables(s)
        # A chain checkpoint is written per poll: how many there are depends on how the polls
        # fall, what they end on does not.
        heads = checkpointed(expected)
        assert len(heads) == KEYS + 1  # every sandbox's chain and the unknown one's
        for ceiling in (small_s, large_s):
            got = await tables(ceiling)
            assert checkpointed(got) == heads, ceiling.pg_schema
            for name in TABLES:
                assert len(got[name]) == len(expected[name]), (name, ceiling.pg_schema)
                for mine, theirs in zip(got[name], expected[name], strict=True):
                    assert mine == theirs, (name, ceiling.pg_schema)
    # The log held what it should: the common path and the general one both decided.
    assert len(expected["history"]) == total == 4 * KEYS + 4
    dispositions = Counter(h["disposition"] for h in expected["history"])
    assert dispositions == {"applied": 4 * KEYS, "ignored": 2, "duplicate": 1, "rejected": 1}
    phases = Counter(r["phase"] for r in expected["sandboxes"])
    assert phases == {"Stopped": KEYS}
    reasons = Counter(h["reason"].rpartition(": ")[2] for h in expected["history"])
    assert reasons["Provisioning -> Error"] == sum(k % 3 != 0 for k in EARLY)
    assert reasons["Provisioning -> Completed"] == sum(k % 3 == 0 for k in EARLY)


async def test_the_same_work_ceiling_stops_at_a_record_the_processor_would_dead_letter(
    settings: Settings,
) -> None:
    """It has no dead letters: a record that fails validation is refused, not guessed at."""
    async with isolated(settings, "same", kafka_partitions=4) as (s, _):
        await produce_all(s, [("commands", b"bench-0", b'{"type": "CreateSandbox"}')])
        try:
            await asyncio.wait_for(same_work_drain.measured_drain(s, 1), 60)
        except same_work.Unsupported as exc:
            assert "field 'command_id': Field required" in str(exc)
        else:
            raise AssertionError("the ceiling applied an invalid record")


async def test_the_same_work_ceiling_reads_from_either_side_of_its_write_in_flight(
    settings: Settings,
) -> None:
    """Its per-poll read may be answered before or after its write in flight commits (the two
    are on connections of their own): both are its own offsets. Any other stored offset is
    another writer's, and it stops rather than decide on it."""
    async with isolated(settings, "same", kafka_partitions=4) as (s, _):
        conn = await asyncpg.connect(s.pg_dsn, server_settings={"search_path": s.pg_schema})
        ceiling = same_work.SameWork(s)
        key = "bench-0"
        part = partition_for(key.encode(), s.kafka_partitions)
        tp = (s.topic_commands, part)
        # A write in flight moves the commands topic of the key's partition from 5 to 10.
        ceiling.offsets[tp], ceiling.in_flight_from = 10, {tp: 5}
        record = ConsumerRecord(
            s.topic_commands, part, 12, 0, 0, key.encode(), encode(_create(key)), None, 0, 0,
            [],
        )  # fmt: skip
        parsed = [ceiling.parse(record)]
        try:
            for stored in (5, 10):  # before its commit, after it
                await conn.execute(
                    "INSERT INTO input_offsets (topic, partition, next_offset) VALUES ($1, $2, $3)"
                    " ON CONFLICT (topic, partition) DO UPDATE SET next_offset = $3",
                    *tp, stored,
                )  # fmt: skip
                expected = await same_work_drain.read(ceiling, conn, parsed, {part})
                assert expected[tp] == 10  # decided as of the write in flight committed
            await conn.execute("UPDATE input_offsets SET next_offset = 7")
            try:
                await same_work_drain.read(ceiling, conn, parsed, {part})
            except same_work.Unsupported as exc:
                assert "another writer" in str(exc)
            else:
                raise AssertionError("the ceiling decided on another writer's offsets")
        finally:
            await conn.close()


def _create(key: str) -> CreateSandbox:
    return CreateSandbox(type="CreateSandbox", command_id=f"c-{key}", key=key, spec=SPEC,
                         occurred_at=T0, actor="bench")  # fmt: skip
