"""The API against a hostile client, on the real stack: every malformed input is a clear 4xx
naming what is wrong, never a 5xx, and nothing is published for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import apikit
import factories as f
import pytest
import pytest_asyncio
from apikit import Api, create_body, unique

from drivers.fake import FakeDriver
from events.codec import encode
from events.common import SandboxSpec
from events.publisher import CommandPublisher, now
from services.api import readmodel
from services.api.gateway import CommandGateway, CommandTooLarge
from services.api.readmodel import ChangeFeed
from services.common import templates
from services.common.kafka_clients import kafka_client_args
from services.common.templates import TemplateBody

# The filters a plain list's page token is bound to.
LIST_FILTERS = {"phase": [], "eq": {}, "has": [], "deleted": False}


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


async def test_a_template_or_pool_asking_for_more_grace_than_its_token_may_is_refused(
    api: Api,
) -> None:
    """A template (and a pool of it) bypassed the cap: the pool controller creates the members
    itself, unchecked. Now a template write and a pool naming a template are held to it."""
    spec, big = {"image": "registry.example/agent:1"}, {"stop_timeout_seconds": 31}
    async with api.client() as c:
        name = unique("tpl")
        r = await c.post("/v1/templates", json={"name": name, "spec": spec | big})
        assert r.status_code == 422 and r.json()["code"] == "INVALID_ARGUMENT", r.text
        assert r.json()["message"].startswith("field 'spec.stop_timeout_seconds': at most 30")
        r = await c.post("/v1/templates", json={"name": name, "spec": spec})
        assert r.status_code == 201, r.text
        r = await c.put(f"/v1/templates/{name}", json={"expected_revision": 1, "spec": spec | big})
        assert r.status_code == 422 and "'spec.stop_timeout_seconds'" in r.text, r.text
        # One written before the cap (or by a token with a higher one): no pool of it.
        slow = unique("tpl-slow")
        async with api.env.pool.acquire() as conn:
            body = TemplateBody(spec=SandboxSpec.model_validate(spec | big))
            await templates.create_template(conn, slow, body, "t", now())
        pool = unique("pool")
        r = await c.post("/v1/pools", json={"name": pool, "template": slow, "size": 0})
        assert r.status_code == 422 and r.json()["code"] == "INVALID_ARGUMENT", r.text
        assert r.json()["message"].startswith("field 'template': ") and "at most 30" in r.text
        r = await c.post("/v1/pools", json={"name": pool, "template": name, "size": 0})
        assert r.status_code == 201, r.text
        r = await c.patch(f"/v1/pools/{pool}", json={"expected_revision": 1, "template": slow})
        assert r.status_code == 422 and "field 'template': " in r.text, r.text
        assert (await c.get(f"/v1/pools/{pool}")).json()["template"] == name


# -- authentication first, bodies bounded ---------------------------------------------------------


async def test_an_unauthenticated_request_is_refused_before_its_body_is_looked_at(
    api: Api,
) -> None:
    huge = b"{" * (api.env.settings.api_max_body_bytes + 1)
    async with api.client(token=None) as anonymous, api.client(token="sst_wrong") as wrong:
        for client in (anonymous, wrong):
            r = await client.post("/v1/sandboxes", content=huge)
            assert r.status_code == 401 and r.json()["code"] == "UNAUTHENTICATED", r.text
    async with api.client(token=apikit.READER) as reader:
        r = await reader.post("/v1/sandboxes", content=huge)
        assert r.status_code == 403 and r.json()["code"] == "PERMISSION_DENIED", r.text


async def test_two_authorization_headers_are_refused_whichever_they_are(api: Api) -> None:
    """A hostile pass found the HTTP door reading the first of two Authorization headers and
    the gRPC door the last: which one was meant is no guess, so both doors refuse two."""
    for first, second in ((apikit.READER, apikit.ADMIN), (apikit.ADMIN, apikit.ADMIN)):
        two = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")]
        async with api.client(token=None) as c:
            for method, path in (("GET", "/v1/sandboxes"), ("GET", "/readyz"),
                                 ("GET", "/metrics"), ("POST", "/v1/sandboxes")):  # fmt: skip
                r = await c.request(method, path, headers=two, json=create_body(unique()))
                assert r.status_code == 401, (method, path, r.text)
                assert "more than one Authorization header" in r.json()["message"], r.text


async def test_a_body_above_the_limit_is_413_declared_or_streamed(api: Api) -> None:
    limit = api.env.settings.api_max_body_bytes
    before = await api.commands_published()

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(limit // 1000 + 2):
            yield b" " * 1000

    async with api.client() as c:
        declared = await c.post("/v1/sandboxes", content=b" " * (limit + 1))
        streamed = await c.post("/v1/sandboxes", content=chunked())
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        assert r.json()["code"] == "PAYLOAD_TOO_LARGE"
        assert f"larger than {limit} bytes" in r.json()["message"]
    assert await api.commands_published() == before


async def test_an_oversized_command_is_413_not_a_retryable_503() -> None:
    """With the body limit raised above Kafka's record size, a command too large for a record
    is refused as such (retrying cannot help), and nothing is published."""
    async with apikit.running_api(
        FakeDriver(), settings_update={"api_max_body_bytes": 4 * 1024 * 1024}
    ) as big:
        before = await big.commands_published()
        env = {f"V{i}": "x" * 9000 for i in range(200)}  # ~1.8 MB: above a 1 MiB record
        async with big.client() as c:
            r = await c.post("/v1/sandboxes", json=create_body(unique(), env=env))
        assert r.status_code == 413, r.text
        assert r.json()["code"] == "PAYLOAD_TOO_LARGE"
        assert "the processor decides" in r.json()["message"]
        assert await big.commands_published() == before


async def test_a_command_above_what_the_processor_decides_is_413_and_never_accepted() -> None:
    """The processor dead-letters an input above its limit, so a command the body limit and
    Kafka let through but above that limit was accepted (202) and never decided. Now a 413
    naming the limit, for its retry too, and nothing recorded under its id nor published."""
    limit = 20_000
    async with apikit.running_api(
        FakeDriver(), settings_update={"processor_max_input_bytes": limit}
    ) as small:
        before = await small.commands_published()
        body = {**create_body(unique(), env={"A": "x" * 9000, "B": "x" * 9000, "C": "x" * 9000}),
                "command_id": "too-big-1"}  # fmt: skip
        async with small.client() as c:
            first = await c.post("/v1/sandboxes", json=body)
            again = await c.post("/v1/sandboxes", json=body)
            status = await c.get("/v1/commands/too-big-1")
        for r in (first, again):
            assert r.status_code == 413, r.text
            assert r.json()["code"] == "PAYLOAD_TOO_LARGE"
            assert f"above the {limit} bytes the processor decides" in r.json()["message"]
        assert status.status_code == 404, status.text
        assert await small.env.fetch("SELECT 1 FROM api_commands") == []
        assert await small.commands_published() == before


async def test_the_gateway_takes_a_command_of_exactly_the_limit_and_refuses_one_byte_more(
    api: Api,
) -> None:
    """The bound is the processor's: a value of at most ``processor_max_input_bytes`` is
    decided (tests/test_dead_letters.py), so a command of exactly the limit is published and
    one a byte above it is refused before its id is recorded."""
    env = api.env
    at, above = unique(), unique()
    command = f.create(at, command_id=at, occurred_at=now())
    size = len(encode(command))
    bigger = f.create(above, command_id=above, occurred_at=now(), image=f.IMAGE + "x")
    assert len(encode(bigger)) == size + 1
    async with CommandPublisher(
        kafka_client_args(env.settings, "api"), topic=env.settings.topic_commands
    ) as publisher:
        gateway = CommandGateway(env.pool, publisher, ChangeFeed(env.pool), max_bytes=size)
        taken = await gateway.submit(command, 30)
        with pytest.raises(CommandTooLarge) as refused:
            await gateway.submit(bigger, 30)
    assert taken.outcome is not None and taken.outcome.accepted
    assert f"is {size + 1} bytes encoded, above the {size} bytes" in str(refused.value)
    recorded = await env.fetch("SELECT command_id FROM api_commands WHERE command_id = $1", above)
    assert recorded == []


# -- malformed parameters and page tokens ---------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "params", "headers", "field"),
    [
        ("/v1/sandboxes", {"label": "team=a\x00b"}, {}, "query parameter 'label'"),
        ("/v1/sandboxes", {"label": "te\x00am"}, {}, "query parameter 'label'"),
        (
            "/v1/sandboxes",
            {"page_token": readmodel.encode_page_token("sandboxes", LIST_FILTERS, "a\x00b")},
            {},
            "query parameter 'page_token'",
        ),
        (
            "/v1/sandboxes",
            {"page_token": readmodel.encode_page_token("sandboxes", LIST_FILTERS, 2**64)},
            {},
            "query parameter 'page_token'",
        ),
        (
            "/v1/sandboxes/nobody/history",
            {"page_token": readmodel.encode_page_token("history", {"name": "nobody"}, 2**63)},
            {},
            "query parameter 'page_token'",
        ),
        (
            "/v1/sandboxes/nobody/history",
            {"page_token": readmodel.encode_page_token("history", {"name": "nobody"}, "\x00")},
            {},
            "query parameter 'page_token'",
        ),
        ("/v1/watch", {"timeout": 0.2}, {"Last-Event-ID": str(2**63)}, "header 'Last-Event-ID'"),
        ("/v1/watch", {"cursor": str(2**63)}, {}, "query parameter 'cursor'"),
    ],
)
async def test_a_malformed_parameter_or_page_token_is_422_naming_it(
    api: Api, path: str, params: dict[str, Any], headers: dict[str, str], field: str
) -> None:
    async with api.client() as c:
        r = await c.get(path, params=params, headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "INVALID_ARGUMENT"
    assert r.json()["message"].startswith(field), r.json()["message"]


# -- idempotency keys -----------------------------------------------------------------------------


async def test_a_command_id_names_one_request_even_across_incarnations(api: Api) -> None:
    name = unique("idem")
    key = f"create-{name}"
    body = create_body(name) | {"command_id": key}
    other_body = create_body(name, command=["sleep", "1"]) | {"command_id": key}
    async with api.client() as c:
        first = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert first.status_code == 201, first.text
        published = await api.commands_published()

        conflict = await c.post("/v1/sandboxes", params={"wait": 30}, json=other_body)
        assert conflict.status_code == 409, conflict.text
        assert conflict.json()["code"] == "IDEMPOTENCY_CONFLICT"
        assert conflict.json()["command_id"] == key and repr(key) in conflict.json()["message"]
        # The same id for another sandbox, or by another caller, is another request too.
        elsewhere = create_body(unique("idem")) | {"command_id": key}
        assert (await c.post("/v1/sandboxes", json=elsewhere)).status_code == 409
        async with api.client(token=apikit.WRITER) as writer:
            assert (await writer.post("/v1/sandboxes", json=body)).status_code == 409

        # A new incarnation of the name: the key still names the first request.
        await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
        await api.wait_phase(name, "Deleted")
        assert (await c.post("/v1/sandboxes", json=other_body)).status_code == 409
        again = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert (again.status_code, again.json()) == (201, first.json())
        assert await api.phase(name) == "Deleted"  # the retry did not re-create it
        assert await api.commands_published() == published + 1  # the delete only


async def test_the_processor_survives_what_the_api_refused(api: Api) -> None:
    """After every hostile request above, the pipeline still decides commands."""
    assert api.plane is not None and not api.plane.stopping.is_set()
    name = unique("alive")
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
        assert r.status_code == 201, r.text
    await api.wait_phase(name, "Ready")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"image": "busy\x00box"}, "field 'spec.image'"),
        ({"image": "busybox", "command": ["sh", "-c", "\x00"]}, "field 'spec.command.2'"),
        ({"image": "busybox", "env": {"A": "x\x00"}}, "field 'spec.env.A'"),
        ({"image": "busybox", "labels": {"team": "\x00"}}, "field 'spec.labels.team'"),
    ],
)
async def test_a_nul_in_a_spec_is_422_and_never_reaches_the_processor(
    api: Api, spec: dict[str, Any], field: str
) -> None:
    before = await api.commands_published()
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", json={"name": unique(), "spec": spec})
    assert r.status_code == 422, r.text
    assert r.json()["message"].startswith(field), r.json()["message"]
    assert "NUL" in r.json()["message"]
    assert await api.commands_published() == before


YEAR_0 = "0001-01-01T00:00:00+14:00"  # in UTC: 0000-12-31T10:00:00, before year 1
YEAR_10000 = "9999-12-31T23:00:00-14:00"  # in UTC: 10000-01-01T13:00:00


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/v1/audit/export", {"since": YEAR_0}, "since"),
        ("/v1/audit/export", {"until": YEAR_0}, "until"),
        ("/v1/audit/export", {"since": YEAR_10000}, "since"),
        ("/v1/audit/sandboxes/{name}/at", {"time": YEAR_0}, "time"),
        ("/v1/sandboxes/{name}/logs", {"since": YEAR_0}, "since"),
        ("/v1/sandboxes/{name}/logs", {"since": YEAR_10000}, "since"),
    ],
)
async def test_a_time_out_of_range_in_utc_is_422_naming_it(
    api: Api, path: str, params: dict[str, str], field: str
) -> None:
    """A time Python and PostgreSQL's driver cannot hold once in UTC. The export answered 200
    with an empty body (its stream failed once begun: "date value out of range"); every route
    that takes a time now refuses it first. The sandbox exists, so a route would go on to
    read it."""
    name = unique()
    async with api.client() as c:
        made = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
        assert made.status_code == 201, made.text
    async with api.client(apikit.AUDITOR if "audit" in path else apikit.ADMIN) as c:
        r = await c.get(path.format(name=name), params=params)
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "INVALID_ARGUMENT"
    assert r.json()["message"].startswith(f"query parameter {field!r}: out of range")


async def test_a_time_at_the_edge_of_the_range_in_utc_is_taken(api: Api) -> None:
    async with api.client(apikit.AUDITOR) as c:
        early = await c.get("/v1/audit/export", params={"since": "0001-01-01T00:00:00-01:00"})
        late = await c.get("/v1/audit/export", params={"until": "9999-12-31T23:59:59+01:00"})
    for r in (early, late):
        assert r.status_code == 200, r.text
