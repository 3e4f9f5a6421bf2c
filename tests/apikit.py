"""The HTTP API on the real stack for tests: an isolated environment, the control plane with a
driver (or none), and the API served by uvicorn on an ephemeral port in the test's loop.

Import it as ``import apikit`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI
from harness import Env, eventually, isolated_env

from drivers.fake import FakeDriver
from drivers.protocol import Driver
from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.server import RunningApi, Tls, start_api
from services.common.kafka_clients import kafka_client_args
from services.common.tokens import (
    AUDIT,
    PROVIDER_READ,
    PROVIDER_WRITE,
    READ,
    SCOPES,
    WRITE,
    TokenStore,
)
from services.up.control_plane import ControlPlane

ADMIN = "sst_test-admin"
READER = "sst_test-reader"
WRITER = "sst_test-writer"
AUDITOR = "sst_test-auditor"
KEEPER = "sst_test-keeper"  # provider scopes only
INSPECTOR = "sst_test-inspector"  # reads sandboxes and the audit


def tokens() -> TokenStore:
    return TokenStore.of(
        admin=(ADMIN, *(s for s in SCOPES if s != AUDIT)),
        reader=(READER, READ),
        writer=(WRITER, WRITE),
        auditor=(AUDITOR, AUDIT),
        keeper=(KEEPER, PROVIDER_READ, PROVIDER_WRITE),
        inspector=(INSPECTOR, READ, AUDIT),
    )


def unique(prefix: str = "sb") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


T = TypeVar("T")


@dataclass
class Api:
    env: Env
    url: str
    app: FastAPI
    plane: ControlPlane | None
    server: RunningApi  # the uvicorn server, in the test's event loop

    def client(self, token: str | None = ADMIN, **kwargs: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=60, **kwargs)

    async def commands_published(self) -> int:
        """Records in the commands topic (to prove that nothing was published)."""
        return len(await self.env.read_topic(self.env.settings.topic_commands))

    async def phase(self, name: str) -> str | None:
        value = await self.env.fetchval("SELECT phase FROM sandboxes WHERE key = $1", name)
        return str(value) if value is not None else None

    async def wait_phase(self, name: str, phase: str, timeout: float = 30) -> None:
        await eventually(lambda: self.phase(name), lambda p: p == phase, timeout=timeout,
                         what=f"{name} to be {phase}")  # fmt: skip


@asynccontextmanager
async def running_api(
    driver: Driver | None,
    *,
    partitions: int = 4,
    poll_interval: float = 1.0,
    publish_timeout: float | None = None,
    settings_update: dict[str, Any] | None = None,
    topic_override: str | None = None,
    tls: Tls | None = None,
    token_store: TokenStore | None = None,
    with_scheduler: bool = False,
) -> AsyncIterator[Api]:
    """The API over a fresh environment; with ``driver=None`` no processor runs at all, with
    ``with_scheduler`` the deadline scheduler runs beside the processor; with ``token_store``
    its tokens instead of the in-memory ones of ``tokens()``."""
    async with isolated_env(partitions) as env:
        if settings_update:
            env.settings = env.settings.model_copy(update=settings_update)
        plane = None
        if driver is not None:
            plane = ControlPlane(
                env.settings,
                driver,
                env.pool,
                reconcile_interval=3600,
                with_scheduler=with_scheduler,
            )
            await plane.start()
        publisher = CommandPublisher(
            kafka_client_args(env.settings, "api"),
            topic=topic_override or env.settings.topic_commands,
        )
        await publisher.__aenter__()
        extra = {} if publish_timeout is None else {"publish_timeout": publish_timeout}
        app = create_app(
            env.settings,
            env.pool,
            publisher,
            token_store or tokens(),
            poll_interval=poll_interval,
            **extra,
        )
        server = await start_api(app, "127.0.0.1", 0, access_log=False, tls=tls)
        try:
            yield Api(env, server.url, app, plane, server)
        finally:
            await server.stop()
            await publisher.__aexit__()
            if plane is not None:
                await plane.stop()


@dataclass(frozen=True)
class Event:
    event: str
    id: int | None
    data: dict[str, Any]


async def read_events(
    client: httpx.AsyncClient,
    until: Callable[[list[Event]], bool],
    *,
    params: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> list[Event]:
    """Server-sent events of /v1/watch until ``until(events)`` holds; then the stream is closed."""
    events: list[Event] = []
    async with asyncio.timeout(timeout):
        async with client.stream("GET", "/v1/watch", params=params, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            kind, event_id, data = "message", None, []
            async for line in response.aiter_lines():
                if line == "":
                    if data:
                        events.append(Event(kind, event_id, json.loads("\n".join(data))))
                        if until(events):
                            return events
                    kind, event_id, data = "message", None, []
                elif line.startswith(":"):
                    continue
                else:
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if field == "event":
                        kind = value
                    elif field == "id":
                        event_id = int(value)
                    elif field == "data":
                        data.append(value)
    return events


def rows(events: list[Event]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.event == "sandbox"]


def create_body(name: str, **spec: Any) -> dict[str, Any]:
    return {"name": name, "spec": {"image": "registry.example/agent:1", **spec}}


async def row(api: Api, name: str) -> dict[str, Any]:
    """The sandbox's view (a 200 asserted)."""
    async with api.client() as c:
        r = await c.get(f"/v1/sandboxes/{name}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def phase_is(api: Api, name: str, phase: str, generation: int) -> dict[str, Any]:
    """The view once it shows ``phase`` at ``generation`` (within 60 s)."""
    return dict(
        await eventually(
            lambda: row(api, name),
            lambda v: (v["phase"], v["generation"]) == (phase, generation),
            what=f"{name} {phase} at generation {generation}",
            timeout=60,
        )
    )


async def suspended(c: httpx.AsyncClient, name: str) -> None:
    """A sandbox ``name`` created (the image of ``create_body``), Ready, then Suspended."""

    async def phase() -> str:
        return str((await c.get(f"/v1/sandboxes/{name}")).json()["phase"])

    r = await c.post("/v1/sandboxes", json=create_body(name), params={"wait": 30})
    assert r.status_code == 201, r.text
    await eventually(phase, lambda p: p == "Ready", what=f"{name} Ready")
    r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
    assert r.status_code == 200, r.text
    await eventually(phase, lambda p: p == "Suspended", what=f"{name} Suspended")


async def during_a_held_wake(driver: FakeDriver, name: str, call: Awaitable[T], held: float) -> T:
    """``call`` (one that wakes suspended ``name``) while the resumed generation's launch is
    held ``held`` seconds: a wake that long (the point of the tests that use it). The call must
    still be waiting when the hold ends: one that gave up during the wake fails here."""
    launches = driver.block("launch", name)
    running = asyncio.ensure_future(call)
    await launches.entered(timeout=30)
    done, _ = await asyncio.wait({running}, timeout=held)
    launches.release()
    if done:
        raise AssertionError(f"the call ended during the held wake: {running.exception()!r}")
    return await running
