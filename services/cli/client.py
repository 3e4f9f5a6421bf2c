"""The API client of the CLI: connection (URL, token), requests, pages, streams, failures."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
import typer

from events.backoff import Backoff
from services.common.settings import Settings
from services.common.tokens import TokenFileError, read_token_value

EXIT_FAILED = 1
EXIT_TIMEOUT = 3
MAX_SERVER_WAIT = 60.0


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    raise CliError(message, code)


# ---------------------------------------------------------------------------------------------


# The API client


@dataclass
class Connection:
    url: str | None
    token: str | None
    token_file: Path | None


REQUEST_SECONDS = 30.0  # one request's timeout


class Client:
    def __init__(self, settings: Settings, conn: Connection, *, need_token: bool = True) -> None:
        self.url = (conn.url or settings.api_base_url).rstrip("/")
        token = conn.token
        if not token and need_token:
            path = conn.token_file or settings.admin_token_file
            hint = "Pass --token, set SANDSTREAM_TOKEN or --token-file, or run `sandstream up`"
            try:
                token = read_token_value(path)
            except OSError as exc:
                fail(f"no API token: cannot read {path} ({exc.strerror}). {hint} (it writes one).")
            except TokenFileError as exc:
                fail(f"no API token: {exc}. {hint} (it writes one).")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(
            base_url=self.url, headers=headers, timeout=REQUEST_SECONDS, verify=_verify(settings)
        )
        # A call that can wake a suspended sandbox (files; exec streams have no read timeout)
        # may wait the server's wake bound first: this one's setting, default the server's.
        self.waking = REQUEST_SECONDS + settings.wake_timeout_seconds

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Any = None,
        timeout: float | None = None,
        ok: tuple[int, ...] = (200,),
        transport_errors: bool = False,
    ) -> httpx.Response:
        """One request; ``ApiFailure`` for a status not in ``ok``. A connection failure or a
        timeout fails the command, or with ``transport_errors`` raises ``httpx.TransportError``
        for the caller to retry."""
        try:
            response = self.http.request(
                method,
                path,
                json=json_body,
                params=params,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as exc:
            if transport_errors:
                raise
            fail(f"cannot reach the API at {self.url} ({exc}); is `sandstream up` running?")
        if response.status_code not in ok:
            raise ApiFailure.of(response)
        return response

    def retried(self, send: Callable[[], httpx.Response], deadline: float) -> httpx.Response:
        """``send``'s answer; a send that times out, cannot connect or gets a 503 is sent
        again (the caller's request is the same each time, its idempotency key included, so
        the API answers a repeat with the first outcome), with back-off, until ``deadline``
        (``time.monotonic``). ``send`` passes ``transport_errors=True`` to ``request``."""
        backoff = Backoff(0.5, 5.0)
        while True:
            try:
                return send()
            except (httpx.TransportError, ApiFailure) as exc:
                if isinstance(exc, ApiFailure) and exc.status != 503:
                    raise
                delay = backoff.next()
                if time.monotonic() + delay >= deadline:
                    if isinstance(exc, ApiFailure):
                        raise
                    fail(f"cannot reach the API at {self.url} ({exc}); is `sandstream up` running?")
                time.sleep(delay)  # back-off before sending the same request again

    def pages(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The items of a paginated GET, following ``next_page_token`` to the end."""
        params = dict(params)
        while True:
            page = self.request("GET", path, params=params).json()
            yield from page["items"]
            if not page.get("next_page_token"):
                return
            params["page_token"] = page["next_page_token"]

    def json_lines(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The objects of a JSON Lines answer as they arrive (no read timeout: a followed
        stream may idle)."""
        try:
            with self.http.stream(
                "GET", path, params=params, timeout=httpx.Timeout(30.0, read=None)
            ) as response:
                if response.status_code != 200:
                    response.read()
                    raise ApiFailure.of(response)
                for line in response.iter_lines():
                    if line:
                        yield json.loads(line)
        except httpx.TransportError as exc:
            raise StreamBroken(str(exc)) from exc

    def events(
        self, params: dict[str, Any], read_timeout: float
    ) -> Iterator[tuple[str, int | None, dict[str, Any]]]:
        """Server-sent events of /v1/watch: (event, id, data)."""
        return self.sse("GET", "/v1/watch", params=params, read_timeout=read_timeout)

    def sse(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any],
        read_timeout: float | None,
        json_body: Any = None,
    ) -> Iterator[tuple[str, int | None, dict[str, Any]]]:
        """A server-sent events answer: (event, id, data) as they arrive; ``read_timeout``
        None: the stream may idle for as long as it likes."""
        try:
            with self.http.stream(
                method,
                path,
                params=params,
                json=json_body,
                timeout=httpx.Timeout(30.0, read=read_timeout),
            ) as response:
                if response.status_code != 200:
                    response.read()
                    raise ApiFailure.of(response)
                event, event_id = "message", None
                data: list[str] = []
                for line in response.iter_lines():
                    if not line:
                        if data:
                            yield event, event_id, json.loads("\n".join(data))
                        event, event_id, data = "message", None, []
                        continue
                    if line.startswith(":"):
                        continue
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if field == "event":
                        event = value
                    elif field == "id":
                        event_id = int(value) if value.isdigit() else None
                    elif field == "data":
                        data.append(value)
        except httpx.TransportError as exc:
            raise StreamBroken(str(exc)) from exc


def _verify(settings: Settings) -> ssl.SSLContext | bool:
    """How an https API's certificate is checked: against api_ca_file when set (a private CA,
    a self-signed certificate), else against the system's CAs."""
    if settings.api_ca_file is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(settings.api_ca_file))
    except (OSError, ssl.SSLError) as exc:
        fail(f"cannot use the CA file {settings.api_ca_file}: {exc}")


class StreamBroken(Exception):
    pass


class ApiFailure(CliError):
    def __init__(self, status: int, code: str, message: str, body: Any) -> None:
        super().__init__(message)
        self.status = status
        self.api_code = code
        self.body = body

    @classmethod
    def of(cls, response: httpx.Response) -> ApiFailure:
        try:
            body = response.json()
            code, message = str(body["code"]), str(body["message"])
        except (ValueError, KeyError, TypeError):
            body = None
            code, message = "HTTP_" + str(response.status_code), response.text[:500]
        return cls(response.status_code, code, message, body)


# ---------------------------------------------------------------------------------------------


def settings_of(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj
    assert isinstance(obj, dict)
    settings = obj["settings"]
    assert isinstance(settings, Settings)
    return settings


def client_of(ctx: typer.Context, *, need_token: bool = True) -> Client:
    obj = ctx.find_root().obj
    assert isinstance(obj, dict)
    return Client(obj["settings"], obj["connection"], need_token=need_token)
