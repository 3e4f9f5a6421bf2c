"""Files inside a sandbox (``/v1/sandboxes/{name}/files``) as calls, shared by both faces.
Paths are absolute inside the sandbox, or relative to its workspace directory. A download
(``read_stream``, ``download``) hands the body on in chunks as it arrives: what it holds at
once is a chunk and httpx's read buffer, whatever the file's size."""

from __future__ import annotations

import os
import posixpath
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import httpx

from sandstream_sdk._transport import Call
from sandstream_sdk.errors import UnavailableError
from sandstream_sdk.models import EntryInfo

# A download's chunk (the CLI's ``cp`` reads in chunks of the same size).
CHUNK_SIZE: Final = 256 * 1024


def _files(name: str, tail: str = "") -> str:
    return f"/v1/sandboxes/{name}/files{tail}"


def write_call(name: str, path: str, data: str | bytes) -> Call:
    content = data.encode() if isinstance(data, str) else bytes(data)
    return Call(
        "PUT", _files(name, "/content"), {"path": path}, content=content, ok=(200, 201), wakes=True
    )


def read_call(name: str, path: str) -> Call:
    return Call("GET", _files(name, "/content"), {"path": path}, wakes=True)


def stream_call(name: str, path: str, chunk_size: int) -> Call:
    """The download as :func:`read_call` (its wake, its read timeout: here the longest wait
    for the answer's head or for the next bytes), for a chunk size checked first."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: a positive number of bytes, not {chunk_size!r}")
    return read_call(name, path)


def list_call(name: str, path: str) -> Call:
    return Call("GET", _files(name), {"path": path}, wakes=True)


def stat_call(name: str, path: str) -> Call:
    return Call("GET", _files(name, "/stat"), {"path": path}, wakes=True)


def mkdir_call(name: str, path: str) -> Call:
    return Call("POST", _files(name, "/mkdir"), json={"path": path, "parents": True},
                ok=(200, 201), wakes=True)  # fmt: skip


def remove_call(name: str, path: str) -> Call:
    """A file, or a directory with all in it (as E2B's ``remove``)."""
    return Call(
        "DELETE", _files(name), {"path": path, "recursive": "true"}, ok=(200, 204), wakes=True
    )


def move_call(name: str, source: str, destination: str) -> Call:
    body = {"source": source, "destination": destination}
    return Call("POST", _files(name, "/move"), json=body, wakes=True)


def entry_of(body: Any) -> EntryInfo:
    return EntryInfo.model_validate(body)


def entries_of(body: Any) -> list[EntryInfo]:
    return [EntryInfo.model_validate(e) for e in body["entries"]]


def decoded(data: bytes, format: str) -> str | bytes:
    if format == "bytes":
        return data
    if format == "text":
        return data.decode()
    raise ValueError(f"format: 'text' or 'bytes', not {format!r}")


def _size_of(response: httpx.Response) -> int | None:
    length = response.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


def _broken(path: str, received: int, size: int | None, exc: Exception) -> UnavailableError:
    """A body broken off after its head: the sandbox went away, or the token lapsed (the API
    breaks a download off then: it cannot answer a status any more)."""
    whole = f" of {size}" if size is not None else ""
    return UnavailableError(f"the download of {path!r} broke off after {received}{whole} "
                            f"bytes: {exc}")  # fmt: skip


class FileChunks:
    """A file's bytes as they arrive, ``chunk_size`` at a time (the last chunk shorter).
    ``size``: the file's length, as the API announced it; ``received``: the bytes handed on
    so far. A body broken off midway raises UnavailableError, never a short end."""

    def __init__(self, response: httpx.Response, path: str, chunk_size: int) -> None:
        self._chunks = response.iter_bytes(chunk_size)
        self._path = path
        self.size = _size_of(response)
        self.received = 0

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            chunk = next(self._chunks)
        except httpx.TransportError as exc:
            raise _broken(self._path, self.received, self.size, exc) from exc
        self.received += len(chunk)
        return chunk


class AsyncFileChunks:
    """As :class:`FileChunks`, iterated with ``async for``."""

    def __init__(self, response: httpx.Response, path: str, chunk_size: int) -> None:
        self._chunks = response.aiter_bytes(chunk_size)
        self._path = path
        self.size = _size_of(response)
        self.received = 0

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await anext(self._chunks)
        except httpx.TransportError as exc:
            raise _broken(self._path, self.received, self.size, exc) from exc
        self.received += len(chunk)
        return chunk


def landing(path: str, local_path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Where a download of ``path`` lands, and the partial file it is written to first
    (``.NAME.part`` beside it, as the CLI's ``cp`` does): an existing directory receives the
    file under its own name."""
    target = Path(local_path)
    if target.is_dir():
        target = target / posixpath.basename(path.rstrip("/"))
    return target, target.with_name(f".{target.name}.part")
