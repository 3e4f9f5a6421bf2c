"""A provider that a template names, on the real stack (Kafka, PostgreSQL; the fake driver):
its delete is refused, forced or not, at the HTTP API and the CLI (every create, claim and pool
refill from the template would fail without it); and a template's write racing a provider's
delete in PostgreSQL loses or wins whole, never leaving a template naming a deleted provider.
(OpenShell's DeleteProvider: tests/test_openshell_providers.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime
from typing import Any

import apikit
import pytest_asyncio
from apikit import ADMIN, Api, unique
from harness import eventually
from typer.testing import CliRunner

from drivers.fake import FakeDriver
from services.cli.main import app
from services.common import providers, templates

SPEC = {"image": "registry.example/agent:1", "command": ["sleep", "3600"]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    async with apikit.running_api(FakeDriver()) as running:
        yield running


def odd(prefix: str) -> str:
    """A provider name with every kind of character the name allows."""
    return f"{prefix}.V2_x-{unique('p')}"


async def test_a_provider_a_template_names_is_not_deleted_even_forced(api: Api) -> None:
    provider = odd("gh")
    template, other = sorted((unique("tpl"), unique("tpl")))
    async with api.client() as c:
        assert (await c.post("/v1/providers", json={"name": provider})).status_code == 201
        for name in (template, other):
            body = {"name": name, "spec": SPEC, "providers": [provider]}
            assert (await c.post("/v1/templates", json=body)).status_code == 201
        for force in ("false", "true"):
            r = await c.delete(f"/v1/providers/{provider}", params={"force": force})
            assert r.status_code == 412 and r.json()["code"] == "FAILED_PRECONDITION", r.text
            assert f"named by templates {template!r}, {other!r}:" in r.json()["message"], r.text
        assert (await c.get(f"/v1/providers/{provider}")).status_code == 200
        # The templates still serve: a create from one attaches the provider.
        name = unique("sb")
        body = {"name": name, "template": {"name": template}}
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201 and r.json()["name"] == name, r.text
        assert (await c.get(f"/v1/sandboxes/{name}")).json()["providers"] == [provider]
        # A template no longer naming it (updated, deleted) no longer holds it.
        r = await c.put(f"/v1/templates/{other}", json={"spec": SPEC, "expected_revision": 1})
        assert r.status_code == 200, r.text
        assert (await c.delete(f"/v1/templates/{template}")).status_code == 200
        r = await c.delete(f"/v1/providers/{provider}", params={"force": "true"})
        assert r.status_code == 200 and r.json()["detached"] == [name], r.text


async def test_a_template_of_no_providers_holds_none(api: Api) -> None:
    provider, template = odd("np"), unique("tpl")
    async with api.client() as c:
        assert (await c.post("/v1/providers", json={"name": provider})).status_code == 201
        body = {"name": template, "spec": SPEC, "providers": []}
        assert (await c.post("/v1/templates", json=body)).status_code == 201
        assert (await c.delete(f"/v1/providers/{provider}")).status_code == 200


async def test_the_clis_forced_delete_is_refused_naming_the_template(api: Api) -> None:
    provider, template = odd("cli"), unique("tpl")
    async with api.client() as c:
        assert (await c.post("/v1/providers", json={"name": provider})).status_code == 201
        body = {"name": template, "spec": SPEC, "providers": [provider]}
        assert (await c.post("/v1/templates", json=body)).status_code == 201
    argv = ["--url", api.url, "--token", ADMIN, "provider", "delete", provider, "--force"]
    r = await asyncio.to_thread(CliRunner().invoke, app, argv)
    said = r.output + (str(r.exception) if r.exception else "")
    assert r.exit_code != 0 and f"named by template {template!r}" in said, said
    async with api.client() as c:
        assert (await c.get(f"/v1/providers/{provider}")).status_code == 200


async def blocked_by(api: Api, pid: int) -> int:
    """How many backends wait for a lock that backend ``pid`` holds."""
    waiting = await api.env.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", pid
    )
    return int(waiting)


async def held_while(api: Api, pid: int, request: Awaitable[Any]) -> asyncio.Task[Any]:
    """``request`` started, once it waits for the transaction of backend ``pid`` (one more
    backend waiting for it than before)."""
    before = await blocked_by(api, pid)
    task = asyncio.ensure_future(request)
    await eventually(lambda: blocked_by(api, pid), lambda n: n > before, timeout=20,
                     what="the request to wait for the open transaction")  # fmt: skip
    assert not task.done()
    return task


async def test_a_provider_delete_after_a_templates_uncommitted_write_is_refused(
    api: Api,
) -> None:
    """The template's transaction holds the provider: the delete waits for it, then sees the
    template and is refused (before, it deleted the provider under the new template)."""
    provider, template = odd("race"), unique("tpl")
    async with api.client() as c:
        assert (await c.post("/v1/providers", json={"name": provider})).status_code == 201
        async with api.env.pool.acquire() as conn:
            transaction = conn.transaction()
            await transaction.start()
            body = templates.TemplateBody.model_validate({"spec": SPEC, "providers": [provider]})
            await templates.create_template(conn, template, body, "test", datetime.now(UTC))
            deleting = await held_while(
                api,
                conn.get_server_pid(),
                c.delete(f"/v1/providers/{provider}", params={"force": "true"}),
            )
            await transaction.commit()
        r = await deleting
    assert r.status_code == 412 and f"named by template {template!r}" in r.text, r.text
    async with api.env.pool.acquire() as conn:
        assert await providers.get_provider(conn, provider) is not None


async def test_a_template_write_after_a_providers_uncommitted_delete_is_refused(
    api: Api,
) -> None:
    """The provider's delete runs first (its row deleted, the transaction open): a template
    create and update naming it wait for it, then find no provider (before, both were written
    naming a provider that no longer existed)."""
    provider, template = odd("race"), unique("tpl")
    async with api.client() as c:
        assert (await c.post("/v1/providers", json={"name": provider})).status_code == 201
        assert (await c.post("/v1/templates", json={"name": template, "spec": SPEC})).is_success
        async with api.env.pool.acquire() as conn:
            transaction = conn.transaction()
            await transaction.start()
            assert await providers.delete_provider(conn, provider)  # not committed yet
            made = {"name": unique("tpl"), "spec": SPEC, "providers": [provider]}
            updated = {"spec": SPEC, "providers": [provider], "expected_revision": 1}
            creating = await held_while(
                api, conn.get_server_pid(), c.post("/v1/templates", json=made)
            )
            updating = await held_while(
                api, conn.get_server_pid(), c.put(f"/v1/templates/{template}", json=updated)
            )
            await transaction.commit()
        for r in (await creating, await updating):
            assert r.status_code == 404 and "field 'providers'" in r.text, r.text
            assert f"provider {provider!r} not found" in r.text, r.text
        r = await c.get(f"/v1/templates/{template}")
        assert (r.json()["revision"], r.json()["providers"]) == (1, []), r.text
        assert (await c.get(f"/v1/templates/{made['name']}")).status_code == 404
