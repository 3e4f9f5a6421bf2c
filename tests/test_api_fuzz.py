"""Fuzz the HTTP API from its own OpenAPI document (schemathesis): no 5xx, ever, and every
answer is one the document declares, in the declared shape.

The API runs with the whole pipeline behind it (real Kafka and PostgreSQL, the fake driver) in
a thread of its own, because schemathesis calls it synchronously. Waits and watch streams are
capped so the run stays short.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import apikit
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import SecretStr
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from drivers.fake import FakeDriver
from services.api.app import create_app
from services.common.settings import Settings

# schemathesis' own strategies trip a Hypothesis deprecation warning; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")

EXAMPLES = 25  # per operation
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


class ServerThread:
    """The API and its pipeline on an event loop in another thread."""

    def __init__(self) -> None:
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fuzz-api", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(120):
            raise RuntimeError("the API did not start within 120s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        # A credentials key, as `sandstream up` creates one: provider writes are fuzzed too.
        key = {"credentials_key": SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())}
        async with apikit.running_api(FakeDriver(), poll_interval=0.2, settings_update=key) as api:
            self.url = api.url
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)
        assert not self._thread.is_alive(), "the API thread did not stop"


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[str]:
    server = ServerThread()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def openapi_document() -> dict[str, Any]:
    """The app's own OpenAPI document (building it needs no connections)."""
    app = create_app(Settings(), None, None, apikit.tokens())  # type: ignore[arg-type]
    return app.openapi()


# (schemathesis' lazy ``from_fixture`` does not work with this pytest version, so the schema
# is built at import; the served document is checked to be the same one below.)
schema = schemathesis.openapi.from_dict(openapi_document())


@schema.auth()
class AdminToken:
    """Requests carry the admin token unless a case tests its absence (schemathesis knows)."""

    def get(self, case: Any, ctx: Any) -> str:
        return apikit.ADMIN

    def set(self, case: Any, data: str, ctx: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


def test_the_served_openapi_document_is_the_fuzzed_one(fuzz_server: str) -> None:
    served = httpx.get(f"{fuzz_server}/openapi.json", timeout=30)
    assert served.status_code == 200
    assert served.json() == openapi_document()


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same cases on every run: a failure here is never a flake
    database=None,
)
def test_the_api_never_fails_with_a_server_error(case: Any, fuzz_server: str) -> None:
    query = case.query if isinstance(case.query, dict) else None
    if query is not None:
        # Bound how long one case may take: waits for outcomes, watch streams.
        if isinstance(query.get("wait"), int | float) and not isinstance(query["wait"], bool):
            query["wait"] = min(float(query["wait"]), 0.2)
        if case.path in ("/v1/watch", "/v1/watch/events"):
            timeout = query.get("timeout")
            if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout > 0.2:
                query["timeout"] = 0.2
    response = case.call(base_url=fuzz_server, timeout=30)
    case.validate_response(response, checks=CHECKS)
