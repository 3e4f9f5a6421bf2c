"""OpenShell's lookup of a sandbox by its incarnation id (``sandbox_by_id``) through the
pipeline (real Kafka and PostgreSQL, the fake driver): the incarnation's row, its tombstone
after delete, None once the name was created again and for an unknown id; the same answers
once the name's history entries are gone (archived). Its plans: tests/test_read_plans.py."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import apikit
import pytest_asyncio
from apikit import Api, create_body, unique

from drivers.fake import FakeDriver
from events.common import Phase
from services.openshell.service import sandbox_by_id


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
