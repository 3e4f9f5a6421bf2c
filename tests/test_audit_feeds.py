"""History and watch narrowed to one incarnation and one generation, and the stream of every
decided event: in order, resumable from a cursor, saying when the cursor is older than what is
retained. On the real stack with the fake driver."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import apikit
import httpx
from harness import eventually, isolated_env

from drivers.fake import FakeDriver
from services.api import readmodel
from services.api.readmodel.horizon import committed_through
from services.common.settings import PROJECT_ROOT


async def sse(
    client: httpx.AsyncClient, path: str, params: dict[str, Any], count: int, timeout: float = 30
) -> list[tuple[str, int | None, dict[str, Any]]]:
    """The first ``count`` events of a server-sent-event stream (fewer if it ends first)."""
    found: list[tuple[str, int | None, dict[str, Any]]] = []
    async with asyncio.timeout(timeout):
        async with client.stream("GET", path, params=params) as response:
            assert response.status_code == 200, await response.aread()
            kind, event_id, data = "message", None, []
            async for line in response.aiter_lines():
                if line == "" and data:
                    found.append((kind, event_id, json.loads("\n".join(data))))
                    if len(found) >= count:
                        return found
                    kind, event_id, data = "message", None, []
                elif line.startswith("event:"):
                    kind = line.partition(":")[2].strip()
                elif line.startswith("id:"):
                    event_id = int(line.partition(":")[2])
                elif line.startswith("data:"):
                    data.append(line.partition(":")[2].strip())
    return found


async def two_incarnations(api: apikit.Api, client: httpx.AsyncClient) -> tuple[str, str, str]:
    """Create, delete and create again one name; the two sandbox ids."""
    name = apikit.unique("inc")
    first = await client.post("/v1/sandboxes?wait=30", json=apikit.create_body(name))
    assert first.status_code == 201, first.text
    await api.wait_phase(name, "Ready")
    old = (await client.get(f"/v1/sandboxes/{name}")).json()["id"]
    deleted = await client.delete(f"/v1/sandboxes/{name}?wait=30")
    assert deleted.status_code == 200, deleted.text
    await api.wait_phase(name, "Deleted")
    again = await client.post("/v1/sandboxes?wait=30", json=apikit.create_body(name))
    assert again.status_code == 201, again.text
    await api.wait_phase(name, "Ready")
    new = (await client.get(f"/v1/sandboxes/{name}")).json()["id"]
    assert old != new
    return name, old, new


async def test_history_narrows_to_one_incarnation_and_one_generation() -> None:
    async with apikit.running_api(FakeDriver()) as api, api.client() as client:
        name, old, new = await two_incarnations(api, client)
        everything = (await client.get(f"/v1/sandboxes/{name}/history")).json()["items"]
        first = (
            await client.get(f"/v1/sandboxes/{name}/history", params={"incarnation": old})
        ).json()["items"]
        second = (
            await client.get(f"/v1/sandboxes/{name}/history", params={"incarnation": new})
        ).json()["items"]
        assert {e["sandbox_id"] for e in first} == {old}
        assert {e["sandbox_id"] for e in second} == {new}
        assert first[0]["message_type"] == "CreateSandbox"
        assert second[0]["message_type"] == "CreateSandbox"
        assert len(first) + len(second) <= len(everything)
        generation = second[0]["generation"]
        assert generation > first[0]["generation"]
        at_gen = (
            await client.get(f"/v1/sandboxes/{name}/history", params={"generation": generation})
        ).json()["items"]
        assert at_gen and all(
            (e["message"].get("generation") or e["generation"]) == generation for e in at_gen
        )
        assert {e["seq"] for e in at_gen} < {e["seq"] for e in everything}
        paged = await client.get(
            f"/v1/sandboxes/{name}/history", params={"incarnation": new, "limit": 1}
        )
        token = paged.json()["next_page_token"]
        wrong = await client.get(
            f"/v1/sandboxes/{name}/history", params={"incarnation": old, "page_token": token}
        )
        assert wrong.status_code == 422 and "page_token" in wrong.json()["message"]
        # The CLI narrows the same way.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from services.cli.main import main; main()",
            "sandbox", "history", name, "--incarnation", old, "-o", "json",
            cwd=PROJECT_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "SANDSTREAM_API_URL": api.url, "SANDSTREAM_TOKEN": apikit.ADMIN},
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert [e["seq"] for e in json.loads(out)] == [e["seq"] for e in first]


async def test_watch_narrows_to_one_incarnation() -> None:
    async with apikit.running_api(FakeDriver()) as api, api.client() as client:
        name, old, new = await two_incarnations(api, client)
        rows = await sse(client, "/v1/watch", {"name": name, "cursor": 0, "incarnation": new,
                                               "timeout": 2}, 1)  # fmt: skip
        assert [(k, d["id"]) for k, _, d in rows] == [("sandbox", new)]
        none = await sse(client, "/v1/watch", {"name": name, "cursor": 0, "incarnation": old,
                                               "timeout": 1}, 1)  # fmt: skip
        assert none == []


async def test_every_decided_event_streams_in_order_and_resumes_from_a_cursor() -> None:
    async with apikit.running_api(FakeDriver()) as api, api.client() as client:
        name, old, new = await two_incarnations(api, client)
        expected = ["SandboxCreated", "SandboxReady", "SandboxDeleting", "SandboxDeleted",
                    "SandboxCreated", "SandboxReady"]  # fmt: skip
        events = await sse(client, "/v1/watch/events", {"name": name}, len(expected))
        assert [d["type"] for _, _, d in events] == expected
        assert all(k == "decided" for k, _, _ in events)
        ids = [i for _, i, _ in events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        assert [d["sandbox_id"] for _, _, d in events] == [old] * 4 + [new] * 2
        rest = await sse(client, "/v1/watch/events", {"name": name, "cursor": ids[2]}, 3)
        assert [i for _, i, _ in rest] == ids[3:]
        mine = await sse(client, "/v1/watch/events", {"name": name, "incarnation": new}, 2)
        assert [d["type"] for _, _, d in mine] == ["SandboxCreated", "SandboxReady"]
        alone = await sse(client, "/v1/watch/events", {"incarnation": old}, 4)  # named by its
        assert [i for _, i, _ in alone] == ids[:4]  # history, read through outbox_key
        # Housekeeping prunes what was published: an old cursor is told where it resumes.
        await eventually(
            lambda: api.env.fetchval(
                "SELECT count(*) FROM outbox o JOIN outbox_cursor c USING (partition) "
                "WHERE o.id > c.published_id"
            ),
            lambda n: n == 0,
            what="everything published",
        )
        await api.env.fetch("DELETE FROM outbox WHERE id <= $1", ids[3])
        told = await sse(client, "/v1/watch/events", {"name": name, "cursor": 0}, 3)
        kind, _, gap = told[0]
        assert kind == "gap" and gap["cursor"] == 0 and gap["retained_from"] > ids[3]
        assert [d["type"] for _, _, d in told[1:]] == expected[4:]


async def test_the_event_horizon_never_steps_over_an_event_still_being_written() -> None:
    """Outbox ids are drawn under the sandboxes table's write lock inside the processor's
    transactions, so they can commit out of order: the feed reads only up to the ids of the
    writers that have ended (the same wait as the row change feed's)."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as writer:
        transaction = writer.transaction()
        await transaction.start()
        try:
            await writer.execute("LOCK TABLE sandboxes IN ROW EXCLUSIVE MODE")
            drawn = await writer.fetchval("SELECT nextval('outbox_id_seq')")  # not committed
            assert await readmodel.event_horizon(env.pool, timeout=0.3) is None
        finally:
            await transaction.commit()
        horizon = await readmodel.event_horizon(env.pool)
        assert horizon is not None and horizon >= drawn


async def test_a_horizon_with_no_writer_is_one_statement_that_scans_the_locks_after_the_read() -> (
    None
):
    """Both feeds read the sequence, then the writers holding the lock at that moment: one
    statement since 2026-12-06 (it was two per horizon, read by every watch at every commit).
    The lock scan must follow the read (a writer that locked and drew in between would be
    missed): the plan shows it as a subquery run per row of the sequence, not beforehand."""
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        sent: list[str] = []

        class Counting:
            async def fetchrow(self, query: str, *args: Any) -> Any:
                sent.append(query)
                return await conn.fetchrow(query, *args)

            async def fetchval(self, query: str, *args: Any) -> Any:
                sent.append(query)
                return await conn.fetchval(query, *args)

        await env.fetchval("SELECT nextval('outbox_id_seq')")
        assert await committed_through(Counting(), "outbox_id_seq") is not None
        assert len(sent) == 1
        plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN VERBOSE {sent[0]}"))
        assert "SubPlan" in plan and "InitPlan" not in plan, plan
