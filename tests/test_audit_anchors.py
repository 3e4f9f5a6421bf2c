"""The audit proves what it says (real PostgreSQL and Kafka): the processor checkpoints each
chain's head on the log; `sandstream audit chain` finds every kind of tampering with the
history's rows — hashes cleared, the newest entries or all of a sandbox's deleted, a middle
entry deleted, a payload edited — and an entry `processor skip` writes stays on its chain."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import factories as f
from harness import Env, eventually, isolated_env

from events.codec import encode
from events.topics import partition_for
from projections.chain import link
from projections.lifecycle import Message
from projections.stopped import record_stop, skip_record
from services.audit.chains import check_chains
from services.audit.verify import verify
from services.common.migrations import MIGRATIONS_DIR, apply_migrations
from services.common.settings import PROJECT_ROOT, Settings

UNTOUCHED, CLEARED, CUT, EMPTIED, GAPPED, EDITED = (
    "a-ok",
    "b-clr",
    "c-cut",
    "d-all",
    "e-gap",
    "f-ed",
)
NAMES = (UNTOUCHED, CLEARED, CUT, EMPTIED, GAPPED, EDITED)


def life(key: str) -> list[Message]:
    return [
        f.create(key, command_id=f"{key}-1"), f.launched(key, 1), f.running(key, 1),
        f.stop(key, command_id=f"{key}-2"), f.exited(key, 1, exit_code=143), f.stopped(key, 1),
    ]  # fmt: skip


async def run_and_publish(env: Env, names: tuple[str, ...]) -> None:
    """Every sandbox's life decided, and everything the processor committed published (the
    checkpoints included)."""
    await env.start_processor()
    s = env.settings
    for name in names:
        for message in life(name):
            topic = s.topic_commands if f.topic_for(message) == f.topic_for(f.create()) else None
            await env.produce(topic or s.topic_observations, [(name.encode(), encode(message))])
    await env.wait_applied(6 * len(names))
    await eventually(
        lambda: env.fetchval(
            "SELECT count(*) FROM outbox o LEFT JOIN outbox_cursor c USING (partition) "
            "WHERE o.id > coalesce(c.published_id, 0)"
        ),
        lambda n: n == 0,
        what="the outbox published",
    )


def audit_chain(env: Env) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from services.cli.main import main; main()", "audit", "chain"],
        cwd=PROJECT_ROOT, env=env.env_vars(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


async def ids_of(env: Env, key: str) -> list[int]:
    return [
        r["id"] for r in await env.fetch("SELECT id FROM history WHERE key = $1 ORDER BY id", key)
    ]


async def test_audit_chain_finds_each_kind_of_tampering_and_leaves_the_rest_intact() -> None:
    """It once called a sandbox whose hashes were all cleared intact (its entries passed for
    older, unchained ones), and could not see its newest entries deleted."""
    async with isolated_env() as env:
        await run_and_publish(env, NAMES)
        before = audit_chain(env)
        assert before.returncode == 0, before.stdout + before.stderr
        assert "✓ 6 chains, 36 entries, 6 chains' heads checked against the log's checkpoints" in (
            before.stdout
        )

        await env.fetch("UPDATE history SET prev_hash = NULL, entry_hash = NULL WHERE key = $1",
                        CLEARED)  # fmt: skip
        cut = await ids_of(env, CUT)
        await env.fetch("DELETE FROM history WHERE id = ANY($1::bigint[])", cut[-2:])
        await env.fetch("DELETE FROM history WHERE key = $1", EMPTIED)
        gapped = await ids_of(env, GAPPED)
        await env.fetch("DELETE FROM history WHERE id = $1", gapped[2])
        edited = await ids_of(env, EDITED)
        await env.fetch(
            "UPDATE history SET message = replace(message::text, 'f-ed-2', 'f-ed-9')::json "
            "WHERE id = $1",
            edited[3],
        )

        after = audit_chain(env)
        assert after.returncode == 1
        problems = [line for line in after.stdout.splitlines() if line.startswith("✗ ")]
        said = {name: [p for p in problems if f" {name}: " in p] for name in NAMES}
        assert said[UNTOUCHED] == []
        [cleared] = said[CLEARED]
        first = (await ids_of(env, CLEARED))[0]
        assert f"history entry {first} " in cleared and "its hash was removed" in cleared
        [cut_short] = said[CUT]
        assert cut_short.startswith(f"✗ cut short: {CUT}: the checkpoint ")
        assert f"its newest entry is history entry {cut[-3]} " in cut_short
        [emptied] = said[EMPTIED]
        assert "the history holds no entry of it" in emptied
        [gap] = said[GAPPED]
        assert f"history entry {gapped[3]} " in gap and "previous-hash does not match" in gap
        [edit] = said[EDITED]
        assert f"history entry {edited[3]} " in edit and "content does not match" in edit
        summary = "✗ 5 chains, 27 entries, 6 chains' heads checked against the log's checkpoints"
        assert after.stdout.splitlines()[-1] == summary

        # PostgreSQL alone (the HTTP answer) sees the cleared hashes, the gap and the edit, not
        # the newest entries or a whole chain deleted: that takes the log's checkpoints.
        async with env.pool.acquire() as conn:
            alone = await check_chains(conn)
        assert sorted(b.chain[0] or "" for b in alone.broken) == [CLEARED, GAPPED, EDITED]
        assert alone.cut == [] and alone.anchored is None

        report = await verify(env.settings)
        assert not report.ok and report.chains is not None
        assert sorted(c.chain[0] or "" for c in report.chains.cut) == [CUT, EMPTIED]


async def test_an_entry_processor_skip_writes_is_linked_onto_its_chain() -> None:
    """`processor skip` once wrote its history entry without hashes: on a sandbox with a
    history, the chain then read as broken (a hash removed)."""
    async with isolated_env() as env:
        name = "skipped-one"
        await run_and_publish(env, (name,))
        p = partition_for(name.encode(), env.settings.kafka_partitions)
        topic = env.settings.topic_commands
        at = await env.fetchval(
            "SELECT next_offset FROM input_offsets WHERE topic = $1 AND partition = $2", topic, p
        )
        async with env.pool.acquire() as conn:
            await record_stop(conn, topic, p, at, name, "refused (test)")
            await skip_record(conn, topic, p, at, "tester", "a poison record")
            report = await check_chains(conn)
        assert report.intact and report.broken == []
        [skipped] = await env.fetch(
            "SELECT entry_hash FROM history WHERE disposition = 'skipped' AND key = $1", name
        )
        assert skipped["entry_hash"] is not None


async def insert(conn: Any, key: str, offset: int, prev: bytes | None = None, *, hashed: bool
                 ) -> bytes | None:  # fmt: skip
    """A history entry of ``key`` at ``offset``, linked after ``prev`` when ``hashed``."""
    content = {
        "key": key, "topic": "t.commands", "partition": 0, "offset": offset,
        "message_type": None, "command_id": None, "disposition": "ignored", "reason": "r",
        "phase": None, "generation": None, "version": None, "event_types": [],
        "message": None, "occurred_at": None, "sandbox_id": None,
    }  # fmt: skip
    own = link(prev, content) if hashed else None
    await conn.execute(
        'INSERT INTO history (key, topic, partition, "offset", disposition, reason, event_types, '
        "prev_hash, entry_hash) VALUES ($1, 't.commands', 0, $2, 'ignored', 'r', '{}', $3, $4)",
        key, offset, prev, own,
    )  # fmt: skip
    return own


async def test_entries_older_than_the_chain_stay_unchained_and_newer_ones_need_their_hash(
    tmp_path: Path,
) -> None:
    """Migration 0070 records where chaining began (migration 0040): older entries without
    hashes are counted as unchained; a later one without its hash is a removed hash."""
    before = tmp_path / "before_0070"
    before.mkdir()
    for migration in MIGRATIONS_DIR.glob("*.sql"):
        if migration.name < "0070":
            shutil.copy(migration, before / migration.name)
    settings = Settings()
    schema = f"t_chain_start_{uuid.uuid4().hex[:10]}"
    await apply_migrations(settings.pg_dsn, before, schema=schema)
    conn = await asyncpg.connect(settings.pg_dsn, server_settings={"search_path": schema})
    try:
        for offset in range(2):  # written before migration 0040
            await insert(conn, "old", offset, hashed=False)
        head = await insert(conn, "new", 2, hashed=True)
        await insert(conn, "new", 3, head, hashed=True)
        assert await apply_migrations(settings.pg_dsn, schema=schema) == [
            m.name for m in sorted(MIGRATIONS_DIR.glob("*.sql")) if m.name >= "0070"
        ]
        first_new = await conn.fetchval("SELECT min(id) FROM history WHERE key = 'new'")
        assert await conn.fetchval("SELECT first_id FROM history_chain_start") == first_new
        report = await check_chains(conn)
        assert report.intact and report.unchained == 2 and report.checked == 4

        await insert(conn, "late", 4, hashed=False)  # after chaining began, without a hash
        report = await check_chains(conn)
        [broken] = report.broken
        assert broken.entry.key == "late" and "its hash was removed" in broken.problem
    finally:
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await conn.close()
