"""The HTTP API against the real stack: Kafka, PostgreSQL, the processor and the executor.

The API never calls a driver, so the pipeline behind it runs with the fake driver (which lets
tests hold a sandbox in Stopping). Every endpoint, every error code, auth, pagination, waiting,
idempotent retries and resuming the watch stream from a cursor.
"""

from __future__ import annotations

import asyncio
import stat
import traceback
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import apikit
import asyncpg
import factories as f
import httpx
import pytest
import pytest_asyncio
from apikit import ADMIN, READER, WRITER, Api, create_body, read_events, rows, unique
from harness import eventually, isolated_env

from drivers.fake import FakeDriver
from events.publisher import CommandPublisher
from events.topics import CHANGES_CHANNEL
from services.api import idempotency, readmodel
from services.api.app import create_app
from services.api.readmodel import changes
from services.common import metrics
from services.common import tokens as auth
from services.common.database import connect_pool
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    # Observations stamped with the wall clock, as a real driver's are: with the fake's own
    # clock (2025 on) a watch event deciding Ready before the launch's result would set
    # the row's updated_at before its created_at.
    async with apikit.running_api(FakeDriver(clock=lambda: datetime.now(UTC))) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def idle_api() -> AsyncIterator[Api]:
    """The API with no processor behind it: nothing is ever decided, and the lag grows."""
    async with apikit.running_api(None, settings_update={"readiness_max_lag": 0}) as running:
        yield running


def driver_of(api: Api) -> FakeDriver:
    assert api.plane is not None and isinstance(api.plane.driver, FakeDriver)
    return api.plane.driver


async def create_ready(api: Api, name: str, **spec: object) -> dict[str, object]:
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name, **spec))
        assert r.status_code == 201, r.text
    await api.wait_phase(name, "Ready")
    return dict(r.json())


# --------------------------------------------------------------------------- OpenAPI, health


async def test_openapi_lists_every_endpoint_of_the_api(api: Api) -> None:
    async with api.client(token=None) as c:
        r = await c.get("/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert set(paths["/v1/sandboxes"]) == {"get", "post"}
    assert set(paths["/v1/sandboxes/{name}"]) == {"get", "delete"}
    for verb in ("stop", "start", "restart"):
        assert set(paths[f"/v1/sandboxes/{{name}}:{verb}"]) == {"post"}
    for path in ("/v1/commands/{command_id}", "/v1/sandboxes/{name}/history", "/v1/watch",
                 "/healthz", "/readyz", "/metrics"):  # fmt: skip
        assert "get" in paths[path], path
    assert r.json()["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


async def test_healthz_readyz_and_metrics(api: Api) -> None:
    await create_ready(api, unique("metrics"))
    async with api.client() as c:
        ready = await eventually(
            lambda: c.get("/readyz"),
            lambda r: r.status_code == 200 and r.json()["lag"] == 0,
            what="readiness with nothing left to apply",
        )
        body = ready.json()
        assert body["status"] == "ready" and body["lag"] == 0
        assert {k: v["ok"] for k, v in body["checks"].items()} == {
            "kafka": True, "postgres": True, "log": True, "processor_lag": True,
        }  # fmt: skip
        metrics = await c.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'sandstream_api_requests_total{method="POST",route="/v1/sandboxes",status="201"}' in text
    assert "sandstream_inputs_total" in text  # the processor's metrics, same registry


async def test_probes_see_only_ready_or_not_and_metrics_need_the_ops_scope(api: Api) -> None:
    async with api.client(token=None) as c:
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        ready = await eventually(
            lambda: c.get("/readyz"), lambda r: r.status_code == 200, what="ready"
        )
        assert ready.json() == {"status": "ready"}  # no addresses, lag or errors
        metrics = await c.get("/metrics")
        assert metrics.status_code == 401 and metrics.json()["code"] == "UNAUTHENTICATED"
    async with api.client(token=apikit.READER) as c:  # a valid token without ops:read
        assert (await c.get("/readyz")).json() == {"status": "ready"}
        metrics = await c.get("/metrics")
        assert metrics.status_code == 403
        assert metrics.json()["message"] == "token 'reader' lacks the scope ops:read"
    async with api.client(token="sst_not-a-token") as c:  # a token sent must be valid
        assert (await c.get("/readyz")).status_code == 401


async def test_readyz_hides_why_it_is_not_ready_from_callers_without_the_ops_scope(
    idle_api: Api,
) -> None:
    async with idle_api.client() as c:
        r = await c.post("/v1/sandboxes", json=create_body(unique("lag")))
        assert r.status_code == 202
    async with idle_api.client(token=None) as c:
        bare = await c.get("/readyz")
    assert bare.status_code == 503
    assert bare.json() == {
        "code": "UNAVAILABLE",
        "message": "not ready (the checks need a token with the ops:read scope)",
        "status": "not ready",
    }


async def test_readyz_fails_while_the_processor_lags(idle_api: Api) -> None:
    async with idle_api.client() as c:
        r = await c.post("/v1/sandboxes", json=create_body(unique("lag")))
        assert r.status_code == 202
        ready = await c.get("/readyz")
    assert ready.status_code == 503
    body = ready.json()
    assert body["code"] == "UNAVAILABLE"
    assert body["checks"]["kafka"]["ok"] and body["checks"]["postgres"]["ok"]
    assert not body["checks"]["processor_lag"]["ok"] and body["lag"] >= 1
    assert "processor_lag" in body["message"]


# --------------------------------------------------------------------------- commands


async def test_create_with_wait_returns_201_and_the_row(api: Api) -> None:
    name = unique("create")
    async with api.client() as c:
        r = await c.post(
            "/v1/sandboxes",
            params={"wait": 30},
            json=create_body(
                name, command=["sleep", "60"], env={"A": "1"}, labels={"team": "ml"},
                stop_timeout_seconds=3,
            ),
        )  # fmt: skip
        assert r.status_code == 201, r.text
        assert r.headers["location"] == f"/v1/sandboxes/{name}"
        outcome = r.json()
        assert outcome["status"] == "accepted" and outcome["code"] == "OK"
        assert outcome["command_type"] == "CreateSandbox" and outcome["generation"] == 1
        await api.wait_phase(name, "Ready")
        row = (await c.get(f"/v1/sandboxes/{name}")).json()
    assert row["id"] == outcome["sandbox_id"]
    assert (row["name"], row["phase"], row["generation"], row["version"]) == (name, "Ready", 1, 2)
    assert row["spec"] == {
        "image": "registry.example/agent:1", "command": ["sleep", "60"], "env": {"A": "1"},
        "labels": {"team": "ml"}, "stop_timeout_seconds": 3,
    }  # fmt: skip
    assert outcome["identity"] == row["identity"]  # the identity the create minted
    assert row["labels"] == {"team": "ml"}
    assert {c["type"]: c["status"] for c in row["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Failed": "False",
    }  # fmt: skip
    assert row["exit_code"] is None and row["reason"] is None
    assert row["created_at"] <= row["updated_at"] and row["change_seq"] > 0
    # The command carries the token's name as its actor.
    history = await api.env.fetch(
        "SELECT message->>'actor' AS actor FROM history WHERE key = $1 AND message_type = $2",
        name, "CreateSandbox",
    )  # fmt: skip
    assert [h["actor"] for h in history] == ["admin"]


async def test_without_wait_202_then_the_command_status_follows(api: Api) -> None:
    name = unique("async")
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", json=create_body(name))
        assert r.status_code == 202
        pending = r.json()
        assert pending["status"] == "pending" and pending["code"] is None
        command_id = pending["command_id"]
        assert r.headers["location"] == f"/v1/commands/{command_id}"
        status = await c.get(f"/v1/commands/{command_id}", params={"wait": 30})
        assert status.status_code == 200
        assert status.json()["status"] == "accepted" and status.json()["name"] == name
        narrowed = await c.get(f"/v1/commands/{command_id}", params={"sandbox": name})
        assert narrowed.json() == status.json()
        other = await c.get(f"/v1/commands/{command_id}", params={"sandbox": "someone-else"})
        assert other.status_code == 404 and other.json()["code"] == "NOT_FOUND"


async def test_lifecycle_commands_with_wait(api: Api) -> None:
    name = unique("life")
    await create_ready(api, name)
    async with api.client() as c:
        stop = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30})
        assert stop.status_code == 200 and stop.json()["phase"] == "Stopping"
        await api.wait_phase(name, "Stopped")
        start = await c.post(f"/v1/sandboxes/{name}:start", params={"wait": 30})
        assert start.status_code == 200
        assert (start.json()["phase"], start.json()["generation"]) == ("Starting", 2)
        await api.wait_phase(name, "Ready")
        restart = await c.post(f"/v1/sandboxes/{name}:restart", params={"wait": 30}, json={})
        assert restart.status_code == 200 and restart.json()["generation"] == 3
        await api.wait_phase(name, "Ready")
        delete = await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
        assert delete.status_code == 200 and delete.json()["phase"] == "Deleting"
        await api.wait_phase(name, "Deleted")
        # A tombstone: 404 on get, hidden from the list, its history kept.
        gone = await c.get(f"/v1/sandboxes/{name}")
        assert gone.status_code == 404
        assert gone.json() == {"code": "NOT_FOUND", "message": f"sandbox {name!r} not found"}
        listed = (await c.get("/v1/sandboxes", params={"limit": 500})).json()["items"]
        assert name not in [s["name"] for s in listed]
        with_deleted = await c.get("/v1/sandboxes", params={"include_deleted": "true",
                                                            "limit": 500})  # fmt: skip
        tomb = [s for s in with_deleted.json()["items"] if s["name"] == name]
        assert [(s["phase"], s["generation"]) for s in tomb] == [("Deleted", 3)]
        only_deleted = await c.get("/v1/sandboxes", params={"phase": "Deleted", "limit": 500})
        assert name in [s["name"] for s in only_deleted.json()["items"]]
        history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
        applied = [h["message_type"] for h in history if h["disposition"] == "applied"]
        assert applied[0] == "CreateSandbox" and "DeleteSandbox" in applied
        assert history[-1]["phase"] == "Deleted"


async def test_a_retry_with_the_same_command_id_gets_the_same_outcome(api: Api) -> None:
    name = unique("retry")
    body = create_body(name) | {"command_id": f"create-{name}"}
    async with api.client() as c:
        first = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert first.status_code == 201
        published = await api.commands_published()
        again = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert (again.status_code, again.json()) == (201, first.json())
        # Answered from the stored outcome: not even published again.
        assert await api.commands_published() == published

        # A rejected command's retry is rejected the same way, even once it would succeed.
        ghost = unique("ghost")
        stop_id = {"command_id": f"stop-{ghost}"}
        rejected = await c.post(f"/v1/sandboxes/{ghost}:stop", params={"wait": 30}, json=stop_id)
        assert rejected.status_code == 404 and rejected.json()["code"] == "NOT_FOUND"
        await create_ready(api, ghost)
        retried = await c.post(f"/v1/sandboxes/{ghost}:stop", params={"wait": 30}, json=stop_id)
        assert (retried.status_code, retried.json()) == (404, rejected.json())
        assert await api.phase(ghost) == "Ready"


async def test_concurrent_retries_are_decided_once(api: Api) -> None:
    name = unique("twice")
    body = create_body(name) | {"command_id": f"c-{name}"}
    async with api.client() as c:
        answers = await asyncio.gather(*(c.post("/v1/sandboxes", json=body) for _ in range(3)))
        assert {a.status_code for a in answers} <= {201, 202}
        await api.wait_phase(name, "Ready")
        history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
    creates = [h["disposition"] for h in history if h["message_type"] == "CreateSandbox"]
    assert creates.count("applied") == 1
    assert set(creates) <= {"applied", "duplicate"}


async def test_a_wait_that_times_out_returns_202_pending(idle_api: Api) -> None:
    name = unique("slow")
    async with idle_api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 0.3}, json=create_body(name))
        assert r.status_code == 202
        assert r.json()["status"] == "pending"
        status = await c.get(f"/v1/commands/{r.json()['command_id']}", params={"wait": 0.2})
        assert status.status_code == 200 and status.json()["status"] == "pending"
        never = await c.get("/v1/commands/never-published")
        assert never.status_code == 404 and never.json()["code"] == "NOT_FOUND"
        assert "neither decided nor published" in never.json()["message"]


async def test_a_publish_kafka_does_not_acknowledge_is_503_and_says_how_to_retry() -> None:
    # A publish timeout of 0: the gateway gives up before Kafka can acknowledge, as it does
    # when a broker does not answer in time. (A topic the API may not write is a refusal, not
    # this: tests/test_kafka_forbidden.py.)
    async with apikit.running_api(None, publish_timeout=0) as idle, idle.client() as c:
        r = await c.post("/v1/sandboxes", json=create_body(unique()) | {"command_id": "c-503"})
    assert r.status_code == 503
    body = r.json()
    assert body["code"] == "UNAVAILABLE" and body["command_id"] == "c-503"
    assert "retry with the same command_id 'c-503'" in body["message"]


async def test_an_unreachable_postgresql_is_503_json_and_counted_as_503(settings: Settings) -> None:
    # A pool that cannot connect (nothing listens on port 1): every read fails to connect.
    down = settings.model_copy(update={"pg_port": 1})
    pool = await asyncpg.create_pool(down.pg_dsn, min_size=0)
    assert pool is not None
    publisher = CommandPublisher(kafka_client_args(settings, "api"), topic=settings.topic_commands)
    app = create_app(down, pool, publisher, apikit.tokens())
    counted = metrics.API_REQUESTS.labels("GET", "/v1/sandboxes", "503")
    before = counted._value.get()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
            r = await c.get("/v1/sandboxes", headers={"Authorization": f"Bearer {ADMIN}"})
    finally:
        await pool.close()
    assert r.status_code == 503
    assert r.json()["code"] == "UNAVAILABLE"
    assert counted._value.get() == before + 1


async def test_a_connection_a_postgresql_restart_left_broken_is_503_not_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the chaos checker: a create published while PostgreSQL restarted failed to
    mark its command published with asyncpg's InternalClientError (a connection left in a
    broken state), which was answered 500; it is the database being away: 503, and a retry
    with the same command id gets the outcome."""

    async def broken(pool: object, command_id: str) -> None:
        raise asyncpg.exceptions.InternalClientError(
            "cannot switch to state 12; another operation (2) is in progress"
        )

    monkeypatch.setattr(idempotency, "mark_published", broken)
    async with apikit.running_api(None) as api, api.client() as c:
        r = await c.post("/v1/sandboxes", json=create_body(unique("broken")))
    assert r.status_code == 503
    assert r.json()["code"] == "UNAVAILABLE"


# --------------------------------------------------------------------------- outcome errors


async def test_rejections_map_to_their_status_codes(api: Api) -> None:
    name = unique("codes")
    await create_ready(api, name)
    async with api.client() as c:
        exists = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
        assert exists.status_code == 409
        assert exists.json()["code"] == "ALREADY_EXISTS"
        assert exists.json()["message"] == f"sandbox {name!r} already exists (phase: Ready)"

        aborted = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30},
                               json={"expected_version": 1})  # fmt: skip
        assert aborted.status_code == 409 and aborted.json()["code"] == "ABORTED"
        assert "expected version 1" in aborted.json()["message"]

        missing = await c.post(f"/v1/sandboxes/{unique('none')}:restart", params={"wait": 30})
        assert missing.status_code == 404 and missing.json()["code"] == "NOT_FOUND"

        # Hold the stop in the driver: the sandbox stays Stopping, where start is refused.
        held = driver_of(api).block("stop", name)
        try:
            stop = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30},
                                json={"expected_version": 2})  # fmt: skip
            assert stop.status_code == 200
            await held.entered()
            start = await c.post(f"/v1/sandboxes/{name}:start", params={"wait": 30})
            assert start.status_code == 412
            assert start.json()["code"] == "FAILED_PRECONDITION"
            assert start.json()["message"] == (
                "sandbox must be Stopped, Suspended, Completed, Error to start "
                "(current phase: Stopping)"
            )
        finally:
            held.release()
        await api.wait_phase(name, "Stopped")


async def test_not_found_for_unknown_sandboxes_and_endpoints(api: Api) -> None:
    name = unique("nobody")
    async with api.client() as c:
        for path in (f"/v1/sandboxes/{name}", f"/v1/sandboxes/{name}/history"):
            r = await c.get(path)
            assert r.status_code == 404
            assert r.json() == {"code": "NOT_FOUND", "message": f"sandbox {name!r} not found"}
        route = await c.get("/v1/nothing-here")
        assert route.status_code == 404 and route.json()["code"] == "NOT_FOUND"
        method = await c.put("/v1/sandboxes")
        assert method.status_code == 405 and method.json()["code"] == "METHOD_NOT_ALLOWED"


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "message"),
    [
        ("POST", "/v1/sandboxes", {"json": {"name": "x", "spec": {}}},
         "field 'spec.image': Field required"),
        ("POST", "/v1/sandboxes", {"json": {"spec": {"image": "i"}}},
         "field 'name': Field required"),
        ("POST", "/v1/sandboxes", {"json": {"name": "Bad_Name", "spec": {"image": "i"}}},
         "field 'name': must be a DNS label"),
        ("POST", "/v1/sandboxes", {"json": {"name": "x", "spec": {"image": "i"}, "extra": 1}},
         "field 'extra': Extra inputs are not permitted"),
        ("POST", "/v1/sandboxes",
         {"json": {"name": "x", "spec": {"image": "i", "env": {"1BAD": "v"}}}},
         "field 'spec.env': invalid environment variable name '1BAD'"),
        ("POST", "/v1/sandboxes", {"content": b"{not json",
                                   "headers": {"content-type": "application/json"}},
         "request body is not valid JSON"),
        ("POST", "/v1/sandboxes", {}, "request body is required"),
        ("POST", "/v1/sandboxes/x:stop", {"json": {"expected_version": -1}},
         "field 'expected_version': Input should be greater than or equal to 0"),
        ("POST", "/v1/sandboxes/x:stop", {"json": {"command_id": "has space"}},
         "field 'command_id': must be 1-128 characters"),
        ("POST", "/v1/sandboxes/x:stop?wait=61", {},
         "query parameter 'wait': Input should be less than or equal to 60"),
        ("DELETE", "/v1/sandboxes/UPPER", {}, "path parameter 'name': must be a DNS label"),
        ("GET", "/v1/sandboxes?limit=0", {},
         "query parameter 'limit': Input should be greater than or equal to 1"),
        ("GET", "/v1/sandboxes?phase=Sleeping", {}, "query parameter 'phase.0': Input should be"),
        ("GET", "/v1/sandboxes?label==v", {}, "query parameter 'label': expected key=value or key"),
        ("GET", "/v1/sandboxes?page_token=garbage", {},
         "query parameter 'page_token': malformed page token"),
        ("GET", "/v1/sandboxes/x/history?page_token=e30", {},
         "query parameter 'page_token': malformed page token"),
        ("GET", "/v1/sandboxes?lable=team=ml", {}, "unknown query parameter 'lable'"),
        ("GET", "/v1/watch?cursor=-1", {},
         "query parameter 'cursor': Input should be greater than or equal to 0"),
        ("GET", "/v1/watch", {"headers": {"Last-Event-ID": "yesterday"}},
         "header 'Last-Event-ID': must be a non-negative integer"),
    ],
)  # fmt: skip
async def test_invalid_requests_are_422_naming_the_field(
    api: Api, method: str, path: str, kwargs: dict[str, object], message: str
) -> None:
    before = await api.commands_published()
    async with api.client() as c:
        r = await c.request(method, path, **kwargs)  # type: ignore[arg-type]
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "INVALID_ARGUMENT"
    assert body["message"].startswith(message), body["message"]
    assert await api.commands_published() == before


# --------------------------------------------------------------------------- auth


async def test_auth_missing_or_wrong_token_is_401_wrong_scope_403_and_nothing_published(
    api: Api,
) -> None:
    name = unique("auth")
    before = await api.commands_published()
    cases = [
        (None, "POST", "/v1/sandboxes", 401, "UNAUTHENTICATED"),
        ("not-a-token", "POST", "/v1/sandboxes", 401, "UNAUTHENTICATED"),
        (READER, "POST", "/v1/sandboxes", 403, "PERMISSION_DENIED"),
        (READER, "POST", f"/v1/sandboxes/{name}:stop", 403, "PERMISSION_DENIED"),
        (READER, "DELETE", f"/v1/sandboxes/{name}", 403, "PERMISSION_DENIED"),
        (None, "GET", "/v1/sandboxes", 401, "UNAUTHENTICATED"),
        ("not-a-token", "GET", f"/v1/sandboxes/{name}", 401, "UNAUTHENTICATED"),
        (WRITER, "GET", "/v1/sandboxes", 403, "PERMISSION_DENIED"),
        (WRITER, "GET", "/v1/watch", 403, "PERMISSION_DENIED"),
        (None, "GET", "/v1/commands/x", 401, "UNAUTHENTICATED"),
    ]
    for token, method, path, status, code in cases:
        async with api.client(token) as c:
            body = create_body(name) if path == "/v1/sandboxes" and method == "POST" else None
            r = await c.request(method, path, json=body, params={"wait": 1})
        assert (r.status_code, r.json()["code"]) == (status, code), (token, method, path)
        if status == 401:
            assert r.headers["www-authenticate"].startswith("Bearer")
    # Auth comes first even when the body is malformed, and not as a 422.
    broken = {"content": b"{", "headers": {"content-type": "application/json"}}
    async with api.client(READER) as c:
        assert (await c.post("/v1/sandboxes", **broken)).status_code == 403  # type: ignore[arg-type]
    async with api.client(None) as c:
        assert (await c.post("/v1/sandboxes", **broken)).status_code == 401  # type: ignore[arg-type]
    async with api.client(f"{ADMIN}x") as c:
        assert (await c.get("/v1/sandboxes")).status_code == 401
    assert await api.commands_published() == before
    assert await api.phase(name) is None
    # The write-only token may command, the read-only one may read.
    async with api.client(WRITER) as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name))
        assert r.status_code == 201
    async with api.client(READER) as c:
        assert (await c.get(f"/v1/sandboxes/{name}")).status_code == 200


# --------------------------------------------------------------------------- list, filters


async def test_list_filters_and_keyset_pagination(api: Api) -> None:
    batch = unique("batch")
    names = sorted(f"{batch}-{i}" for i in range(5))
    async with api.client() as c:
        for i, name in enumerate(names):
            labels = {"batch": batch, "parity": "even" if i % 2 == 0 else "odd"}
            r = await c.post("/v1/sandboxes", params={"wait": 30},
                             json=create_body(name, labels=labels))  # fmt: skip
            assert r.status_code == 201
        for name in names:
            await api.wait_phase(name, "Ready")

        pages, seen, token = 0, [], None
        while True:
            params = {"label": f"batch={batch}", "limit": 2}
            if token:
                params["page_token"] = token
            page = (await c.get("/v1/sandboxes", params=params)).json()
            pages += 1
            seen += [s["name"] for s in page["items"]]
            assert len(page["items"]) <= 2 and page["cursor"] > 0
            token = page["next_page_token"]
            if not token:
                break
        assert (seen, pages) == (names, 3)

        # A page token belongs to its query.
        first = await c.get("/v1/sandboxes", params={"label": f"batch={batch}", "limit": 2})
        other = await c.get("/v1/sandboxes", params={
            "label": "batch=other", "page_token": first.json()["next_page_token"]})  # fmt: skip
        assert other.status_code == 422 and "different query" in other.json()["message"]

        even = await c.get("/v1/sandboxes", params={"label": [f"batch={batch}", "parity=even"]})
        assert [s["name"] for s in even.json()["items"]] == names[0::2]
        has = await c.get("/v1/sandboxes", params={"label": ["parity", f"batch={batch}"]})
        assert [s["name"] for s in has.json()["items"]] == names

        await c.post(f"/v1/sandboxes/{names[1]}:stop", params={"wait": 30})
        await api.wait_phase(names[1], "Stopped")
        stopped = await c.get("/v1/sandboxes", params={"label": f"batch={batch}",
                                                        "phase": "Stopped"})  # fmt: skip
        assert [s["name"] for s in stopped.json()["items"]] == [names[1]]
        both = await c.get("/v1/sandboxes", params={"label": f"batch={batch}",
                                                     "phase": ["Stopped", "Ready"]})  # fmt: skip
        assert [s["name"] for s in both.json()["items"]] == names


# --------------------------------------------------------------------------- history


async def test_history_shows_ignored_observations_with_their_reason(api: Api) -> None:
    name = unique("hist")
    await create_ready(api, name)
    # A snapshot of a generation never issued: recorded, ignored, with the reason.
    await api.env.observe(f.running(name, generation=7))
    async with api.client() as c:
        entries = await eventually(
            lambda: c.get(f"/v1/sandboxes/{name}/history", params={"limit": 1000}),
            lambda r: any(h["generation"] == 1 and h["message"] and
                          h["message"].get("generation") == 7 for h in r.json()["items"]),
            what="the injected observation in the history",
        )  # fmt: skip
        items = entries.json()["items"]
        unknown = [h for h in items if h["message"] and h["message"].get("generation") == 7]
        assert unknown[0]["disposition"] == "ignored"
        assert unknown[0]["reason"].startswith("unknown generation: RuntimeSnapshot(running)")
        seqs = [h["seq"] for h in items]
        assert seqs == sorted(seqs)
        assert items[0]["message_type"] == "CreateSandbox"
        assert items[0]["events"] == ["SandboxCreated"] and items[0]["version"] == 1

        # Paged, oldest first.
        page1 = (await c.get(f"/v1/sandboxes/{name}/history", params={"limit": 2})).json()
        page2 = (
            await c.get(
                f"/v1/sandboxes/{name}/history",
                params={"limit": 2, "page_token": page1["next_page_token"]},
            )
        ).json()
        assert [h["seq"] for h in page1["items"] + page2["items"]] == seqs[:4]
        wrong = await c.get(f"/v1/sandboxes/{unique()}/history",
                            params={"page_token": page1["next_page_token"]})  # fmt: skip
        assert wrong.status_code == 422


# --------------------------------------------------------------------------- watch


async def test_watch_replays_then_follows_and_resumes_from_a_cursor(api: Api) -> None:
    a, b = unique("wa"), unique("wb")
    await create_ready(api, a)
    async with api.client() as c:
        # No cursor: the current rows first, then changes as they happen.
        first = await read_events(c, lambda ev: any(r["name"] == a and r["phase"] == "Ready"
                                                    for r in rows(ev)),
                                  params={"name": [a, b]})  # fmt: skip
        assert [r["name"] for r in rows(first)] == [a]
        cursor = first[-1].id
        assert cursor == rows(first)[-1]["change_seq"]

        # Changes while nobody watches.
        await c.post(f"/v1/sandboxes/{a}:stop", params={"wait": 30})
        await api.wait_phase(a, "Stopped")
        await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(b))
        await api.wait_phase(b, "Ready")
        await c.delete(f"/v1/sandboxes/{a}", params={"wait": 30})
        await api.wait_phase(a, "Deleted")

        def caught_up(ev: list[apikit.Event]) -> bool:
            latest = {r["name"]: r["phase"] for r in rows(ev)}
            return latest.get(a) == "Deleted" and latest.get(b) == "Ready"

        # Resume with Last-Event-ID (what EventSource sends), which wins over ?cursor=.
        resumed = await read_events(c, caught_up, params={"name": [a, b], "cursor": 0},
                                    headers={"Last-Event-ID": str(cursor)})  # fmt: skip
        ids = [e.id for e in resumed if e.event == "sandbox"]
        assert all(i is not None and i > cursor for i in ids)
        assert ids == sorted(ids)
        # The deletion is delivered as a change (the tombstone row), and it was the last one.
        assert (rows(resumed)[-1]["name"], rows(resumed)[-1]["phase"]) == (a, "Deleted")

        # ?cursor= alone resumes the same way.
        again = await read_events(c, caught_up, params={"name": [a, b], "cursor": cursor})
        assert [e.id for e in again if e.event == "sandbox"] == ids

        # A fresh watch (no cursor) skips tombstones unless asked for them: read it to its end.
        fresh = await read_events(c, lambda ev: False, params={"name": [a, b], "timeout": 1})
        assert [r["name"] for r in rows(fresh)] == [b]
        tombs = await read_events(c, lambda ev: len(rows(ev)) == 2,
                                  params={"name": [a, b], "include_deleted": "true"})  # fmt: skip
        assert {r["name"]: r["phase"] for r in rows(tombs)} == {a: "Deleted", b: "Ready"}


async def test_watchers_woken_together_share_one_horizon_query(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queries: list[Any] = []
    real = readmodel.current_horizon

    async def counted(pool: Any) -> int | None:
        # Only this feed's: the test loop is the session's, so another module's API (its feed,
        # its watchers polling once a second) may still be running meanwhile.
        if pool is env.pool:
            queries.append(pool)
        return await real(pool)

    monkeypatch.setattr(changes, "current_horizon", counted)  # the one ChangeFeed calls
    async with isolated_env() as env:
        feed = readmodel.ChangeFeed(env.pool)
        mark = feed.mark()
        # Another API's feed on another pool, as a leftover watcher would query meanwhile.
        other = await connect_pool(env.settings)
        elsewhere = readmodel.ChangeFeed(other)
        try:
            first, second, _ = await asyncio.gather(
                feed.horizon(mark), feed.horizon(mark), elsewhere.horizon(elsewhere.mark())
            )
        finally:
            await other.close()
        assert first == second and len(queries) == 1
        feed._notify()  # a change after it: the next mark needs a query of its own
        await feed.horizon(feed.mark())
        assert len(queries) == 2


async def test_watchers_sharing_a_failed_horizon_query_each_raise_their_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One error object raised in every watcher gathered all their frames, so one watcher's
    logged traceback could show another's path. Each gets a copy caused by the query's error."""
    lost = ConnectionResetError("connection lost")
    queries: list[object] = []

    async def failing(pool: Any) -> int | None:
        queries.append(pool)  # runs after both watchers awaited it: one query for the two
        raise lost

    monkeypatch.setattr(changes, "current_horizon", failing)
    feed = readmodel.ChangeFeed(None)  # type: ignore[arg-type]  # the query is replaced
    mark = feed.mark()

    async def first_watcher() -> int | None:
        return await feed.horizon(mark)

    async def second_watcher() -> int | None:
        return await feed.horizon(mark)

    one, two = await asyncio.gather(first_watcher(), second_watcher(), return_exceptions=True)
    assert len(queries) == 1  # the error is one shared object: each watcher raised a copy
    assert isinstance(one, ConnectionResetError) and isinstance(two, ConnectionResetError)
    assert one is not two and one.__cause__ is lost and two.__cause__ is lost
    frames = [{f.name for f in traceback.extract_tb(e.__traceback__)} for e in (one, two)]
    assert "first_watcher" in frames[0] and "second_watcher" not in frames[0], frames
    assert "second_watcher" in frames[1] and "first_watcher" not in frames[1], frames


async def test_watch_ends_at_its_timeout(api: Api) -> None:
    async with api.client() as c:
        loop = asyncio.get_running_loop()
        started = loop.time()
        events = await read_events(c, lambda ev: False, params={"name": unique(), "timeout": 0.3})
        assert events == [] and loop.time() - started < 10


async def test_watch_follows_changes_of_every_partition_in_order(api: Api) -> None:
    names = [unique("burst") for _ in range(8)]
    async with api.client() as c:

        def all_ready(ev: list[apikit.Event]) -> bool:
            return {r["name"] for r in rows(ev) if r["phase"] == "Ready"} == set(names)

        watching = asyncio.create_task(read_events(c, all_ready, params={"name": names}))
        await asyncio.gather(*(c.post("/v1/sandboxes", json=create_body(n)) for n in names))
        events = await watching
    ids = [e.id for e in events if e.event == "sandbox"]
    assert ids == sorted(ids) and len(ids) == len(set(ids))


async def test_the_watch_never_steps_over_a_change_still_being_written(idle_api: Api) -> None:
    """change_seq values are drawn inside transactions, so they can commit out of order."""
    env = idle_api.env
    first, second = unique("slow-writer"), unique("fast-writer")
    insert = (
        "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, providers, "
        "identity, created_at, updated_at, partition, change_seq) VALUES ($1, gen_random_uuid(), "
        "'Ready', 1, 1, '{\"image\": \"i\"}', '{}', 'rid', now(), now(), 0, "
        "nextval('sandbox_changes')) RETURNING change_seq"
    )
    async with env.pool.acquire() as slow, env.pool.acquire() as probe:
        start = await readmodel.change_horizon(probe)
        assert start is not None
        async with idle_api.client() as c:
            watching = asyncio.create_task(read_events(
                c, lambda ev: len(rows(ev)) == 2,
                params={"name": [first, second], "cursor": start},
            ))  # fmt: skip
            transaction = slow.transaction()
            await transaction.start()
            try:
                seq_first = await slow.fetchval(insert, first)  # drawn, not committed
                seq_second = await env.fetchval(insert, second)  # drawn later, committed
                await env.fetchval("SELECT pg_notify(notify_channel($1), '')", CHANGES_CHANNEL)
                assert seq_second > seq_first
                # The horizon cannot pass the uncommitted change.
                assert await readmodel.change_horizon(probe, timeout=0.3) is None
            finally:
                await transaction.commit()
            await env.fetchval("SELECT pg_notify(notify_channel($1), '')", CHANGES_CHANNEL)
            horizon = await readmodel.change_horizon(probe)
            assert horizon is not None and horizon >= seq_second
            events = await watching
    assert [(e.id, e.data["name"]) for e in events] == [(seq_first, first), (seq_second, second)]


# --------------------------------------------------------------------------- the tokens file


def test_tokens_file_is_private_hashed_reloaded_and_refused_when_open(tmp_path: Path) -> None:
    settings = Settings().model_copy(update={"run_dir": tmp_path / "run"})
    setup = auth.ensure_tokens(settings)
    assert setup.created
    value = setup.admin_token_file.read_text().strip()
    for path in (setup.tokens_file, setup.admin_token_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert value not in setup.tokens_file.read_text()
    again = auth.ensure_tokens(settings)  # existing file: left alone
    assert not again.created and setup.admin_token_file.read_text().strip() == value

    store = auth.TokenStore.from_file(setup.tokens_file)
    admin = store.authorize(value, auth.OPS)
    assert isinstance(admin, auth.Principal) and admin.name == "admin"
    assert admin.scopes == set(auth.SCOPES)  # every scope: audit, providers, ops included
    invalid = auth.Denied(401, "invalid bearer token")
    assert store.authorize(value + "x", auth.READ) == invalid
    assert store.authorize("", auth.READ) == invalid

    reader = auth.add_token(setup.tokens_file, "ci", (auth.READ,))
    principal = store.authorize(reader, auth.READ)  # the running store sees the new token
    assert isinstance(principal, auth.Principal) and principal.scopes == {auth.READ}
    with pytest.raises(ValueError, match="exists already"):
        auth.add_token(setup.tokens_file, "ci", (auth.READ,))
    with pytest.raises(ValueError, match="scopes must be"):
        auth.add_token(setup.tokens_file, "x", ("sandbox:admin",))

    setup.tokens_file.chmod(0o644)
    with pytest.raises(auth.TokenFileError, match="chmod 600"):
        auth.ensure_tokens(settings)


def test_a_token_expires_at_its_time_and_a_revoked_one_at_once(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    created = datetime.now(UTC)
    expires = created + timedelta(hours=1)
    value = auth.add_token(path, "ci", (auth.READ,), expires)
    other = auth.add_token(path, "other", (auth.READ,))
    store = auth.TokenStore.from_file(path)
    before = store.authorize(value, auth.READ, now=expires - timedelta(seconds=1))
    assert isinstance(before, auth.Principal) and before.name == "ci"
    after = store.authorize(value, auth.READ, now=expires)
    shown = expires.isoformat(timespec="seconds")
    assert after == auth.Denied(401, f"token 'ci' expired at {shown}")
    assert store.authorize(value, auth.WRITE, now=created) == auth.Denied(
        403, "token 'ci' lacks the scope sandbox:write"
    )
    assert auth.revoke_token(path, "other") == 1
    revoked = store.authorize(other, auth.READ)  # the same store: it re-reads the file
    assert isinstance(revoked, auth.Denied) and revoked.status == 401
    assert revoked.message.startswith("token 'other' was revoked at ")
    with pytest.raises(ValueError, match="no unrevoked token named 'other'"):
        auth.revoke_token(path, "other")
    with pytest.raises(ValueError, match="not in the future"):
        auth.add_token(path, "late", (auth.READ,), created - timedelta(seconds=1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90m", datetime(2027, 1, 1, 1, 30, tzinfo=UTC)),
        ("30d", datetime(2027, 1, 31, tzinfo=UTC)),
        ("2w", datetime(2027, 1, 15, tzinfo=UTC)),
        ("3600s", datetime(2027, 1, 1, 1, tzinfo=UTC)),
        ("2027-03-01", datetime(2027, 3, 1, tzinfo=UTC)),
        ("2027-03-01T12:00:00+02:00", datetime(2027, 3, 1, 10, tzinfo=UTC)),
        ("2027-03-01T12:00:00Z", datetime(2027, 3, 1, 12, tzinfo=UTC)),
    ],
)
def test_expiry_is_a_duration_a_date_or_a_time(text: str, expected: datetime) -> None:
    assert auth.parse_expiry(text, now=datetime(2027, 1, 1, tzinfo=UTC)) == expected


def test_an_expiry_that_is_no_time_names_the_accepted_forms() -> None:
    with pytest.raises(ValueError, match=r"--expires '30 days': expected a duration \(30d"):
        auth.parse_expiry("30 days")
