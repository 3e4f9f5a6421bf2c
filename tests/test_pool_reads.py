"""A pool controller round reads the creates it asked for and the members at one moment
(``services.common.pools.read_view``): a member's row the fold commits between the two reads
is either a request not yet folded or a member, never both. Both, and the round planned for
twice the members it had (a suite run: 40 made for a pool of 20, the surplus deleted and made
again). On real PostgreSQL, the fold's commit made deterministically between the statements."""

from __future__ import annotations

from typing import Any

from harness import isolated_env

from services.common import pools

POOL, KEY = "warm", "warm-abcd1234"


class CommitBetween:
    """A connection that, right after the statement reading the requests, commits the
    member's row through another connection (as the processor's batch would)."""

    def __init__(self, conn: Any, other: Any) -> None:
        self._conn, self._other = conn, other

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def fetch(self, query: str, *args: Any) -> Any:
        rows = await self._conn.fetch(query, *args)
        if "FROM pool_requests" in query:
            await self._other.execute(
                "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, "
                "providers, identity, created_at, updated_at, partition, change_seq, pool) "
                "SELECT $1, gen_random_uuid(), 'Provisioning', 1, 1, '{}', '{}', '', now(), "
                "now(), 0, nextval('sandbox_changes'), $2",
                KEY,
                POOL,
            )
        return rows


async def test_a_member_committed_between_the_reads_is_counted_once() -> None:
    async with isolated_env(partitions=1) as env:
        await env.pool.execute(
            "INSERT INTO pool_requests (key, pool, command_id, command, requested_at) "
            "VALUES ($1, $2, 'c-1', '{}', now())",
            KEY,
            POOL,
        )
        async with env.pool.acquire() as conn, env.pool.acquire() as other:
            view = await pools.read_view(CommitBetween(conn, other))
        [asked] = view.requests
        assert asked.key == KEY
        members = [m.key for m in view.members]
        assert (asked.folded, members) in [(False, []), (True, [KEY])], (asked, members)
        # Read again, after the commit: folded, and one member.
        async with env.pool.acquire() as conn:
            again = await pools.read_view(conn)
        assert [(r.key, r.folded) for r in again.requests] == [(KEY, True)]
        assert [m.key for m in again.members] == [KEY]
