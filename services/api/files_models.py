"""The bodies of the files routes (services/api/routes/files.py) and their error answers."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from fastapi import Query
from pydantic import BaseModel, ConfigDict, Field

from drivers.files import MAX_PATH, FileEntry
from services.api.errors import ErrorBody

PATH_RULES: Final = (
    "a path inside the sandbox: absolute, or relative to /workspace; '.' and '..' are resolved "
    "by name ('..' of '/' is '/'); symlinks are followed inside the sandbox's own root"
)


class FileEntryView(BaseModel):
    name: str = Field(description="the last component of the path")
    path: str = Field(description="the absolute path inside the sandbox")
    type: Literal["file", "dir", "symlink", "other"]
    size: int = Field(description="bytes (a symlink: the length of its target)")
    mode: int = Field(description="permission bits, e.g. 420 (0o644)")
    mtime: float = Field(description="last modification, seconds since the epoch")

    @classmethod
    def of(cls, entry: FileEntry) -> FileEntryView:
        return cls(
            name=entry.name,
            path=entry.path,
            type=entry.type,
            size=entry.size,
            mode=entry.mode,
            mtime=entry.mtime,
        )


class FileList(BaseModel):
    entries: list[FileEntryView] = Field(description="by name")
    truncated: bool = Field(description="the directory holds more entries than answered")


SandboxFilePath = Annotated[str, Field(min_length=1, max_length=MAX_PATH, description=PATH_RULES)]


class MkdirRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: SandboxFilePath
    parents: bool = Field(default=True, description="make missing parents; an existing "
                          "directory is then no error")  # fmt: skip


class MoveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    source: SandboxFilePath
    destination: SandboxFilePath = Field(
        description="the new path (not a directory to move into): a file or an empty "
        "directory there is replaced, as rename(2) does"
    )


PathQuery = Annotated[str, Query(min_length=1, max_length=MAX_PATH, description=PATH_RULES)]

_DESCRIBED: Final = {
    400: "INVALID_ARGUMENT: a directory where a file is expected (or the reverse), a tar "
    "member that breaks the upload rules, or a path that may not be changed ('/')",
    401: "missing or invalid token",
    403: "the token lacks files:read (reads) or files:write (writes)",
    404: "NOT_FOUND: no such sandbox, or no such path in it",
    409: "FAILED_PRECONDITION: the sandbox is not Ready (its phase named) or its runtime is "
    "not running; PATH_CONFLICT: the path is on a read-only file system, the sandbox's "
    "permissions refuse it or a directory is not empty (no wait cures it); "
    "ALREADY_EXISTS: mkdir without parents of an existing path",
    411: "LENGTH_REQUIRED: a raw upload without a Content-Length",
    413: "PAYLOAD_TOO_LARGE: the upload is above files_max_upload_bytes",
    422: "INVALID_ARGUMENT: a malformed parameter or body, named",
    501: "NOT_IMPLEMENTED: this sandbox's backend (or its image) cannot do it",
    503: "UNAVAILABLE: the backend (Podman, the cluster or its node's exec) or PostgreSQL "
    "cannot be reached",
}


def file_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorBody, "description": _DESCRIBED[c]} for c in codes}
