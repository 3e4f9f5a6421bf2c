"""A Podman container's files: archives through Podman's archive API, the rest through exec.

``GET /containers/{name}/archive?path=P`` answers a tar of P and ``PUT`` extracts a tar into
the directory P (made if missing); Podman resolves P, and the symlinks on the way, inside the
container's own root, so no path leads out of it. Both are streamed with httpx over the API's
unix socket: no archive is ever whole in memory. Listing, stat, mkdir, remove, move and the
final rename of an upload run the image's ``find``, ``stat``, ``mkdir``, ``rm``, ``rmdir``
and ``mv`` (and ``sh``) inside the container through the driver's exec
(drivers/podman_exec.py); an image without them answers ``unsupported``.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import posixpath
import re
import stat as stat_module
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Final
from urllib.parse import urlparse

import httpx

from drivers.files import EntryType, FileEntry, FilesError, first_line, kind_of
from drivers.podman_exec import exec_stream
from drivers.podman_objects import container_name
from drivers.protocol import DriverError, ExecExit

API: Final = "http://podman/v4.0.0/libpod"
STAT_FORMAT: Final = "%f %s %Y %n"  # raw mode (hex), size, mtime, name: one line per entry
_STAT_LINE: Final = re.compile(r"^([0-9a-f]+) (\d+) (\d+) (.*)$", re.DOTALL)
MAX_ERROR_OUTPUT: Final = 64 * 1024  # the most stderr kept of a command (its message)
# A non-recursive remove: rmdir for a directory (never what a symlink points to), rm otherwise.
_REMOVE_ONE: Final = 'if [ -d "$1" ] && [ ! -L "$1" ]; then exec rmdir -- "$1"; fi; exec rm -- "$1"'
# The rename of an upload over its path; a failure removes the upload.
_REPLACE: Final = 'mv -f -T -- "$1" "$2" || { rc=$?; rm -f -- "$1"; exit "$rc"; }'


def _type(raw_mode: int) -> EntryType:
    if stat_module.S_ISREG(raw_mode):
        return "file"
    if stat_module.S_ISDIR(raw_mode):
        return "dir"
    if stat_module.S_ISLNK(raw_mode):
        return "symlink"
    return "other"


def entry_of(line: str, path: str, name: str) -> FileEntry | None:
    """The entry of one line of ``stat -c STAT_FORMAT`` (None when it is not one)."""
    match = _STAT_LINE.match(line)
    if match is None:
        return None
    raw = int(match.group(1), 16)
    return FileEntry(
        name=name,
        path=path,
        type=_type(raw),
        size=int(match.group(2)),
        mode=stat_module.S_IMODE(raw),
        mtime=float(match.group(3)),
    )


def _podman_message(body: bytes) -> str:
    try:
        parsed = json.loads(body)
        return str(parsed.get("message") or parsed.get("cause") or body[:300].decode())
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")


class PodmanFiles:
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

    async def _run(
        self, key: str, generation: int, command: builtins.list[str]
    ) -> AsyncGenerator[bytes, None]:
        """The command's stdout as it comes; a failed exit raises FilesError from its stderr."""
        errors = bytearray()
        code: int | None = None
        stream = exec_stream(self._base_url, container_name(key, generation), command, workdir="/")
        try:
            async for event in stream:
                if isinstance(event, ExecExit):
                    code = event.exit_code
                elif event.stream == "stdout":
                    yield event.data
                elif len(errors) < MAX_ERROR_OUTPUT:
                    errors += event.data
        except DriverError as exc:
            raise FilesError(kind_of(exc.reason), exc.reason) from exc
        finally:
            await stream.aclose()
        if code:
            message = first_line(errors.decode(errors="replace"))
            kind = kind_of(message)
            if code in (126, 127):
                kind = "unsupported"  # the image lacks the tool
            raise FilesError(kind, message or f"{command[0]} exited with {code}")

    async def _call(self, key: str, generation: int, command: builtins.list[str]) -> bytes:
        out = bytearray()
        async for chunk in self._run(key, generation, command):
            out += chunk
        return bytes(out)

    async def stat(self, key: str, generation: int, path: str) -> FileEntry:
        out = await self._call(key, generation, ["stat", "-c", STAT_FORMAT, "--", path])
        line = out.decode("utf-8", "surrogateescape").removesuffix("\n")
        entry = entry_of(line, path, posixpath.basename(path) or "/")
        if entry is None:
            raise FilesError("unavailable", f"stat {path!r}: unexpected output {line[:100]!r}")
        return entry

    async def list(
        self, key: str, generation: int, path: str, limit: int
    ) -> tuple[builtins.list[FileEntry], bool]:
        start = path if path == "/" else path + "/"  # a trailing '/' follows a symlink
        command = ["find", start, "-mindepth", "0", "-maxdepth", "1",
                   "-exec", "stat", "-c", STAT_FORMAT, "{}", "+"]  # fmt: skip
        lines: builtins.list[str] = []
        more = False
        buffer = ""
        stream = self._run(key, generation, command)
        try:
            async for chunk in stream:
                buffer += chunk.decode("utf-8", "surrogateescape")
                *complete, buffer = buffer.split("\n")
                lines = _joined(lines, complete, start)
                if len(lines) > limit + 1:  # the directory itself, then the entries
                    more = True
                    break
        finally:
            await stream.aclose()
        if buffer:
            lines = _joined(lines, [buffer], start)
        entries = [e for e in (self._child(line, start) for line in lines[1:]) if e is not None]
        first = entry_of(lines[0], path, "") if lines else None
        if first is not None and first.type != "dir":
            raise FilesError("not_dir", f"{path!r}: not a directory")
        entries.sort(key=lambda e: e.name)
        return entries[:limit], more or len(entries) > limit

    @staticmethod
    def _child(line: str, start: str) -> FileEntry | None:
        match = _STAT_LINE.match(line)
        if match is None or not match.group(4).startswith(start):
            return None
        name = match.group(4)[len(start) :]
        return entry_of(line, posixpath.join(start, name), name)

    async def mkdir(self, key: str, generation: int, path: str, parents: bool) -> None:
        await self._call(key, generation, ["mkdir", *(["-p"] if parents else []), "--", path])

    async def remove(self, key: str, generation: int, path: str, recursive: bool) -> None:
        if recursive:
            await self._call(key, generation, ["rm", "-r", "--", path])
        else:
            await self._call(key, generation, ["sh", "-c", _REMOVE_ONE, "sh", path])

    async def move(self, key: str, generation: int, source: str, destination: str) -> None:
        await self._call(key, generation, ["mv", "-T", "--", source, destination])

    async def replace(self, key: str, generation: int, temporary: str, path: str) -> None:
        await self._call(key, generation, ["sh", "-c", _REPLACE, "sh", temporary, path])

    async def discard(self, key: str, generation: int, temporary: str) -> None:
        """Remove a failed upload's temporary file (best effort: a failure is ignored)."""
        with contextlib.suppress(FilesError):
            await self._call(key, generation, ["rm", "-f", "--", temporary])

    async def close(self) -> None:
        await self._client.aclose()


def _joined(lines: builtins.list[str], more: builtins.list[str], start: str) -> builtins.list[str]:
    """``lines`` with ``more`` added; a line that does not begin an entry continues the name of
    the one before (a name holding a newline)."""
    for line in more:
        match = _STAT_LINE.match(line)
        begins = match is not None and (match.group(4).startswith(start) or not lines)
        if begins or not lines:
            lines.append(line)
        else:
            lines[-1] += "\n" + line
    return lines
