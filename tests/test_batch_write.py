"""The batch write on real PostgreSQL: a large batch copies its history and outbox in (binary
COPY) and stores exactly what the one-statement write of a small batch stores, with the same
guarantees: outbox ids in order, nothing written when fenced, refused, or a row moved."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from uuid import UUID, uuid4

import asyncpg
import factories as f
import pytest
from aiokafka import ConsumerRecord
from harness import Env, eventually, isolated_env

from events.codec import encode
from events.common import Deadline, Hold, Phase, SandboxSpec
from events.outcomes import Code, CommandOutcome
from events.topics import CHANGES_CHANNEL, POOLS_CHANNEL, partition_for
from projections.chain import chain_rows
from projections.fold import fold
from projections.lifecycle import Sandbox
from projections.outbox import unpublished_outbox
from projections.store import (
    HISTORY_COLUMNS,
    BatchWrite,
    HistoryRow,
    OffsetsMoved,
    OutboxRecord,
    RowVersionMoved,
    read_batch,
    write_batch,
)
from services.common.notify_channels import listen
from services.processor.failures import refused_for_content
from services.processor.intake import Parsed, parse
from services.processor.plan import plan_batch

INLINE, COPY = 10**9, 0  # copy_above: never copy, always copy
TABLES = ("history", "outbox", "sandboxes", "command_outcomes", "input_offsets")


def planned(env: Env, keys: int, bodies: dict[str, bytes] | None = None) -> BatchWrite:
    """A batch of creates as the processor plans it (parse, fold, plan, chain)."""
    s = env.settings
    records = []
    for i in range(keys):
        key = f"copy-{i}"
        value = (bodies or {}).get(key) or encode(f.create(key))
        p = partition_for(key.encode(), s.kafka_partitions)
        at = 1_767_225_600_000 + i
        records.append(
            ConsumerRecord(s.topic_commands, p, i, at, 0, key.encode(), value, None, 0, 0, ())
        )
    items = [parse(r, s.topic_commands, s.kafka_partitions) for r in records]
    parsed = [i for i in items if isinstance(i, Parsed)]
    result = fold({}, {}, ((i.cause, i.message) for i in parsed))
    read = {(s.topic_commands, p): 0 for p in {r.partition for r in records}}
    plan = plan_batch(items, result, read, s)
    return replace(plan, history=chain_rows(plan.history, {}))


async def stored(env: Env) -> dict[str, list[dict[str, Any]]]:
    """Every table the batch writes, without what the database assigns (ids, clocks)."""
    skip = {"id", "recorded_at", "decided_at", "updated_at", "change_seq"}
    out = {}
    for table in TABLES:
        rows = await env.fetch(f"SELECT * FROM {table}")
        out[table] = sorted(({k: v for k, v in r.items() if k not in skip} for r in rows), key=repr)
    return out


async def clear(env: Env) -> None:
    for table in TABLES:
        await env.pool.execute(f"DELETE FROM {table}")


async def test_a_copied_batch_stores_what_the_one_statement_write_stores() -> None:
    async with isolated_env(partitions=4) as env:
        plan = planned(env, 100)
        async with env.pool.acquire() as conn:
            inline_ids = await write_batch(conn, plan, copy_above=INLINE)
        inline = await stored(env)
        await clear(env)
        async with env.pool.acquire() as conn:
            copied_ids = await write_batch(conn, plan, copy_above=COPY)
        assert await stored(env) == inline
        assert len(inline["history"]) == 100 and len(inline["outbox"]) == len(plan.outbox)
        # The ids returned are the records' ids, in the batch's order.
        for ids in (inline_ids, copied_ids):
            assert ids == sorted(ids) and len(set(ids)) == len(plan.outbox)
        rows = await env.fetch("SELECT id, value FROM outbox ORDER BY id")
        assert [r["id"] for r in rows] == copied_ids
        assert [r["value"] for r in rows] == [o.value for o in plan.outbox]


async def test_a_fenced_copy_writes_nothing() -> None:
    async with isolated_env(partitions=4) as env:
        plan = planned(env, 80)
        async with env.pool.acquire() as conn:
            await write_batch(conn, plan, copy_above=COPY)
            before = await stored(env)
            with pytest.raises(OffsetsMoved):  # the same offsets again: another writer won
                await write_batch(conn, plan, copy_above=COPY)
            moved = {(t, p): (0, 1) for (t, p) in plan.offsets}  # a row decided from nothing
            with pytest.raises(RowVersionMoved):
                await write_batch(
                    conn,
                    replace(plan, offsets={(f"other.{t}", p): v for (t, p), v in moved.items()}),
                    copy_above=COPY,
                )
        assert await stored(env) == before


REFUSE_HISTORY_OF = (
    "CREATE FUNCTION refuse_history() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "RAISE EXCEPTION 'history of % refused', NEW.key; END $$",
    "CREATE TRIGGER refuse_history BEFORE INSERT ON history FOR EACH ROW "
    "WHEN (NEW.key = '{key}' AND NEW.disposition <> 'dead-lettered') "
    "EXECUTE FUNCTION refuse_history()",
)


async def refuse_history_of(env: Env, key: str) -> None:
    for statement in REFUSE_HISTORY_OF:
        await env.fetch(statement.format(key=key))


async def test_a_copied_record_postgresql_refuses_leaves_nothing_written() -> None:
    async with isolated_env(partitions=4) as env:
        await refuse_history_of(env, "copy-7")
        plan = planned(env, 80)
        async with env.pool.acquire() as conn:
            with pytest.raises(asyncpg.PostgresError) as refused:
                await write_batch(conn, plan, copy_above=COPY)
        assert refused_for_content(refused.value)
        assert "history of copy-7 refused" in str(refused.value)
        assert all(not rows for rows in (await stored(env)).values())


async def test_a_large_batch_postgresql_refuses_is_split_and_only_the_culprit_dead_lettered() -> (
    None
):
    async with isolated_env(partitions=1) as env:
        await refuse_history_of(env, "poison")
        # More than COPY_ABOVE in the first poll: the refusal comes from a COPY.
        names = (
            [f"big-{i}" for i in range(600)] + ["poison"] + [f"big-{i}" for i in range(600, 1200)]
        )
        await env.produce(
            env.settings.topic_commands, [(n.encode(), encode(f.create(n))) for n in names]
        )
        await env.start_processor()
        await env.wait_applied(len(names))
        rows = await env.fetch('SELECT key, disposition FROM history ORDER BY "offset"')
        assert [r["key"] for r in rows] == names
        assert [r["disposition"] for r in rows] == ["applied"] * 600 + ["dead-lettered"] + [
            "applied"
        ] * 600
        assert await env.fetchval("SELECT count(*) FROM sandboxes") == 1200


@pytest.mark.parametrize("count", [40, 800])  # sent one by one; as a batch per partition
async def test_a_poll_publishes_every_event_once_where_send_would_place_it(count: int) -> None:
    async with isolated_env(partitions=3) as env:
        names = [f"pub-{i}" for i in range(count)]
        refused: list[tuple[bytes | None, bytes | None]] = [(b"bad-key", b"{"), (None, b"{")]
        await env.produce(
            env.settings.topic_commands,
            [(n.encode(), encode(f.create(n))) for n in names] + refused,
        )
        await env.start_processor()
        await env.wait_applied(len(names) + len(refused))
        events = await eventually(
            lambda: env.read_topic(env.settings.topic_events),
            lambda found: len(found) >= len(names),
            what="every decided event published",
        )
        assert sorted(e.key for e in events) == sorted(n.encode() for n in names)
        for e in events:
            assert e.partition == partition_for(e.key, 3)
            assert json.loads(e.value)["type"] == "SandboxCreated"
        letters = await eventually(
            lambda: env.read_topic(env.settings.topic_deadletter),
            lambda found: len(found) >= len(refused),
            what="both dead letters published",
        )
        assert sorted(r.key or b"" for r in letters) == [b"", b"bad-key"]
        keyed = next(r for r in letters if r.key is not None)
        assert keyed.partition == partition_for(b"bad-key", 3)
        newest = await env.fetch("SELECT partition, max(id) AS id FROM outbox GROUP BY partition")

        async def cursors() -> dict[int, int]:
            rows = await env.fetch("SELECT partition, published_id FROM outbox_cursor")
            return {r["partition"]: r["published_id"] for r in rows}

        expected = {n["partition"]: n["id"] for n in newest}
        await eventually(cursors, lambda found: found == expected, what="the cursors at the end")


# Values that a wire encoding can get wrong: NULLs, text with commas, quotes, backslashes and
# characters outside ASCII, JSON documents, timestamps in other zones than UTC, bytes of every
# value (a hash's zero bytes included).
EAST = timezone(timedelta(hours=5, minutes=30))
AWKWARD = 'a, "b"\\c\n\tü 水 🙂 {"not": json}'


def awkward_row(version: int, **changes: Any) -> Sandbox:
    row = Sandbox(
        key="round-trip",
        sandbox_id=uuid4(),
        phase=Phase.READY,
        generation=3,
        version=version,
        spec=SandboxSpec(
            image="localhost/img:1",
            command=["sh", "-c", "echo 'a, b' \"ü\""],
            env={"K": AWKWARD, "EMPTY": ""},
        ),
        providers=("alpha", "beta-2"),
        identity="sandstream:round-trip:1",
        exit_code=None,
        reason=AWKWARD,
        created_at=datetime(2026, 3, 4, 5, 6, 7, 123456, tzinfo=EAST),
        updated_at=datetime(2026, 3, 4, 5, 6, 8, tzinfo=UTC),
        deadline=Deadline(kind="stop", due_at=datetime(2026, 3, 4, 6, 0, 1, 5, tzinfo=EAST)),
        expires_at=datetime(2026, 3, 5, 0, 0, 0, 999999, tzinfo=EAST),
        on_expiry="delete",
        on_exit="delete",
        hold=Hold(by="ops ü", reason=AWKWARD, since=datetime(2026, 3, 4, 5, 0, tzinfo=EAST)),
        awaited={"alpha": 2, "beta-2": 9},
    )
    return replace(row, **changes)


def awkward_history(offset: int, row: Sandbox | None) -> HistoryRow:
    return HistoryRow(
        key=row.key if row else None,
        topic="in",
        partition=0,
        offset=offset,
        message_type="CreateSandbox" if row else None,
        command_id="c-1" if row else None,
        disposition="applied" if row else "dead-lettered",
        reason=AWKWARD,
        phase=row.phase.value if row else None,
        generation=row.generation if row else None,
        version=row.version if row else None,
        event_types=["SandboxCreated", "DeadlineSet"] if row else [],
        # Kept as written: spacing, key order and escapes of the input are not normalized.
        message='{ "z": 1,  "a": "\\u00fc ,\\"", "n": null }' if row else None,
        occurred_at=datetime(2026, 3, 4, 5, 6, 7, 1, tzinfo=EAST) if row else None,
        sandbox_id=row.sandbox_id if row else None,
        prev_hash=bytes(range(32)) if offset else None,
        entry_hash=bytes(range(255, 223, -1)),
    )


async def test_every_value_type_round_trips_exactly_through_the_write() -> None:
    async with isolated_env(partitions=1) as env:
        created = awkward_row(1)
        outcome = CommandOutcome(
            command_id="c-1", key=created.key, command_type="CreateSandbox",
            status="rejected", code=Code.INVALID_ARGUMENT, message=AWKWARD,
            sandbox_id=created.sandbox_id, phase=None, generation=3, version=None,
            identity=AWKWARD,
        )  # fmt: skip
        # Every outbox byte value, and a record without a key.
        outbox = [OutboxRecord(0, "out", bytes(range(256)), b"\x00v, \xff"),
                  OutboxRecord(0, "out", None, AWKWARD.encode())]  # fmt: skip
        history = [awkward_history(0, created), awkward_history(1, None)]
        # Stored again at the next version: the row's update path, timers and hold cleared.
        updated = awkward_row(
            2, phase=Phase.COMPLETED, exit_code=-3, reason=None, deadline=None, hold=None,
            expires_at=None, awaited={}, providers=(), sandbox_id=created.sandbox_id,
        )  # fmt: skip
        async with env.pool.acquire() as conn:
            for inline in (True, False):
                await clear(env)
                first = BatchWrite([(0, created)], history, [outcome], outbox, {("in", 0): (0, 2)})
                ids = await write_batch(conn, first, copy_above=INLINE if inline else COPY)
                read = await read_batch(conn, [("in", 0)], [created.key], [(created.key, "c-1")])
                assert read.sandboxes == {created.key: created}
                assert read.outcomes == {(created.key, "c-1"): outcome}
                assert [r for _, r in await unpublished_outbox(conn, 0)] == outbox
                assert len(ids) == 2
                rows = await conn.fetch(
                    "SELECT "
                    + ", ".join(f'"{c}"' for c in HISTORY_COLUMNS)
                    + " FROM history ORDER BY id"
                )
                assert [HistoryRow(**dict(r)) for r in rows] == history
                message = await conn.fetchval("SELECT message::text FROM history WHERE id = "
                                              "(SELECT min(id) FROM history)")  # fmt: skip
                assert message == history[0].message
                # A row read back raw carries asyncpg's own UUID type: written back as well.
                raw_id = await conn.fetchval("SELECT sandbox_id FROM sandboxes")
                assert type(raw_id) is not UUID
                second = BatchWrite(
                    [(0, replace(updated, sandbox_id=raw_id))], [], [], [],
                    {("in", 0): (2, 3)}, {created.key: 1},
                )  # fmt: skip
                await write_batch(conn, second, copy_above=INLINE if inline else COPY)
                read = await read_batch(conn, [("in", 0)], [created.key], [])
                assert read.sandboxes == {created.key: updated}
                stored = await conn.fetchrow(
                    "SELECT deadline, deadline_at, hold FROM sandboxes WHERE key = $1", created.key
                )
                assert tuple(stored) == (None, None, None)  # SQL NULLs, not JSON nulls


async def test_only_a_batch_that_wrote_a_pool_members_row_wakes_the_pool_controller() -> None:
    """The pool controller listens on POOLS_CHANNEL, which a batch notifies only when it wrote
    a pool member's row; every batch notifies CHANGES_CHANNEL. (The controller woke on every
    commit before: five statements a wake-up, with no pool at all.)"""
    async with isolated_env(partitions=4) as env, env.pool.acquire() as conn:
        heard: list[str] = []

        def hear(_: object, __: int, channel: str, ___: str) -> None:
            heard.append(channel)

        async with env.pool.acquire() as listener:
            channels = [await listen(listener, c, hear) for c in (CHANGES_CHANNEL, POOLS_CHANNEL)]
            await write_batch(conn, planned(env, 2))
            await eventually(lambda: list(heard), lambda h: len(h) >= 1, what="a notification")
            await clear(env)
            plan = planned(env, 2)
            members = [(p, replace(s, pool="warm")) for p, s in plan.sandboxes[:1]]
            await write_batch(conn, replace(plan, sandboxes=members + plan.sandboxes[1:]))
            await eventually(lambda: list(heard), lambda h: len(h) >= 3, what="notifications")
            assert heard == [channels[0], channels[0], channels[1]]
            for channel in channels:
                await listener.remove_listener(channel, hear)


async def test_a_schemas_commits_wake_only_its_own_listeners() -> None:
    """NOTIFY channels are per database: every sandstream sharing one under a schema of its own
    (every test in the suite) woke on all the others' commits (change feeds, the scheduler, the
    pool controller). Each schema now has channels of its own."""
    async with isolated_env(partitions=4) as ours, isolated_env(partitions=4) as theirs:
        heard: dict[str, list[str]] = {"ours": [], "theirs": []}

        def hearing(who: str) -> Any:
            return lambda _, __, channel, ___: heard[who].append(channel)

        callbacks = {who: hearing(who) for who in heard}

        async with ours.pool.acquire() as a, theirs.pool.acquire() as b:
            both = (CHANGES_CHANNEL, POOLS_CHANNEL)
            names = {
                "ours": [await listen(a, c, callbacks["ours"]) for c in both],
                "theirs": [await listen(b, c, callbacks["theirs"]) for c in both],
            }
            assert set(names["ours"]).isdisjoint(names["theirs"])
            plan = planned(theirs, 2)
            members = [(p, replace(s, pool="warm")) for p, s in plan.sandboxes]
            async with theirs.pool.acquire() as conn:
                await write_batch(conn, replace(plan, sandboxes=members))
            await eventually(lambda: list(heard["theirs"]), lambda h: len(h) >= 2, what="theirs")
            async with ours.pool.acquire() as conn:
                await write_batch(conn, planned(ours, 2))
            await eventually(lambda: list(heard["ours"]), lambda h: len(h) >= 1, what="ours")
            # Ours was committed after theirs: had theirs reached us, it would have come first.
            assert heard == {"ours": names["ours"][:1], "theirs": names["theirs"]}
            for conn, who in ((a, "ours"), (b, "theirs")):
                for channel in names[who]:
                    await conn.remove_listener(channel, callbacks[who])


async def test_a_channel_name_fits_postgresqls_limit_whatever_the_schemas_length() -> None:
    """PostgreSQL truncates a LISTEN's name over 63 bytes (and refuses such a NOTIFY): a long
    schema's channel takes the schema's md5; the public schema keeps the bare names."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        schema = env.settings.pg_schema
        ask = f'SELECT "{schema}".notify_channel($1)'
        assert await conn.fetchval(ask, CHANGES_CHANNEL) == f"{CHANGES_CHANNEL}:{schema}"
        long = "s" * 63
        async with conn.transaction():
            await conn.execute(f'CREATE SCHEMA "{long}"')
            await conn.execute(f'SET LOCAL search_path = "{long}"')
            named = await conn.fetchval(ask, CHANGES_CHANNEL)
            await conn.execute("SELECT pg_notify($1, '')", named)  # refused if over the limit
            await conn.execute("SET LOCAL search_path = public")
            public = await conn.fetchval(ask, POOLS_CHANNEL)
            await conn.execute(f'DROP SCHEMA "{long}"')
        assert named == f"{CHANGES_CHANNEL}:{hashlib.md5(long.encode()).hexdigest()}"
        assert len(named.encode()) <= 63
        assert public == POOLS_CHANNEL
