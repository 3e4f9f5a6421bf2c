"""The store's per-batch work stays a cost of the batch, not of the tables' size, on real
PostgreSQL: the publish cursor's gap search and the unpublished outbox read only what is above
the cursor (the outbox is kept after publishing), and the batch read's generic plan, made once
per connection and possibly on empty tables, looks rows and outcomes up by key."""

from __future__ import annotations

from typing import Any

from harness import Env, isolated_env

from projections.outbox import _MARK_PUBLISHED, _UNPUBLISHED, mark_published, unpublished_outbox
from projections.store import _READ_BATCH, _WRITE_BATCH, BATCH_SESSION

PUBLISHED = 20_000  # outbox rows of partition 0 below its cursor


async def _outbox(env: Env, rows: int, cursor: int) -> None:
    """``rows`` outbox records of partition 0 (ids 1..rows), published up to ``cursor``."""
    await env.pool.execute(
        "INSERT INTO outbox (partition, topic, key, value) "
        "SELECT 0, 'events', NULL, '\\x00'::bytea FROM generate_series(1, $1)",
        rows,
    )
    await env.pool.execute("INSERT INTO outbox_cursor VALUES (0, $1)", cursor)
    await env.pool.execute("ANALYZE outbox")


async def _plan(env: Env, query: str, *args: Any) -> str:
    rows = await env.fetch(f"EXPLAIN {query}", *args)
    return "\n".join(r[0] for r in rows)


async def test_the_gap_search_reads_the_outbox_above_the_cursor_only() -> None:
    async with isolated_env(partitions=1) as env:
        await _outbox(env, PUBLISHED + 10, PUBLISHED)
        acked = [PUBLISHED + i for i in (1, 2, 4)]
        plan = await _plan(env, _MARK_PUBLISHED, [0] * len(acked), acked)
        assert "Seq Scan on outbox" not in plan
        assert "Index Cond: " in plan.split("CTE gap")[1].split("CTE moved")[0]


async def test_the_cursor_stops_below_the_first_id_not_acknowledged() -> None:
    """Acknowledgements out of order, repeated, and beyond an id nobody acknowledged."""
    async with isolated_env(partitions=1) as env:
        await _outbox(env, 10, 2)
        async with env.pool.acquire() as conn:
            assert await mark_published(conn, {0: [4, 3, 6, 3, 7]}) == {0: 5}
            assert await env.fetchval("SELECT published_id FROM outbox_cursor") == 4
            assert await mark_published(conn, {0: [5, 6, 7]}) == {}  # 8 is above them all
            assert await env.fetchval("SELECT published_id FROM outbox_cursor") == 7


async def test_the_unpublished_outbox_is_read_from_the_cursor_on() -> None:
    async with isolated_env(partitions=1) as env:
        await _outbox(env, PUBLISHED + 3, PUBLISHED)
        async with env.pool.acquire() as conn:
            pending = await unpublished_outbox(conn, 0)
        assert [i for i, _ in pending] == [PUBLISHED + 1, PUBLISHED + 2, PUBLISHED + 3]
        plan = await _plan(env, _UNPUBLISHED, 0)
        assert "Seq Scan on outbox" not in plan
        assert "Index Cond: (id > COALESCE($0, '0'::bigint))" in plan


async def _plan_made_empty(statement: str, args: str, fill: str) -> str:
    """The plan of ``statement`` as the processor's batch connection keeps it: a generic plan
    (BATCH_SESSION) made at its first execution on empty tables, explained after ``fill`` (no
    ANALYZE in between: it would make the plan again and hide a scan)."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        for table in ("sandboxes", "command_outcomes", "history"):  # an ANALYZE of autovacuum
            await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")  # replans
        await conn.execute(BATCH_SESSION)
        await conn.execute(f"PREPARE batch AS {statement}")
        await conn.execute(f"EXECUTE batch({args})")  # the plan is made here
        await conn.execute(fill)
        rows = await conn.fetch(f"EXPLAIN EXECUTE batch({args})")
        return "\n".join(r[0] for r in rows)


async def test_the_batch_read_made_on_empty_tables_looks_rows_and_outcomes_up_by_key() -> None:
    """The batch read as the processor runs it: a generic plan, made at its first use (on a new
    installation, on empty tables) and kept as they grow. Its plan must not scan them whole."""
    plan = await _plan_made_empty(
        _READ_BATCH,
        ", ".join(["'{}'"] * 7),
        "INSERT INTO command_outcomes (key, command_id, command_type, status, code, message, "
        "outcome) SELECT 'k' || i, 'c' || i, 'CreateSandbox', 'accepted', 'ok', '', '{}' "
        "FROM generate_series(1, 20000) AS i",
    )
    for table in ("sandboxes", "command_outcomes", "history"):  # (input_offsets: a row
        assert f"Seq Scan on {table}" not in plan  # per partition, scanned whole is fine)
    assert "command_outcomes_pkey" in plan
    assert "sandboxes_pkey" in plan


async def test_the_batch_write_made_on_empty_tables_updates_rows_found_by_key() -> None:
    """The batch write as the processor runs it: a generic plan made on an empty sandboxes
    table. Joined by hash, its row update scanned the table whole at every write once it had
    grown; it must find each row through the key index instead."""
    plan = await _plan_made_empty(
        _WRITE_BATCH,
        "'{}'::text[], '{}'::int[], '{}'::bigint[], '{}'::bigint[], '[]', '[]', '[]', "
        "'{}'::int[], '{}'::text[], '{}'::bytea[], '{}'::bytea[], 0, 'changes', NULL, "
        "'{}'::bigint[]",
        "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers, "
        "identity, created_at, updated_at, partition, change_seq) SELECT 'k' || i, "
        "gen_random_uuid(), 'Ready', 1, 1, '{}', '{}', 'i', now(), now(), 0, i "
        "FROM generate_series(1, 20000) AS i",
    )
    update = plan.split("CTE updated")[1].split("CTE recorded")[0]
    assert "Seq Scan on sandboxes" not in update
    assert "Index Scan using sandboxes_pkey on sandboxes" in update
    assert "Index Cond: (key = " in update
