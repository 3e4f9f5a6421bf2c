"""A container's log from the Podman API, read on the event loop (no thread per reader).

``GET /containers/{name}/logs?stdout&stderr&timestamps`` answers the container's output as
multiplexed frames (an 8-byte header: stream, three zero bytes, big-endian length), each frame
a line, or a part of one (``Frames`` joins them), prefixed with its RFC 3339 time; ``follow``
keeps the response open until the container stops. The socket is Podman's REST API (the
driver's ``unix://`` URL), spoken with httpx.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Final, Literal
from urllib.parse import urlparse

import httpx

from drivers.logs import LogLine, LogsUnavailable, backend_since, backend_tail
from drivers.podman import container_name

_HEADER: Final = struct.Struct(">BxxxL")
_STREAMS: Final[dict[int, Literal["stdout", "stderr"]]] = {1: "stdout", 2: "stderr"}
API: Final = "http://podman/v4.0.0/libpod"


def _stamped(frame: bytes) -> tuple[datetime, bytes]:
    stamp, _, text = frame.partition(b" ")
    try:
        return datetime.fromisoformat(stamp.decode().replace("Z", "+00:00")).astimezone(UTC), text
    except ValueError:
        return datetime.now(UTC), frame


class Frames:
    """The lines of a log stream's frames, as the bytes arrive. Podman keeps a line it read in
    parts (its monitor reads the output in blocks, which may end mid-line) as partial entries,
    and its API ends the frame of a whole line (or a line's last part) with a newline and the
    frame of any other part without one: the parts are joined into one line here, with the
    time of its first part. A part still waiting for the rest when the stream ends is a line
    of its own (``rest``)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._parts: dict[Literal["stdout", "stderr"], tuple[datetime, bytes]] = {}

    def feed(self, chunk: bytes) -> list[LogLine]:
        """The lines whose frames are complete once ``chunk`` is added."""
        self._buffer += chunk
        buffer, lines = self._buffer, []
        while len(buffer) >= _HEADER.size:
            kind, length = _HEADER.unpack_from(buffer)
            if len(buffer) < _HEADER.size + length:
                break
            frame = bytes(buffer[_HEADER.size : _HEADER.size + length])
            del buffer[: _HEADER.size + length]
            stream = _STREAMS.get(kind)
            if stream is None:
                continue
            at, text = _stamped(frame)
            if stream in self._parts:
                first, before = self._parts.pop(stream)
                at, text = first, before + text
            if text.endswith(b"\n"):
                lines.append(LogLine(at, stream, text[:-1].decode(errors="replace")))
            else:
                self._parts[stream] = (at, text)
        return lines

    def rest(self) -> list[LogLine]:
        """The parts that never got their end, each as a line (oldest first)."""
        parts = sorted(self._parts.items(), key=lambda part: part[1][0])
        self._parts.clear()
        return [LogLine(at, stream, text.decode(errors="replace")) for stream, (at, text) in parts]


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
        tail, since = backend_tail(tail), backend_since(since)
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
                lines = Frames()
                async for chunk in response.aiter_raw():
                    for line in lines.feed(chunk):
                        yield line
                for line in lines.rest():
                    yield line
        except httpx.HTTPError as exc:
            raise LogsUnavailable(f"Podman's API: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._client.aclose()
