"""A container's log from the Podman API, read on the event loop (no thread per reader).

``GET /containers/{name}/logs?stdout&stderr&timestamps`` answers the container's output as
multiplexed frames (an 8-byte header: stream, three zero bytes, big-endian length), each frame
a line prefixed with its RFC 3339 time; ``follow`` keeps the response open until the container
stops. The socket is Podman's REST API (the driver's ``unix://`` URL), spoken with httpx.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Final, Literal
from urllib.parse import urlparse

import httpx

from drivers.logs import LogLine, LogsUnavailable
from drivers.podman import container_name

_HEADER: Final = struct.Struct(">BxxxL")
_STREAMS: Final[dict[int, Literal["stdout", "stderr"]]] = {1: "stdout", 2: "stderr"}
API: Final = "http://podman/v4.0.0/libpod"


def parse_line(stream: Literal["stdout", "stderr"], frame: bytes) -> LogLine:
    """A frame's line: ``<RFC 3339 time> <text>`` (the time as Podman wrote it)."""
    stamp, _, text = frame.partition(b" ")
    try:
        at = datetime.fromisoformat(stamp.decode().replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        at, text = datetime.now(UTC), frame
    return LogLine(at, stream, text.decode(errors="replace").removesuffix("\n"))


def frames(buffer: bytearray) -> list[LogLine]:
    """The complete frames at the start of ``buffer`` (consumed); a partial one stays."""
    lines = []
    while len(buffer) >= _HEADER.size:
        kind, length = _HEADER.unpack_from(buffer)
        if len(buffer) < _HEADER.size + length:
            break
        frame = bytes(buffer[_HEADER.size : _HEADER.size + length])
        del buffer[: _HEADER.size + length]
        stream = _STREAMS.get(kind)
        if stream is not None:
            lines.append(parse_line(stream, frame))
    return lines


class PodmanLogs:
    """The LogSource of the Podman driver's containers (``sandstream-<key>-g<generation>``)."""

    def __init__(self, base_url: str, *, connect_timeout: float = 10.0) -> None:
        parsed = urlparse(base_url)
        if parsed.scheme not in ("unix", "http+unix"):
            raise ValueError(f"Podman logs need a unix:// socket URL, not {base_url!r}")
        transport = httpx.AsyncHTTPTransport(uds=parsed.path)
        timeout = httpx.Timeout(connect_timeout, read=None)  # a followed log may idle
        self._client = httpx.AsyncClient(transport=transport, timeout=timeout)

    async def read(
        self,
        key: str,
        generation: int,
        *,
        tail: int | None = None,
        since: datetime | None = None,
        follow: bool = False,
    ) -> AsyncIterator[LogLine]:
        params: dict[str, str | int] = {
            "stdout": "true",
            "stderr": "true",
            "timestamps": "true",
            "follow": "true" if follow else "false",
            "tail": "all" if tail is None else tail,
        }
        if since is not None:
            params["since"] = int(since.timestamp())
        url = f"{API}/containers/{container_name(key, generation)}/logs"
        try:
            async with self._client.stream("GET", url, params=params) as response:
                if response.status_code == 404:
                    return  # no runtime of that generation: no lines
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")[:200]
                    raise LogsUnavailable(f"Podman answered {response.status_code}: {body}")
                buffer = bytearray()
                async for chunk in response.aiter_raw():
                    buffer += chunk
                    for line in frames(buffer):
                        yield line
        except httpx.HTTPError as exc:
            raise LogsUnavailable(f"Podman's API: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._client.aclose()
