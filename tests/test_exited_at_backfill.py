"""Migration 0200 adds ``exited_at`` and fills it in for the rows that exited before it, from
the history, as the rebuild from the log sets it: else an audit would find every such row
differ from its rebuild. On the real stack (Kafka, PostgreSQL; the fake driver): rows decided
by the processor, their ``exited_at`` cleared, the migration's fill run, the same values back."""

from __future__ import annotations

import factories as f
from harness import isolated_env
from pipeline_support import command, running_plane, wait_phase

from drivers.fake import FakeDriver
from services.common.settings import PROJECT_ROOT

MIGRATION = PROJECT_ROOT / "compose" / "migrations" / "0200_exited_at.sql"


def fill_statement() -> str:
    """The migration's UPDATE (the statement after its ALTER)."""
    sql = MIGRATION.read_text()
    return sql[sql.index("UPDATE sandboxes") :]


async def test_the_migration_fills_in_exited_at_as_the_processor_sets_it() -> None:
    async with isolated_env(partitions=2) as env, await env.publisher() as pub:
        driver = FakeDriver()
        ended = {"bf-ok": (0, "Completed"), "bf-err": (3, "Error")}
        async with running_plane(env, driver):
            for key in [*ended, "bf-running"]:
                await command(env, pub, f.create(key))
                await wait_phase(env, key, "Ready")
            for key, (code, phase) in ended.items():
                driver.runtime_exited(key, 1, exit_code=code)
                await wait_phase(env, key, phase)
        query = "SELECT key, exited_at FROM sandboxes ORDER BY key"
        decided = {r["key"]: r["exited_at"] for r in await env.fetch(query)}
        assert decided["bf-running"] is None
        assert decided["bf-ok"] is not None and decided["bf-err"] is not None
        await env.pool.execute("UPDATE sandboxes SET exited_at = NULL")  # as before 0200
        await env.pool.execute(fill_statement())
        assert {r["key"]: r["exited_at"] for r in await env.fetch(query)} == decided
