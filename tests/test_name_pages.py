"""`GET /v1/templates` and `GET /v1/providers` a page at a time (``limit``, an opaque
``page_token``, as the sandbox list pages) on real PostgreSQL, and the CLI's `template list`
and `provider list` following every page. Its own environment: the counts are this module's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime

import apikit
import pytest
import pytest_asyncio
from apikit import ADMIN, Api, unique
from typer.testing import CliRunner

from services.api.readmodel import MAX_PAGE
from services.cli.main import app
from services.common.templates import TemplateBody

SPEC = {"image": "registry.example/agent:1"}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    async with apikit.running_api(None) as running:
        yield running


async def store_templates(api: Api, names: list[str]) -> None:
    """Templates at revision 1, written as the store writes them (in one statement each)."""
    body = TemplateBody.model_validate({"spec": SPEC}).model_dump_json()
    now = datetime.now(UTC)
    await api.env.pool.execute(
        "INSERT INTO template_revisions (name, revision, body, created_at, created_by) "
        "SELECT n, 1, $2, $3, 'test' FROM unnest($1::text[]) AS n",
        names,
        body,
        now,
    )
    await api.env.pool.execute(
        "INSERT INTO templates (name, revision, created_at, updated_at, created_by, updated_by) "
        "SELECT n, 1, $2, $2, 'test', 'test' FROM unnest($1::text[]) AS n",
        names,
        now,
    )


async def store_providers(api: Api, names: list[str]) -> None:
    """Providers without keys, as the store writes their rows."""
    await api.env.pool.execute(
        "INSERT INTO providers (name, type, revision, created_at, updated_at) "
        "SELECT n, 'generic', 1, now(), now() FROM unnest($1::text[]) AS n",
        names,
    )


LISTS = [
    ("/v1/templates", "template", store_templates),
    ("/v1/providers", "provider", store_providers),
]


@pytest.mark.parametrize(("path", "noun", "store"), LISTS, ids=["templates", "providers"])
async def test_a_list_by_name_comes_a_page_at_a_time_and_the_cli_follows_every_page(
    api: Api, path: str, noun: str, store: Callable[[Api, list[str]], Awaitable[None]]
) -> None:
    names = sorted(unique(noun[:3]) for _ in range(MAX_PAGE + 3))  # more than the largest page
    await store(api, names)
    async with api.client() as c:
        seen: list[str] = []
        token, pages = None, 0
        while True:
            params = {"limit": 200} | ({"page_token": token} if token else {})
            r = await c.get(path, params=params)
            assert r.status_code == 200, r.text
            page = r.json()
            assert len(page["items"]) <= 200
            seen += [t["name"] for t in page["items"]]
            pages += 1
            token = page["next_page_token"]
            if not token:
                break
        assert (seen, pages) == (names, 3)
        first = (await c.get(path)).json()
        assert [t["name"] for t in first["items"]] == names[:100] and first["next_page_token"]
        for params in ({"limit": 0}, {"limit": MAX_PAGE + 1}, {"page_token": "not-a-token"}):
            r = await c.get(path, params=params)
            assert r.status_code == 422, (params, r.text)
        r = await c.get(path, params={"page_token": "not-a-token"})
        assert "page_token" in r.text, r.text
        other = "/v1/providers" if path == "/v1/templates" else "/v1/templates"
        r = await c.get(other, params={"page_token": first["next_page_token"]})
        assert r.status_code == 422 and "page_token" in r.text, r.text  # not the other list's
    argv = ["--url", api.url, "--token", ADMIN, noun, "list", "-o", "json"]
    listed = await asyncio.to_thread(CliRunner().invoke, app, argv)
    assert listed.exit_code == 0, listed.output
    assert [t["name"] for t in json.loads(listed.output)] == names
