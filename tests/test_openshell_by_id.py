"""OpenShell's lookup of a sandbox by its incarnation id (``sandbox_by_id``), on real Kafka and
PostgreSQL: an id a history entry names is found through the history's incarnation index and
the row's key, without a scan of ``sandboxes`` (no index of it serves ``sandbox_id``); the
answers are the incarnation's row, its tombstone after delete, None once the name was created
again or for an unknown id, and still the row when no history entry names the id (entries
archived, or written before the history carried the id), which only a scan can tell."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import apikit
import pytest_asyncio
from apikit import Api, create_body, unique
from harness import isolated_env

from drivers.fake import FakeDriver
from events.common import Phase
from services.api.readmodel import SandboxView
from services.openshell.service import BY_ID, sandbox_by_id

ROWS = 20_000  # sandboxes (one in three a tombstone), with two history entries each

# Row i is named k<i> and its incarnation id ends in i.
_ID = "('00000000-0000-0000-0000-' || lpad({}::text, 12, '0'))::uuid"
FILL = f"""
INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers, identity,
                       created_at, updated_at, partition, change_seq)
SELECT 'k' || i, {_ID.format("i")}, CASE WHEN i % 3 = 0 THEN 'Deleted' ELSE 'Ready' END, 1, 1,
       '{{"image": "x"}}', '{{}}', 'i', now(), now(), 0, i
FROM generate_series(1, {ROWS}) AS i;
INSERT INTO history (key, topic, partition, "offset", disposition, reason, event_types,
                     sandbox_id)
SELECT 'k' || (i % {ROWS} + 1), 'commands', 0, i, 'applied', '', '{{}}',
       {_ID.format(f"(i % {ROWS} + 1)")}
FROM generate_series(1, {2 * ROWS}) AS i
"""


def row_id(i: int) -> uuid.UUID:
    return uuid.UUID(f"00000000-0000-0000-0000-{i:012d}")


async def _on(conn: Any, sandbox_id: uuid.UUID) -> SandboxView | None:
    """``sandbox_by_id`` on one connection instead of the pool: its scans are counted in the
    connection's transaction."""
    return await sandbox_by_id(conn, sandbox_id)


async def _scans(conn: Any, table: str) -> int:
    """Sequential scans of ``table`` in the connection's current transaction."""
    return int(
        await conn.fetchval(
            "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = to_regclass($1)", table
        )
    )


async def test_an_id_a_history_entry_names_is_answered_without_scanning_the_rows() -> None:
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute(FILL)
        await conn.execute("ANALYZE sandboxes; ANALYZE history")
        async with conn.transaction():
            found = await _on(conn, row_id(7))
            assert found is not None and (found.name, found.id) == ("k7", row_id(7))
            tomb = await _on(conn, row_id(9))
            assert tomb is not None and (tomb.name, tomb.phase) == ("k9", Phase.DELETED)
            assert await _scans(conn, "sandboxes") == 0
            assert await _scans(conn, "history") == 0
        async with conn.transaction():  # the name k7 moved on to another incarnation
            await conn.execute(
                "UPDATE sandboxes SET sandbox_id = $1 WHERE key = 'k7'", uuid.uuid4()
            )
            assert await _on(conn, row_id(7)) is None
            assert await _scans(conn, "sandboxes") == 0


async def test_an_id_no_history_entry_names_is_looked_for_among_the_rows() -> None:
    """Entries archived (deleted) or written before migration 0041 (sandbox_id null): the row
    is still found, by the scan only such an id costs; an unknown id costs it too."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute(FILL)
        await conn.execute("DELETE FROM history WHERE key = 'k7'")
        await conn.execute("UPDATE history SET sandbox_id = NULL WHERE key = 'k8'")
        await conn.execute("ANALYZE sandboxes; ANALYZE history")
        async with conn.transaction():
            for i in (7, 8):
                found = await _on(conn, row_id(i))
                assert found is not None and found.name == f"k{i}"
            assert await _on(conn, uuid.uuid4()) is None
            assert await _scans(conn, "sandboxes") == 3


async def test_the_lookup_planned_on_empty_tables_probes_the_incarnation_and_the_key() -> None:
    """As asyncpg may keep it: a generic plan made at a first use on empty tables, explained
    once they are full. It must not scan either table whole."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        for table in ("sandboxes", "history"):  # an ANALYZE would make the plan again
            await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE by_id AS {BY_ID}")
        await conn.execute(f"EXECUTE by_id('{row_id(7)}')")  # the plan is made here
        await conn.execute(FILL)
        plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN EXECUTE by_id('{row_id(7)}')"))
    assert "Seq Scan" not in plan, plan
    assert "Index Scan using history_incarnation on history" in plan
    assert "Index Scan using sandboxes_pkey on sandboxes s" in plan


# -- through the pipeline ---------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    async with apikit.running_api(FakeDriver()) as running:
        yield running


async def _create(api: Api, name: str) -> uuid.UUID:
    async with api.client() as c:
        created = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
        assert created.status_code == 201, created.text
    await api.wait_phase(name, "Ready")
    return uuid.UUID(created.json()["sandbox_id"])


async def _delete(api: Api, name: str) -> None:
    async with api.client() as c:
        deleted = await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
        assert deleted.status_code == 200, deleted.text
    await api.wait_phase(name, "Deleted")


async def test_an_id_finds_its_incarnation_then_its_tombstone_and_nothing_once_re_created(
    api: Api,
) -> None:
    pool, name = api.env.pool, unique("byid")
    first = await _create(api, name)
    found = await sandbox_by_id(pool, first)
    assert found is not None and (found.name, found.phase) == (name, Phase.READY)
    await _delete(api, name)
    tomb = await sandbox_by_id(pool, first)
    assert tomb is not None and (tomb.id, tomb.phase) == (first, Phase.DELETED)
    second = await _create(api, name)
    assert second != first
    assert await sandbox_by_id(pool, first) is None
    again = await sandbox_by_id(pool, second)
    assert again is not None and (again.name, again.phase) == (name, Phase.READY)
    assert await sandbox_by_id(pool, uuid.uuid4()) is None


async def test_without_the_history_entries_an_earlier_incarnation_is_still_none(api: Api) -> None:
    """The answers found by the scan (the entries archived) are those the history gave."""
    pool, name = api.env.pool, unique("byid")
    first = await _create(api, name)
    await _delete(api, name)
    second = await _create(api, name)
    await pool.execute("DELETE FROM history WHERE key = $1", name)
    assert await sandbox_by_id(pool, first) is None
    found = await sandbox_by_id(pool, second)
    assert found is not None and (found.id, found.phase) == (second, Phase.READY)
