"""One transport under both faces: a call is described once (:class:`Call`, built by the
concern modules), then sent by the sync transport (``httpx.Client``) or the async one
(``httpx.AsyncClient``); answers outside the call's ``ok`` statuses become typed errors."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sandstream_sdk.errors import AuthenticationError, UnavailableError, error_of

DEFAULT_URL = "http://127.0.0.1:8787"
# The server's default SANDSTREAM_WAKE_TIMEOUT_SECONDS: a call that wakes a suspended sandbox
# (a command, a files call) may wait that long before its own work begins, so its read
# timeout is that much longer (a server with a longer wake needs ``request_timeout`` raised).
WAKE_SECONDS = 60.0


@dataclass(frozen=True)
class Config:
    """Where the API is and the token to use: the arguments, else ``SANDSTREAM_API_URL`` and
    ``SANDSTREAM_TOKEN`` (or a file named by ``SANDSTREAM_TOKEN_FILE``), as the CLI reads them.
    ``request_timeout``: seconds for one request (not for a command's run or a stream)."""

    api_url: str = DEFAULT_URL
    token: str | None = None
    request_timeout: float = 60.0

    @classmethod
    def of(cls, api_url: str | None = None, token: str | None = None,
           request_timeout: float | None = None) -> Config:  # fmt: skip
        url = api_url or os.environ.get("SANDSTREAM_API_URL") or DEFAULT_URL
        token = token or os.environ.get("SANDSTREAM_TOKEN") or _token_file()
        if not token:
            raise AuthenticationError(
                "no API token: pass token=, or set SANDSTREAM_TOKEN or SANDSTREAM_TOKEN_FILE"
            )
        timeout = request_timeout if request_timeout is not None else cls.request_timeout
        return cls(url.rstrip("/"), token, timeout)

    def client_args(self) -> dict[str, Any]:
        return {
            "base_url": self.api_url,
            "headers": {"Authorization": f"Bearer {self.token}"},
            "timeout": self.request_timeout,
        }


def _token_file() -> str | None:
    path = os.environ.get("SANDSTREAM_TOKEN_FILE")
    return Path(path).read_text().strip() if path else None


@dataclass(frozen=True)
class Call:
    """One request: what to send, the statuses that mean success, and its read timeout
    (``None``: as long as the answer takes; ``"default"``: the config's request timeout),
    plus the server's wake bound when the call can wake a suspended sandbox (``wakes``)."""

    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    content: bytes | None = None
    ok: tuple[int, ...] = (200,)
    read_timeout: float | str | None = "default"
    wakes: bool = False

    def request_args(self, config: Config) -> dict[str, Any]:
        args: dict[str, Any] = {"params": self.params}
        if self.json is not None:
            args["json"] = self.json
        if self.content is not None:
            args["content"] = self.content
            args["headers"] = {"Content-Type": "application/octet-stream"}
        read = config.request_timeout if isinstance(self.read_timeout, str) else self.read_timeout
        if self.wakes and read is not None:
            read += WAKE_SECONDS
        if self.wakes or self.read_timeout != "default":
            args["timeout"] = httpx.Timeout(config.request_timeout, read=read)
        return args


def raise_for(call: Call, response: httpx.Response) -> None:
    """The typed error of an answer outside ``call.ok`` (the body must have been read)."""
    if response.status_code in call.ok:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    raise error_of(response.status_code, body, response.text)


def _unreachable(config: Config, exc: Exception) -> UnavailableError:
    return UnavailableError(f"cannot reach the API at {config.api_url}: {exc}")


class SseParser:
    """Server-sent events, line by line: ``feed`` returns (event, data) when one is complete."""

    def __init__(self) -> None:
        self.event, self.data = "message", []  # type: tuple[str, list[str]]

    def feed(self, line: str) -> tuple[str, Any] | None:
        if line == "":
            if not self.data:
                return None
            done = (self.event, json.loads("\n".join(self.data)))
            self.event, self.data = "message", []
            return done
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


class SyncTransport:
    """Closed, it opens a new connection pool at its next call (a killed sandbox's object,
    closed by its ``with`` block, still answers ``kill()``)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._http = httpx.Client(**config.client_args())

    @property
    def http(self) -> httpx.Client:
        if self._http.is_closed:
            self._http = httpx.Client(**self.config.client_args())
        return self._http

    def send(self, call: Call) -> httpx.Response:
        try:
            response = self.http.request(call.method, call.path, **call.request_args(self.config))
        except httpx.TransportError as exc:
            raise _unreachable(self.config, exc) from exc
        raise_for(call, response)
        return response

    @contextmanager
    def stream(self, call: Call) -> Iterator[httpx.Response]:
        try:
            with self.http.stream(call.method, call.path, **call.request_args(self.config)) as r:
                if r.status_code not in call.ok:
                    r.read()
                    raise_for(call, r)
                yield r
        except httpx.TransportError as exc:
            raise _unreachable(self.config, exc) from exc

    def close(self) -> None:
        self._http.close()


class AsyncTransport:
    """As :class:`SyncTransport`, with ``httpx.AsyncClient``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._http = httpx.AsyncClient(**config.client_args())

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http.is_closed:
            self._http = httpx.AsyncClient(**self.config.client_args())
        return self._http

    async def send(self, call: Call) -> httpx.Response:
        try:
            response = await self.http.request(
                call.method, call.path, **call.request_args(self.config)
            )
        except httpx.TransportError as exc:
            raise _unreachable(self.config, exc) from exc
        raise_for(call, response)
        return response

    @asynccontextmanager
    async def stream(self, call: Call) -> AsyncIterator[httpx.Response]:
        try:
            async with self.http.stream(
                call.method, call.path, **call.request_args(self.config)
            ) as r:
                if r.status_code not in call.ok:
                    await r.aread()
                    raise_for(call, r)
                yield r
        except httpx.TransportError as exc:
            raise _unreachable(self.config, exc) from exc

    async def close(self) -> None:
        await self._http.aclose()
