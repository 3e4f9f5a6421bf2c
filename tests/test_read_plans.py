"""The read model's lookups stay a cost of the answer, not of the number of rows, on real
PostgreSQL with 20,000 sandboxes (a third of them tombstones) and their history:

- OpenShell's lookup by incarnation id (``sandbox_by_id``): no index of ``sandboxes`` serves
  ``sandbox_id``; an id a history entry names is found through the history's incarnation index
  and the row's key, without a scan. An id no entry names (entries archived, or written before
  the history carried the id; an unknown id) is looked for by a scan, with the same answers.
- A page of the API's list walks the key index from where it starts, instead of sorting the
  whole table for each page.
- The change feed of named sandboxes (``/v1/watch?name=``, OpenShell's WatchSandbox) probes
  each name's row, instead of walking every row changed since the cursor.
- The decided-event feed narrowed to names or an incarnation (``/v1/watch/events?name=``)
  walks the outbox's key index from the cursor, instead of every event since the cursor.
- The decided-event feed's start (``retained_from``) finds the topic's first outbox id
  through the primary key, also where its first plan was made on an empty outbox; the walk of
  one key's events that OpenShell's watch folds does not scan it either, also once it was
  analysed empty.

Scans are counted in the transaction of one connection (``pg_stat_xact_user_tables``); plans
are checked as asyncpg may keep them too: generic, made at a first use on empty tables."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from harness import OneConnection, isolated_env

from events.common import Phase
from services.api import readmodel
from services.api.readmodel import SandboxView, changes, decided, queries, trend, versions
from services.openshell.service import BY_ID, sandbox_by_id

ROWS = 20_000  # sandboxes, with two history entries each

# Row i is named k<i>, its incarnation id ends in i, and it is Deleted, Ready or Stopped.
_ID = "('00000000-0000-0000-0000-' || lpad({}::text, 12, '0'))::uuid"
FILL = f"""
INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers, identity,
                       created_at, updated_at, partition, change_seq)
SELECT 'k' || i, {_ID.format("i")}, (ARRAY['Deleted', 'Ready', 'Stopped'])[i % 3 + 1], 1, 1,
       jsonb_build_object('image', 'x', 'labels', jsonb_build_object('team', 't' || i % 10)),
       '{{}}', 'i', now(), now(), 0, i
FROM generate_series(1, {ROWS}) AS i;
INSERT INTO history (key, topic, partition, "offset", disposition, reason, event_types,
                     sandbox_id)
SELECT 'k' || (i % {ROWS} + 1), 'commands', 0, i, 'applied', '', '{{}}',
       {_ID.format(f"(i % {ROWS} + 1)")}
FROM generate_series(1, {2 * ROWS}) AS i
"""


def row_id(i: int) -> uuid.UUID:
    return uuid.UUID(f"00000000-0000-0000-0000-{i:012d}")


async def by_id(conn: Any, sandbox_id: uuid.UUID) -> SandboxView | None:
    return await sandbox_by_id(OneConnection(conn), sandbox_id)  # type: ignore[arg-type]


async def scans(conn: Any, table: str) -> int:
    """Sequential scans of ``table`` in the connection's current transaction."""
    return int(
        await conn.fetchval(
            "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = to_regclass($1)", table
        )
    )


# Decided events of k1..k2000 (incarnation i of name ki, generation 1 or 2), every 50th record
# a dead letter of the same name.
FILL_OUTBOX = f"""
INSERT INTO outbox (partition, topic, key, value)
SELECT 0, CASE WHEN i % 50 = 0 THEN 'dead' ELSE 'events' END, convert_to('k' || n, 'UTF8'),
       convert_to(json_build_object('type', 'e' || i, 'sandbox_id', {_ID.format("n")},
                                    'generation', i / 2000 % 2 + 1)::text, 'UTF8')
FROM generate_series(1, {ROWS}) AS i, LATERAL (SELECT i % 2000 + 1 AS n) AS k
"""


async def generic_plan(statement: str, args: str, fill: str = FILL) -> str:
    """The plan of ``statement`` made generic at its first execution on empty tables, as it
    stands once they are full (no ANALYZE in between: it would make the plan again)."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        for table in ("sandboxes", "history", "outbox"):
            await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE read AS {statement}")
        await conn.execute(f"EXECUTE read({args})")  # the plan is made here
        await conn.execute(fill)
        return "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN EXECUTE read({args})"))


# -- by incarnation id --------------------------------------------------------------------------


async def test_an_id_a_history_entry_names_is_answered_without_scanning_the_rows() -> None:
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute(FILL)
        await conn.execute("ANALYZE sandboxes; ANALYZE history")
        async with conn.transaction():
            found = await by_id(conn, row_id(7))
            assert found is not None and (found.name, found.id) == ("k7", row_id(7))
            tomb = await by_id(conn, row_id(9))
            assert tomb is not None and (tomb.name, tomb.phase) == ("k9", Phase.DELETED)
            assert await scans(conn, "sandboxes") == 0
            assert await scans(conn, "history") == 0
        async with conn.transaction():  # the name k7 moved on to another incarnation
            await conn.execute(
                "UPDATE sandboxes SET sandbox_id = $1 WHERE key = 'k7'", uuid.uuid4()
            )
            assert await by_id(conn, row_id(7)) is None
            assert await scans(conn, "sandboxes") == 0


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
                found = await by_id(conn, row_id(i))
                assert found is not None and found.name == f"k{i}"
            assert await by_id(conn, uuid.uuid4()) is None
            assert await scans(conn, "sandboxes") == 3


async def test_the_lookup_planned_on_empty_tables_probes_the_incarnation_and_the_key() -> None:
    """Joined to the history's answer instead of given it as a parameter, the row was found by
    a scan of sandboxes in this plan."""
    plan = await generic_plan(BY_ID, f"'{row_id(7)}'")
    assert "Seq Scan" not in plan, plan
    assert "Index Scan using history_incarnation on history" in plan
    assert "Index Scan using sandboxes_pkey on sandboxes s" in plan


# -- a page of the list -------------------------------------------------------------------------


async def test_pages_of_the_list_are_read_without_scanning_the_rows() -> None:
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute(FILL)
        await conn.execute("ANALYZE sandboxes")
        live = [r["key"] for r in await conn.fetch(
            "SELECT key FROM sandboxes WHERE phase <> 'Deleted' ORDER BY key LIMIT 200"
        )]  # fmt: skip
        pool: Any = OneConnection(conn)
        async with conn.transaction():
            first = await readmodel.list_sandboxes(pool, limit=100)
            second = await readmodel.list_sandboxes(
                pool, limit=100, page_token=first.next_page_token
            )
            assert [v.name for v in first.items + second.items] == live
            ready = await readmodel.list_sandboxes(pool, phases=[Phase.READY], limit=100)
            assert {v.phase for v in ready.items} == {Phase.READY} and len(ready.items) == 100
            every = await readmodel.list_sandboxes(pool, include_deleted=True, limit=100)
            assert Phase.DELETED in {v.phase for v in every.items}
            assert await scans(conn, "sandboxes") == 0


async def test_a_page_of_the_list_planned_on_empty_tables_starts_at_its_name_in_an_index() -> None:
    """A first page walks the key index; a later one with a phase filter starts at its
    token's name, in the key index or in the live rows' (phase, key) index."""
    first, _ = queries.list_query([], False, {}, [], None, 101)
    plan = await generic_plan(first, "101")
    assert "Seq Scan" not in plan, plan
    assert "Index Scan using sandboxes_pkey on sandboxes" in plan
    later, _ = queries.list_query(["Ready"], False, {}, [], "k5", 101)
    plan = await generic_plan(later, "'{Ready}', 'k5', 101")
    assert "Seq Scan" not in plan, plan
    assert any("Index Cond: " in line and "key > $2" in line for line in plan.splitlines())


# -- the change feed of named sandboxes ----------------------------------------------------------


async def test_the_named_change_feed_planned_on_empty_tables_probes_each_name() -> None:
    """Made generic on empty tables, ``key = ANY`` filtered the change_seq index's walk from
    the cursor: from cursor 0, every row of the table for a stream of one name."""
    plan = await generic_plan(changes.CHANGES_OF_NAMES, "0, 99999, '{k7}', false, 500, NULL, NULL")
    assert "Seq Scan on sandboxes" not in plan, plan
    assert "sandboxes_change_seq" not in plan, plan
    assert "Index Scan using sandboxes_pkey on sandboxes" in plan
    # Each name probed as the key it stands for (its adopted member's, or its own): two probes.
    assert "Index Cond: (key = COALESCE($1, name.name))" in plan


async def test_the_named_change_feed_answers_as_the_filter_did() -> None:
    """Repeated and unknown names, tombstones, the cursor, the incarnation, the page."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute(FILL)
        pool: Any = OneConnection(conn)

        async def both(**kw: Any) -> list[tuple[str, int]]:
            named = await readmodel.changes_after(pool, kw.pop("cursor", 0), ROWS, **kw)
            records = await conn.fetch(
                changes.CHANGES, kw.get("cursor", 0), ROWS, kw["names"],
                kw.get("live_only", False), kw.get("limit", readmodel.CHANGES_PAGE),
                kw.get("incarnation"), None,
            )  # fmt: skip
            old = [readmodel.sandbox_view(r) for r in records]
            assert [(v.name, v.change_seq) for v in named] == [(v.name, v.change_seq) for v in old]
            return [(v.name, v.change_seq) for v in named]

        assert await both(names=["k9", "k7", "k9", "nobody", "k8"]) == [
            ("k7", 7), ("k8", 8), ("k9", 9)
        ]  # fmt: skip
        assert await both(names=["k9", "k7", "k8"], live_only=True) == [("k7", 7), ("k8", 8)]
        assert await both(names=["k9", "k7", "k8"], limit=2) == [("k7", 7), ("k8", 8)]
        assert await both(names=["k7", "k8"], incarnation=row_id(8)) == [("k8", 8)]
        later = await readmodel.changes_after(pool, 7, ROWS, names=["k7", "k8"])
        assert [v.name for v in later] == ["k8"]


# -- the start of the decided-event feed ---------------------------------------------------------


async def test_the_feed_start_made_on_an_empty_outbox_reads_it_through_the_primary_key() -> None:
    """asyncpg keeps the statement prepared; PostgreSQL made it generic after five uses on the
    empty outbox and kept the scan as the outbox grew (until an ANALYZE replanned it)."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = off)")
        pool: Any = OneConnection(conn)
        for _ in range(8):
            assert await decided.retained_from(pool, "events") is None
        await conn.execute(
            "INSERT INTO outbox (partition, topic, key, value) SELECT 0, "
            "CASE WHEN i < 4 THEN 'dead' ELSE 'events' END, NULL, '\\x00'::bytea "
            f"FROM generate_series(1, {ROWS}) AS i"
        )
        async with conn.transaction():
            before = await scans(conn, "outbox")  # (may count the empty outbox's scans)
            assert await decided.retained_from(pool, "events") == 4
            assert await decided.retained_from(pool, "dead") == 1
            assert await decided.retained_from(pool, "other") is None  # (a walk of all)
            assert await scans(conn, "outbox") == before


async def test_the_versions_walk_made_on_an_outbox_analysed_empty_does_not_scan_it() -> None:
    """Housekeeping drains the outbox, and autovacuum may analyse it empty. asyncpg keeps each
    statement prepared, and PostgreSQL made the walk of one key's events (the versions
    OpenShell's watch folds) generic after five uses there: found by a flaky plan test, it then
    scanned the whole outbox until the next ANALYZE. It is planned for the outbox as it is now."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = off)")
        await conn.execute("VACUUM ANALYZE outbox")
        pool: Any = OneConnection(conn)
        for _ in range(8):
            with pytest.raises(versions.VersionsLost):  # nothing of "nobody" is kept
                await versions.incarnation_versions(pool, "events", "nobody", row_id(7), 99)
        await conn.execute(FILL_OUTBOX)
        async with conn.transaction():
            before = await scans(conn, "outbox")
            with pytest.raises(versions.VersionsLost):  # a walk of the key index finds none
                await versions.incarnation_versions(pool, "events", "nobody", row_id(7), 99)
            assert await scans(conn, "outbox") == before


# -- the decided-event feed narrowed to sandboxes ------------------------------------------------


async def test_the_named_event_feed_planned_on_empty_tables_walks_the_key_index() -> None:
    """Filtered after a walk of the primary key from the cursor, a stream of one name read
    every event since (from cursor 0, the whole outbox); an incarnation alone likewise."""
    args = "'events', 0, 99999, '{k7}', NULL, NULL, 500"
    plan = await generic_plan(decided.EVENTS_OF_NAMES, args, FILL + ";" + FILL_OUTBOX)
    assert "Seq Scan on outbox" not in plan, plan
    assert "outbox_pkey" not in plan, plan
    assert "Index Scan using outbox_key on outbox" in plan
    plan = await generic_plan(decided.INCARNATION_NAME, f"'{row_id(7)}'")
    assert "Index Scan using history_incarnation on history" in plan, plan


async def test_the_named_event_feed_answers_as_the_filter_did() -> None:
    """Names (repeated, unknown), an incarnation (named by its history or not), a generation,
    pages from a cursor: the same events as the filtered read of every event since."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute(FILL + ";" + FILL_OUTBOX)
        await conn.execute("DELETE FROM history WHERE key = 'k8'")  # k8 is named by none
        pool: Any = OneConnection(conn)
        every = [(r["id"], r["body"]) for r in await conn.fetch(
            "SELECT id, convert_from(value, 'UTF8') AS body, key FROM outbox "
            "WHERE topic = 'events' ORDER BY id"
        )]  # fmt: skip

        def expected(cursor: int, limit: int, keep: Any) -> list[tuple[int, str]]:
            return [(i, b) for i, b in every if i > cursor and keep(json.loads(b))][:limit]

        async def check(cursor: int, limit: int, keep: Any, **narrow: Any) -> None:
            found = await decided.events_after(
                pool, "events", cursor, 10 * ROWS, limit=limit, **narrow
            )
            assert [(e.seq, e.body) for e in found] == expected(cursor, limit, keep)
            assert found

        def of(*ns: int) -> Any:
            return lambda b: b["sandbox_id"] in {str(row_id(n)) for n in ns}

        await check(0, 500, of(7, 9), names=["k9", "k7", "k9", "nobody"])
        await check(every[100][0], 3, of(7, 9), names=["k9", "k7"])
        await check(0, 500, of(7), incarnation=row_id(7))
        await check(0, 500, of(8), incarnation=row_id(8))  # by the filtered read of all
        at_2 = of(7)
        await check(0, 500, lambda b: b["generation"] == 2 and at_2(b), names=["k7"], generation=2)
        assert await decided.events_after(
            pool, "events", 0, 10 * ROWS, names=["k8"], incarnation=row_id(7)
        ) == []  # fmt: skip
        await check(0, 5, lambda b: True)


# -- the console's chart of phase counts over the last hours -------------------------------------

# A week of history: every sandbox created (Provisioning, then Ready) and stopped, one input per
# 6 s of the week (100,800), 600 of them in the last hour; recorded_at grows with the id, as
# appended.
WEEK = 7 * 86400
FILL_WEEK = f"""
INSERT INTO history (key, topic, partition, "offset", disposition, reason, event_types, phase,
                     recorded_at)
SELECT 'k' || (i / 5 + 1), 'commands', 0, i, 'applied', '', '{{}}',
       (ARRAY['Provisioning', 'Ready', 'Ready', 'Stopping', 'Stopped'])[i % 5 + 1],
       now() - make_interval(secs => {WEEK}) + make_interval(secs => i * 6)
FROM generate_series(0, {WEEK // 6 - 1}) AS i
"""


async def test_the_chart_reads_the_hours_it_shows_not_the_whole_history() -> None:
    """The phase changes of the last hour are found through the BRIN index on recorded_at: the
    history entries read are those of the window (and the index's range around its start),
    not the week's; the previous entry of each sandbox by its key index."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await conn.execute(FILL_WEEK)  # (not FILL: its history is all of this hour)
        await conn.execute("ANALYZE history")
        await conn.execute("SELECT brin_summarize_new_values('history_recorded')")  # autovacuum's
        total = await conn.fetchval("SELECT count(*) FROM history")
        async with conn.transaction():
            await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL jit = off")
            start = await conn.fetchval("SELECT now() - interval '1 hour'")
            plan = await conn.fetchval(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {trend.MOVES}", start, 60.0, trend.BUCKETS
            )
        nodes = list(plan_nodes(json.loads(plan)[0]["Plan"]))
        on_history = [n for n in nodes if n.get("Relation Name") == "history"]
        assert {n["Node Type"] for n in on_history} == {"Bitmap Heap Scan", "Index Scan"}, nodes
        window = next(n for n in on_history if n["Node Type"] == "Bitmap Heap Scan")
        assert "history_recorded" in json.dumps(nodes)
        read = window["Actual Rows"] + window.get("Rows Removed by Index Recheck", 0)
        assert 600 <= read < total / 20, (read, total)
        pool: Any = OneConnection(conn)
        found = await trend.phase_trend(pool, 1)
        assert found.now == await trend.live_counts(pool) and len(found.counts) == trend.BUCKETS
        # A window that takes longer than the statement timeout is said so, not waited for.
        with pytest.raises(trend.TrendTooLarge, match="last 24 h takes longer than 1ms"):
            await trend.phase_trend(pool, 24, timeout="1ms")


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from plan_nodes(child)
