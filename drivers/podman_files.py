"""A Podman container's files: archives through Podman's archive API, the rest through exec.

``GET /containers/{name}/archive?path=P`` answers a tar of P and ``PUT`` extracts a tar into
the directory P (made if missing); Podman resolves P, and the symlinks on the way, inside the
container's own root, so no path leads out of it. Both are streamed with httpx over the API's
unix socket: no archive is ever whole in memory. Listing, stat, mkdir, remove, move and the
final rename of an upload run inside the container through the driver's exec
(drivers/podman_exec.py), as drivers/files_exec.py says.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Final
from urllib.parse import urlparse

import httpx

from drivers.files import FilesError, kind_of
from drivers.files_exec import ExecFiles
from drivers.podman_exec import exec_stream
from drivers.podman_objects import container_name
from drivers.protocol import ExecEvent

API: Final = "http://podman/v4.0.0/libpod"


def _podman_message(body: bytes) -> str:
    try:
        parsed = json.loads(body)
        return str(parsed.get("message") or parsed.get("cause") or body[:300].decode())
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")


class PodmanFiles(ExecFiles):
    """The FileSource of the Podman driver's containers (``sandstream-<key>-g<generation>``)."""

    def __init__(self, base_url: str, *, connect_timeout: float = 10.0) -> None:
        parsed = urlparse(base_url)
        if parsed.scheme not in ("unix", "http+unix"):
            raise ValueError(f"Podman files need a unix:// socket URL, not {base_url!r}")
        self._base_url = base_url
        transport = httpx.AsyncHTTPTransport(uds=parsed.path)
        # An archive may take as long as it takes to stream: no read or write timeout.
        timeout = httpx.Timeout(connect_timeout, read=None, write=None, pool=connect_timeout)
        self._client = httpx.AsyncClient(transport=transport, timeout=timeout)

    def _url(self, key: str, generation: int) -> str:
        return f"{API}/containers/{container_name(key, generation)}/archive"

    async def read_tar(self, key: str, generation: int, path: str) -> AsyncIterator[bytes]:
        try:
            async with self._client.stream(
                "GET", self._url(key, generation), params={"path": path}
            ) as response:
                if response.status_code != 200:
                    message = _podman_message(await response.aread())
                    raise FilesError(kind_of(message), f"{path!r}: {message}")
                async for chunk in response.aiter_raw():
                    yield chunk
        except httpx.HTTPError as exc:
            raise FilesError("unavailable", f"Podman's API: {type(exc).__name__}: {exc}") from exc

    async def write_tar(
        self, key: str, generation: int, path: str, archive: AsyncIterator[bytes]
    ) -> None:
        try:
            response = await self._client.put(
                self._url(key, generation),
                params={"path": path},
                content=archive,
                headers={"Content-Type": "application/x-tar"},
            )
        except httpx.HTTPError as exc:
            raise FilesError("unavailable", f"Podman's API: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            message = _podman_message(response.content)
            raise FilesError(kind_of(message), f"{path!r}: {message}")

    def _events(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        stdin: AsyncIterator[bytes] | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        if stdin is not None:
            raise FilesError("unsupported", "the Podman driver's exec takes no input")
        return exec_stream(self._base_url, container_name(key, generation), command, workdir="/")

    async def close(self) -> None:
        await self._client.aclose()
