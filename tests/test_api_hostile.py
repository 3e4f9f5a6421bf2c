"""The API against a hostile client, on the real stack: every malformed input is a clear 4xx
naming what is wrong, never a 5xx, and nothing is published for it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import apikit
import pytest_asyncio
from apikit import Api, create_body, unique

from drivers.fake import FakeDriver


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    async with apikit.running_api(
        FakeDriver(), settings_update={"api_max_stop_timeout_seconds": 30}
    ) as running:
        yield running


async def test_a_create_asking_for_more_grace_than_its_token_may_is_refused(api: Api) -> None:
    before = await api.commands_published()
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", json=create_body(unique(), stop_timeout_seconds=31))
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "INVALID_ARGUMENT"
        assert "spec.stop_timeout_seconds" in r.json()["message"]
        assert "at most 30 seconds" in r.json()["message"]
        body = create_body(unique(), stop_timeout_seconds=30)
        ok = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert ok.status_code == 201, ok.text
    assert await api.commands_published() == before + 1
