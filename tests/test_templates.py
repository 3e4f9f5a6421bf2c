"""Templates over HTTP on the real stack (Kafka, PostgreSQL; the fake driver): the store with
revisions and optimistic concurrency, and creates that name a template, whose row, history and
decided event record the revision while the log keeps the full spec."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import apikit
import pytest_asyncio
from apikit import ADMIN, READER, Api, unique
from harness import eventually
from typer.testing import CliRunner, Result

from drivers.fake import FakeDriver
from events.codec import EVENTS, decode
from events.common import SandboxSpec
from events.topics import POOLS_CHANNEL
from services.cli.main import app
from services.common import templates
from services.common.notify_channels import listen
from services.processor.rebuild import rebuild_and_compare

SPEC = {"image": "registry.example/agent:1", "command": ["sleep", "3600"],
        "env": {"MODE": "base", "KEEP": "1"}, "labels": {"team": "research"},
        "resources": {"memory_mib": 256}, "restart_policy": "OnFailure",
        "max_restarts": 3}  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    async with apikit.running_api(FakeDriver()) as running:
        yield running


async def make_template(api: Api, name: str, **extra: Any) -> dict[str, Any]:
    async with api.client() as c:
        r = await c.post("/v1/templates", json={"name": name, "spec": SPEC, **extra})
    assert r.status_code == 201, r.text
    return dict(r.json())


async def test_templates_are_versioned_and_updates_need_the_newest_revision(api: Api) -> None:
    name = unique("tpl")
    made = await make_template(api, name, ttl_seconds=600, description="agents")
    assert (made["revision"], made["ttl_seconds"], made["spec"]["image"]) == (
        1, 600, SPEC["image"],
    )  # fmt: skip
    async with api.client() as c:
        r = await c.post("/v1/templates", json={"name": name, "spec": SPEC})
        assert r.status_code == 409 and r.json()["code"] == "ALREADY_EXISTS", r.text
        newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "expected_revision": 1}
        r = await c.put(f"/v1/templates/{name}", json=newer)
        assert r.status_code == 200 and r.json()["revision"] == 2, r.text
        r = await c.put(f"/v1/templates/{name}", json=newer)  # based on 1: stale now
        assert r.status_code == 409 and r.json()["code"] == "ABORTED", r.text
        assert "revision 2, not 1" in r.json()["message"]
        r = await c.get(f"/v1/templates/{name}")
        assert (r.json()["revision"], r.json()["spec"]["image"]) == (2, "registry.example/agent:2")
        r = await c.get(f"/v1/templates/{name}", params={"revision": 1})
        assert r.json()["spec"]["image"] == SPEC["image"], r.text
        r = await c.get("/v1/templates")
        assert [t["revision"] for t in r.json()["items"] if t["name"] == name] == [2]
        r = await c.delete(f"/v1/templates/{name}", params={"expected_revision": 1})
        assert r.status_code == 409, r.text
        r = await c.delete(f"/v1/templates/{name}")
        assert r.status_code == 200 and r.json() == {"name": name, "revision": 2}, r.text
        r = await c.get(f"/v1/templates/{name}")
        assert r.status_code == 404, r.text
        # Made again, it continues the numbering: {name, revision} always means one spec.
        r = await c.post("/v1/templates", json={"name": name, "spec": SPEC})
        assert r.status_code == 201 and r.json()["revision"] == 3, r.text


async def test_a_create_from_a_template_gets_its_spec_with_the_overrides_and_records_it(
    api: Api,
) -> None:
    template = unique("tpl")
    await make_template(api, template, ttl_seconds=600, on_exit="delete")
    name = unique("sb")
    body = {"name": name, "template": {"name": template},
            "overrides": {"env": {"MODE": "claimed", "EXTRA": "x"}, "labels": {"user": "ada"}},
            "ttl_seconds": 60}  # fmt: skip
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
        row = (await c.get(f"/v1/sandboxes/{name}")).json()
        history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
    assert row["template"] == {"name": template, "revision": 1}
    spec = row["spec"]
    assert spec["env"] == {"MODE": "claimed", "KEEP": "1", "EXTRA": "x"}
    assert spec["labels"] == {"team": "research", "user": "ada"}
    assert (spec["image"], spec["command"], spec["max_restarts"]) == (
        SPEC["image"], SPEC["command"], 3,
    )  # fmt: skip
    assert row["on_exit"] == "delete"  # the template's
    created = [h for h in history if h["message_type"] == "CreateSandbox"]
    assert created[0]["message"]["template"] == {"name": template, "revision": 1}
    assert created[0]["message"]["spec"]["image"] == SPEC["image"]  # the log keeps the full spec
    records = await api.env.read_topic(api.env.settings.topic_events)
    events = [decode(EVENTS, r.value) for r in records if r.key == name.encode()]
    assert events[0].type == "SandboxCreated"
    assert events[0].template is not None and events[0].template.revision == 1  # type: ignore[union-attr]


async def test_a_create_names_a_revision_and_keeps_it_after_updates_and_delete(api: Api) -> None:
    template = unique("tpl")
    await make_template(api, template)
    async with api.client() as c:
        newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "expected_revision": 1}
        assert (await c.put(f"/v1/templates/{template}", json=newer)).status_code == 200
        old, new = unique("old"), unique("new")
        for name, ref in ((old, {"name": template, "revision": 1}), (new, {"name": template})):
            r = await c.post("/v1/sandboxes", params={"wait": 30},
                             json={"name": name, "template": ref})  # fmt: skip
            assert r.status_code == 201, r.text
        assert (await c.delete(f"/v1/templates/{template}")).status_code == 200
        rows = {n: (await c.get(f"/v1/sandboxes/{n}")).json() for n in (old, new)}
    assert rows[old]["template"]["revision"] == 1
    assert rows[old]["spec"]["image"] == "registry.example/agent:1"
    assert rows[new]["template"]["revision"] == 2
    assert rows[new]["spec"]["image"] == "registry.example/agent:2"


async def test_a_sandbox_made_from_a_full_spec_records_no_template(api: Api) -> None:
    name = unique("plain")
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=apikit.create_body(name))
        assert r.status_code == 201, r.text
        assert (await c.get(f"/v1/sandboxes/{name}")).json()["template"] is None


async def test_bad_template_requests_are_refused_naming_the_field(api: Api) -> None:
    template = unique("tpl")
    await make_template(api, template)
    ref = {"name": template}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"template": {"name": unique("none")}}, 404, "field 'template'"),
        ({"template": {"name": template, "revision": 9}}, 404, "revision 9 not found"),
        ({"template": ref, "spec": SPEC}, 422, "field 'spec'"),
        ({"template": ref, "on_exit": "delete"}, 422, "field 'on_exit'"),
        ({"template": ref, "overrides": {"labels": {"team": "other"}}}, 422,
         "field 'overrides.labels.team'"),
        ({"template": ref, "overrides": {"image": "x"}}, 422, "overrides.image"),
        ({"template": ref, "overrides": {"env": {"1BAD": "x"}}}, 422, "overrides.env"),
        ({"spec": SPEC, "overrides": {"env": {"A": "b"}}}, 422, "field 'overrides'"),
        ({}, 422, "field 'spec'"),
        ({"template": {"name": "Not_A_Name"}}, 422, "template.name"),
    ]  # fmt: skip
    published = await api.commands_published()
    async with api.client() as c:
        for extra, status, where in cases:
            r = await c.post("/v1/sandboxes", json={"name": unique("bad"), **extra})
            assert r.status_code == status and where in r.json()["message"], (extra, r.text)
        for body in ({"name": unique("t"), "spec": {**SPEC, "image": ""}},
                     {"name": unique("t"), "spec": SPEC, "ttl_seconds": 0},
                     {"name": "Bad Name", "spec": SPEC}):  # fmt: skip
            r = await c.post("/v1/templates", json=body)
            assert r.status_code == 422, r.text
        r = await c.put(f"/v1/templates/{template}", json={"spec": SPEC})
        assert r.status_code == 422 and "expected_revision" in r.json()["message"], r.text
        missing = {"spec": SPEC, "expected_revision": 1}
        r = await c.put(f"/v1/templates/{unique('none')}", json=missing)
        assert r.status_code == 404, r.text
    assert await api.commands_published() == published  # nothing refused reached the log


async def test_templates_take_the_sandbox_scopes_and_providers_need_provider_write(
    api: Api,
) -> None:
    async with api.client(READER) as c:
        assert (await c.get("/v1/templates")).status_code == 200
        r = await c.post("/v1/templates", json={"name": unique("tpl"), "spec": SPEC})
        assert r.status_code == 403, r.text
    async with api.client(apikit.WRITER) as c:
        r = await c.post("/v1/templates", json={"name": unique("tpl"), "spec": SPEC,
                                                "providers": ["github"]})  # fmt: skip
        assert r.status_code == 403 and "provider:write" in r.json()["message"], r.text
    async with api.client() as c:
        r = await c.post("/v1/templates", json={"name": unique("tpl"), "spec": SPEC,
                                                "providers": [unique("gone")]})  # fmt: skip
        assert r.status_code == 404 and "field 'providers'" in r.json()["message"], r.text


async def cli(api: Api, *args: str) -> Result:
    argv = ["--url", api.url, "--token", ADMIN, *args]
    return await asyncio.to_thread(CliRunner().invoke, app, argv)


def said(result: Result) -> str:
    return result.output + (str(result.exception) if result.exception else "")


async def test_the_cli_writes_templates_and_creates_sandboxes_from_them(api: Api) -> None:
    template, name = unique("tpl"), unique("cli")
    r = await cli(api, "template", "create", template, "--image", "registry.example/a:1",
                  "--env", "MODE=base", "--label", "team=x", "--ttl", "2h",
                  "--description", "agents", "--", "sleep", "60")  # fmt: skip
    assert r.exit_code == 0 and f"Created template {template} (revision 1)" in r.output, said(r)
    r = await cli(api, "template", "update", template, "--image", "registry.example/a:2")
    assert r.exit_code == 0 and "(revision 2)" in r.output, said(r)
    r = await cli(api, "template", "update", template, "--image", "x", "--expected-revision", "1")
    assert r.exit_code != 0 and "is at revision 2, not 1" in said(r), said(r)
    r = await cli(api, "template", "get", template, "-o", "json")
    got = json.loads(r.output)
    # What the update did not name is kept from revision 1.
    assert (got["revision"], got["spec"]["image"], got["spec"]["command"]) == (
        2, "registry.example/a:2", ["sleep", "60"],
    )  # fmt: skip
    assert (got["spec"]["env"], got["ttl_seconds"], got["description"]) == (
        {"MODE": "base"}, 7200, "agents",
    )  # fmt: skip
    r = await cli(api, "template", "list")
    assert r.exit_code == 0 and template in r.output, said(r)
    r = await cli(api, "sandbox", "create", name, "--template", f"{template}:1",
                  "--env", "MODE=cli", "--label", "who=me", "--no-wait")  # fmt: skip
    assert r.exit_code == 0, said(r)
    await api.wait_phase(name, "Ready")
    r = await cli(api, "sandbox", "get", name)
    assert f"{template} revision 1" in r.output, said(r)
    r = await cli(api, "sandbox", "get", name, "-o", "json")
    spec = json.loads(r.output)["spec"]
    assert (spec["image"], spec["env"], spec["labels"]) == (
        "registry.example/a:1", {"MODE": "cli"}, {"team": "x", "who": "me"},
    )  # fmt: skip
    r = await cli(api, "sandbox", "create", unique("cli"), "--template", template, "--image", "x")
    assert r.exit_code != 0 and "--image" in said(r), said(r)
    r = await cli(api, "template", "delete", template)
    assert r.exit_code == 0 and "was at revision 2" in r.output, said(r)


async def test_of_two_updates_from_the_same_revision_exactly_one_is_written(api: Api) -> None:
    template = unique("tpl")
    await make_template(api, template)
    async with api.client() as c:

        async def update(image: str) -> int:
            body = {"spec": {**SPEC, "image": image}, "expected_revision": 1}
            return (await c.put(f"/v1/templates/{template}", json=body)).status_code

        for _ in range(5):  # each round races a pair from the newest revision
            current = (await c.get(f"/v1/templates/{template}")).json()["revision"]

            async def update_from(image: str, base: int = current) -> int:
                body = {"spec": {**SPEC, "image": image}, "expected_revision": base}
                return (await c.put(f"/v1/templates/{template}", json=body)).status_code

            codes = await asyncio.gather(update_from("registry.example/a:1"),
                                         update_from("registry.example/b:1"))  # fmt: skip
            assert sorted(codes) == [200, 409], codes
            after = (await c.get(f"/v1/templates/{template}")).json()["revision"]
            assert after == current + 1
        assert await update("registry.example/c:1") == 409  # based on revision 1: stale
    revisions = await api.env.fetchval(
        "SELECT count(*) FROM template_revisions WHERE name = $1", template
    )
    assert revisions == 6


async def test_a_retried_create_gets_its_first_outcome_after_the_template_changed_or_went(
    api: Api,
) -> None:
    template, name = unique("tpl"), unique("retry")
    await make_template(api, template)
    body = {"name": name, "template": {"name": template}, "command_id": f"c-{name}"}
    async with api.client() as c:
        first = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert first.status_code == 201, first.text
        newer = {"spec": {**SPEC, "image": "registry.example/agent:2"}, "expected_revision": 1}
        assert (await c.put(f"/v1/templates/{template}", json=newer)).status_code == 200
        again = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert again.status_code == 201 and again.json() == first.json(), again.text
        assert (await c.delete(f"/v1/templates/{template}")).status_code == 200
        gone = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert gone.status_code == 201 and gone.json() == first.json(), gone.text
        # A revision stays readable after the template is deleted; a new create is refused.
        kept = await c.get(f"/v1/templates/{template}", params={"revision": 1})
        assert kept.status_code == 200 and kept.json()["spec"]["image"] == SPEC["image"]
        assert (await c.get(f"/v1/templates/{template}")).status_code == 404
        fresh = {**body, "name": unique("retry"), "command_id": None}
        r = await c.post("/v1/sandboxes", json=fresh)
        assert r.status_code == 404 and "field 'template'" in r.json()["message"], r.text
        row = (await c.get(f"/v1/sandboxes/{name}")).json()
    assert row["template"] == {"name": template, "revision": 1}


async def test_the_rows_rebuild_from_the_log_with_every_template_gone(api: Api) -> None:
    """Replay never reads the template tables: the log keeps each create's full spec and its
    template reference. (Last in the module: it empties the tables.)"""
    template, name = unique("tpl"), unique("replay")
    await make_template(api, template)
    async with api.client() as c:
        body = {"name": name, "template": {"name": template},
                "overrides": {"env": {"MODE": "replayed"}}}  # fmt: skip
        assert (await c.post("/v1/sandboxes", params={"wait": 30}, json=body)).status_code == 201
    await api.wait_phase(name, "Ready")
    await api.env.fetchval("WITH t AS (DELETE FROM templates) DELETE FROM template_revisions")
    report = await eventually(
        lambda: rebuild_and_compare(api.env.settings),
        lambda r: r.equal,
        timeout=30,
        what="the rebuild to equal the rows",
    )
    assert report.rebuilt == report.live > 0
    row = await api.env.fetchval("SELECT template FROM sandboxes WHERE key = $1", name)
    assert json.loads(row) == {"name": template, "revision": 1}


async def test_a_create_from_a_template_naming_a_gone_provider_names_the_template(
    api: Api,
) -> None:
    """Revision 1 names a provider that revision 2 dropped, and the provider was deleted since
    (allowed: no live template names it): a create pinning revision 1 is 404 naming the
    template, whose provider it is, not a `providers` field the request never had; nothing
    reaches the log."""
    template, gone = unique("tpl"), unique("gone")
    async with api.client() as c:
        assert (await c.post("/v1/providers", json={"name": gone})).status_code == 201
        await make_template(api, template, providers=[gone])
        r = await c.put(f"/v1/templates/{template}", json={"spec": SPEC, "expected_revision": 1})
        assert r.status_code == 200, r.text
        assert (await c.delete(f"/v1/providers/{gone}")).status_code == 200
        published = await api.commands_published()
        r = await c.post(
            "/v1/sandboxes",
            json={"name": unique("sb"), "template": {"name": template, "revision": 1}},
        )
    assert r.status_code == 404, r.text
    assert r.json()["message"] == (
        f"field 'template': provider {gone!r} not found (template {template!r} revision 1 names it)"
    )
    assert await api.commands_published() == published


async def test_a_templates_idle_timeout_reaches_the_sandboxes_made_from_it(api: Api) -> None:
    """Per-template idle suspend (issue 40): the timeout is part of the spec a template keeps,
    so every sandbox made from it carries it, and a revision without one makes sandboxes that
    never idle."""
    template, idle, plain = unique("tpl"), unique("sb"), unique("sb")
    async with api.client() as c:
        spec = {**SPEC, "idle_suspend_seconds": 900}
        r = await c.post("/v1/templates", json={"name": template, "spec": spec})
        assert r.status_code == 201, r.text
        body = {"name": idle, "template": {"name": template}}
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
        r = await c.put(f"/v1/templates/{template}", json={"spec": SPEC, "expected_revision": 1})
        assert r.status_code == 200, r.text
        body = {"name": plain, "template": {"name": template}}
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
        made = [(await c.get(f"/v1/sandboxes/{n}")).json() for n in (idle, plain)]
    assert made[0]["spec"]["idle_suspend_seconds"] == 900
    assert made[1]["spec"].get("idle_suspend_seconds") is None


async def test_the_cli_sets_shows_and_clears_a_templates_idle_timeout(api: Api) -> None:
    """`template create|update --idle-suspend` (issue 40): parsed like `sandbox create`'s,
    `off` on update clears it, and `template get` shows it as `sandbox get` does."""
    template, name = unique("tpl"), unique("cli")
    r = await cli(api, "template", "create", template, "--image", "registry.example/a:1",
                  "--idle-suspend", "15m")  # fmt: skip
    assert r.exit_code == 0, said(r)
    r = await cli(api, "template", "get", template)
    assert "suspended after 900s unused" in r.output, said(r)
    r = await cli(api, "sandbox", "create", name, "--template", template)
    assert r.exit_code == 0, said(r)
    r = await cli(api, "sandbox", "get", name)
    assert "suspended after 900s unused" in r.output, said(r)
    r = await cli(api, "template", "update", template, "--idle-suspend", "soon")
    assert r.exit_code == 2 and "--idle-suspend" in said(r), said(r)
    r = await cli(api, "template", "update", template, "--idle-suspend", "off")
    assert r.exit_code == 0 and "(revision 2)" in r.output, said(r)
    r = await cli(api, "template", "get", template, "-o", "json")
    assert json.loads(r.output)["spec"].get("idle_suspend_seconds") is None, r.output
    r = await cli(api, "template", "get", template)
    assert "never suspended" in r.output, said(r)


async def test_a_template_write_wakes_the_pool_controller(api: Api) -> None:
    """Its create, update and delete notify the pools channel (the controller no longer wakes on
    every commit, so a template's new revision would otherwise wait for its 2 s poll)."""
    name = unique("tplwake")
    body = templates.TemplateBody(spec=SandboxSpec.model_validate(SPEC))
    async with api.env.pool.acquire() as conn, api.env.pool.acquire() as listener:
        pid = conn.get_server_pid()
        heard: list[str] = []

        def hear(_: object, sender: int, channel: str, __: str) -> None:
            if sender == pid:  # this schema's other writers notify it too
                heard.append(channel)

        channel = await listen(listener, POOLS_CHANNEL, hear)
        try:
            at = datetime.now(UTC)
            await templates.create_template(conn, name, body, "admin", at)
            await templates.update_template(conn, name, body, 1, "admin", at)
            await templates.delete_template(conn, name)
            await eventually(lambda: list(heard), lambda h: len(h) >= 3, what="three notifies")
            assert heard == [channel] * 3
        finally:
            await listener.remove_listener(channel, hear)
