"""Files inside a sandbox (``/v1/sandboxes/{name}/files``) as calls, shared by both faces.
Paths are absolute inside the sandbox, or relative to its workspace directory."""

from __future__ import annotations

from typing import Any

from sandstream_sdk._transport import Call
from sandstream_sdk.models import EntryInfo


def _files(name: str, tail: str = "") -> str:
    return f"/v1/sandboxes/{name}/files{tail}"


def write_call(name: str, path: str, data: str | bytes) -> Call:
    content = data.encode() if isinstance(data, str) else bytes(data)
    return Call(
        "PUT", _files(name, "/content"), {"path": path}, content=content, ok=(200, 201), wakes=True
    )


def read_call(name: str, path: str) -> Call:
    return Call("GET", _files(name, "/content"), {"path": path}, wakes=True)


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
