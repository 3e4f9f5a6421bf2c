"""A sandbox's files, read and written inside its running runtime (docs/api.md#files):
download (a file, or a tar of a file or a directory), upload (a file, or a tar extracted into
a directory), list, stat, mkdir, remove, move. Bodies are streamed both ways, never whole in
memory. Reads need ``files:read``, writes ``files:write`` (docs/security.md says why neither
comes with sandbox:read/write). The sandbox must be Ready (409 FAILED_PRECONDITION naming its
phase otherwise); a refusal about the path itself (a directory not empty, a read-only file
system, the sandbox's permissions) is 409 PATH_CONFLICT, which no wait cures.
A transfer under way checks its token every second, as watches do: once it lapses, a download
is broken off and an upload refused (401/403) with nothing of it left.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import secrets
from collections.abc import AsyncIterator
from enum import Enum
from typing import Annotated, Final, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from drivers.files import (
    FileEntry,
    FilesError,
    FileSource,
    sandbox_path,
    source_of,
    upload_prefix,
)
from drivers.protocol import WORKSPACE_PATH
from drivers.tar_stream import Data, Member, TarError, TarScanner, checked, one_member
from events.common import Phase
from services.api import readmodel
from services.api.deps import FilesReader, FilesWriter, State, denial, grant
from services.api.errors import ApiError
from services.api.files_models import (
    FileEntryView,
    FileList,
    MkdirRequest,
    MoveRequest,
    PathQuery,
    file_responses,
)
from services.api.guard import upload_too_large
from services.api.models import NamePath
from services.api.wake import woken_for_http
from services.common.tokens import FILES_READ, FILES_WRITE, RECHECK, Denied, Grant, while_granted

router = APIRouter()
log = logging.getLogger("sandstream.api.files")

TAGS: Final[list[str | Enum]] = ["files"]
_STATUS: Final = {
    "not_found": (404, "NOT_FOUND"),
    "exists": (409, "ALREADY_EXISTS"),
    "is_dir": (400, "INVALID_ARGUMENT"),
    "not_dir": (400, "INVALID_ARGUMENT"),
    "invalid": (400, "INVALID_ARGUMENT"),
    # The path's own state refuses the change: a code of its own, so that a client never
    # takes it for "the sandbox is not Ready" (FAILED_PRECONDITION), which waiting can cure.
    "not_empty": (409, "PATH_CONFLICT"),
    "read_only": (409, "PATH_CONFLICT"),
    "denied": (409, "PATH_CONFLICT"),
    "not_running": (409, "FAILED_PRECONDITION"),
    "unsupported": (501, "NOT_IMPLEMENTED"),
    "unavailable": (503, "UNAVAILABLE"),
}
# Paths no write may remove or move: the root and the workspace's mount point.
KEPT: Final = frozenset({"/", WORKSPACE_PATH})


class TooLarge(Exception):
    pass


class Lapsed(Exception):
    """The token of a transfer under way lapsed (revoked, expired, scope dropped)."""

    def __init__(self, denied: Denied, what: str) -> None:
        super().__init__(f"{what} ended: {denied.message}")
        self.denied = Denied(denied.status, str(self))


async def _granted(chunks: AsyncIterator[bytes], held: Grant, what: str) -> AsyncIterator[bytes]:
    """``chunks`` while the token holds (the one check watches use); Lapsed once it does not."""
    async with contextlib.aclosing(while_granted(chunks, held, RECHECK)) as granted:
        async for chunk in granted:
            if isinstance(chunk, Denied):
                raise Lapsed(chunk, what)
            yield chunk


def refused(exc: FilesError) -> ApiError:
    status, code = _STATUS[exc.kind]
    message = exc.message
    if exc.kind == "read_only":
        message += " (the sandbox's root file system is read-only: write under /workspace, /tmp)"
    elif exc.kind == "not_running":
        message = f"the sandbox's runtime is not running ({message})"
    return ApiError(status, code, message)


def checked_path(field: str, path: str) -> str:
    try:
        return sandbox_path(path)
    except ValueError as exc:
        raise ApiError(422, "INVALID_ARGUMENT", f"{field}: {exc}") from None


async def ready(
    state: State, name: str, actor: str, *, transfer: bool = False
) -> tuple[FileSource, str, int]:
    """The source of a Ready sandbox's files, its key and generation (404, 409, 501 else); a
    Suspended one is woken first (``services.api.wake``: 409, 504 when that fails). The caller
    checks the request first: a call refused for its own input wakes nothing. A ``transfer``
    (an upload or a download, which may outlast the idle timeout) has its use written now, as
    an exec's is, and holds the sandbox in use while its bytes move."""
    view = await readmodel.get_sandbox(state.pool, name)
    if view is None:
        raise ApiError(404, "NOT_FOUND", f"sandbox {name!r} not found")
    if state.files is None:
        raise ApiError(501, "NOT_IMPLEMENTED", "this API serves no files")
    view = await woken_for_http(state.gateway, view, actor, state.settings.wake_timeout_seconds)
    if view.phase != Phase.READY:
        raise ApiError(
            409,
            "FAILED_PRECONDITION",
            f"sandbox {name!r} is {view.phase.value}: its files are reachable only while it "
            "is Ready",
        )
    state.use.touch(view.member_key)  # a use: idle suspend counts from here
    if transfer:  # seen by the next idle scan, not only after the next flush
        await state.use.begin(view.member_key, view.spec.idle_suspend_seconds)
    return source_of(state.files, view.member_key), view.member_key, view.generation


async def _counted(request: Request, limit: int) -> AsyncIterator[bytes]:
    size = 0
    async for chunk in _granted(request.stream(), grant(request, FILES_WRITE), "upload"):
        size += len(chunk)
        if size > limit:
            raise TooLarge
        if chunk:
            yield chunk


@router.get(
    "/v1/sandboxes/{name}/files/content",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "the file's bytes (format=raw), or a tar of the path (format=tar)",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "application/x-tar": {"schema": {"type": "string", "format": "binary"}},
            },
        },
        **file_responses(400, 401, 403, 404, 409, 422, 501, 503),
    },
    summary="Download a file, or a tar of a file or directory",
    tags=TAGS,
)
async def download(
    name: NamePath,
    principal: FilesReader,
    state: State,
    request: Request,
    path: PathQuery,
    format: Annotated[
        Literal["raw", "tar"], Query(description="raw: the file's bytes; tar: a tar stream")
    ] = "raw",
) -> StreamingResponse:
    where = checked_path("query parameter 'path'", path)
    source, key, generation = await ready(state, name, principal.name, transfer=True)
    # In use while the bytes move: a download may outlast the idle timeout.
    chunks = aiter(state.use.while_using([key], source.read_tar(key, generation, where)))
    try:
        first = await anext(chunks, b"")
    except FilesError as exc:
        raise refused(exc) from exc
    held = grant(request, FILES_READ)
    if format == "tar":
        filename = posixpath.basename(where) or "root"
        return StreamingResponse(
            _whole(first, _granted(chunks, held, "download")),
            media_type="application/x-tar",
            headers={"Content-Disposition": f'attachment; filename="{_ascii(filename)}.tar"'},
        )
    scanner = TarScanner()
    try:
        events = scanner.feed(first)
        while not any(isinstance(e, Member) for e in events) and not scanner.ended:
            chunk = await anext(chunks, None)
            if chunk is None:
                break
            events += scanner.feed(chunk)
    except FilesError as exc:
        await _close(chunks)
        raise refused(exc) from exc
    except TarError as exc:
        await _close(chunks)
        raise ApiError(503, "UNAVAILABLE", f"the runtime's archive of {where!r}: {exc}") from exc
    member = next((e for e in events if isinstance(e, Member)), None)
    if member is None or member.type != "file":
        await _close(chunks)
        what = "a directory" if member and member.type == "dir" else "not a regular file"
        raise ApiError(400, "INVALID_ARGUMENT", f"{where!r}: {what} (ask format=tar)")
    after = events[events.index(member) + 1 :]
    return StreamingResponse(
        _data(member.size, after, scanner, _granted(chunks, held, "download")),
        media_type="application/octet-stream",
        headers={"Content-Length": str(member.size)},
    )


def _ascii(name: str) -> str:
    return "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name)


async def _close(chunks: AsyncIterator[bytes]) -> None:
    closing = getattr(chunks, "aclose", None)
    if closing is not None:
        await closing()


class CutShort(Exception):
    """The runtime's stream ended before the whole archive (the sandbox went away): the answer
    is broken off, so the client sees an incomplete body, never a short one that looks whole."""


async def _whole(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    scanner = TarScanner()
    try:
        scanner.feed(first)
        yield first
        async for chunk in chunks:
            scanner.feed(chunk)
            yield chunk
    except (FilesError, TarError, Lapsed) as exc:
        raise CutShort(f"archive broke off: {exc}") from exc
    finally:
        await _close(chunks)
    if not scanner.ended:
        raise CutShort("archive ended before its end marker")


async def _data(
    size: int, events: list[Member | Data], scanner: TarScanner, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    sent = 0
    try:
        while True:
            for event in events:
                if isinstance(event, Data) and sent < size:
                    piece = event.data[: size - sent]
                    sent += len(piece)
                    yield piece
            if sent >= size:
                return
            chunk = await anext(chunks, None)
            if chunk is None:
                raise CutShort(f"file broke off after {sent} of {size} bytes")
            events = scanner.feed(chunk)
    except (FilesError, TarError, Lapsed) as exc:
        raise CutShort(f"file broke off after {sent} of {size} bytes: {exc}") from exc
    finally:
        await _close(chunks)


@router.put(
    "/v1/sandboxes/{name}/files/content",
    status_code=201,
    responses={
        200: {
            "model": FileEntryView,
            "description": "replaced an existing file (raw), or "
            "extracted the tar into an existing directory",
        },
        201: {"model": FileEntryView, "description": "created the file or the directory"},
        **file_responses(400, 401, 403, 404, 409, 411, 413, 422, 501, 503),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "application/x-tar": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
    summary="Upload a file (its parents made), or a tar extracted into a directory",
    tags=TAGS,
)
async def upload(
    name: NamePath,
    principal: FilesWriter,
    state: State,
    request: Request,
    response: Response,
    path: PathQuery,
    format: Annotated[
        Literal["raw", "tar"],
        Query(description="raw: the body is the file; tar: a tar extracted into directory path"),
    ] = "raw",
) -> FileEntryView:
    where = checked_path("query parameter 'path'", path)
    if format == "raw":
        declared = _raw_refusal(request, where)
    source, key, generation = await ready(state, name, principal.name, transfer=True)
    limit = state.settings.files_max_upload_bytes
    body = _counted(request, limit)
    existed = await _existing(source, key, generation, where)
    if format == "raw" and existed is not None and existed.type == "dir":
        raise ApiError(400, "INVALID_ARGUMENT", f"{where!r}: a directory (upload a tar with "
                       "format=tar to extract into it)")  # fmt: skip
    try:
        with state.use.using(key):  # an upload may outlast the idle timeout
            if format == "tar":
                await source.write_tar(key, generation, where, checked(body))
            else:
                await _upload_file(source, key, generation, where, declared, body)
    except TooLarge:
        raise upload_too_large(limit) from None
    except Lapsed as exc:
        raise denial(exc.denied) from None
    except TarError as exc:
        raise ApiError(400, "INVALID_ARGUMENT", f"request body: {exc}") from None
    except ClientDisconnect:
        log.info("upload to %s:%s: the client left before the end of its body", name, where)
        raise ApiError(400, "INVALID_ARGUMENT", "the client left mid-upload") from None
    except FilesError as exc:
        raise refused(exc) from exc
    response.status_code = 201 if existed is None else 200
    return await _entry(source, key, generation, where)


async def _existing(source: FileSource, key: str, generation: int, path: str) -> FileEntry | None:
    try:
        return await source.stat(key, generation, path)
    except FilesError as exc:
        if exc.kind == "not_found":
            return None
        raise refused(exc) from exc


def _raw_refusal(request: Request, where: str) -> int:
    """A raw upload's declared length; refused for its own input before any wake (411 with
    no Content-Length, 400 for the root or the workspace directory itself)."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        raise ApiError(411, "LENGTH_REQUIRED", "a raw upload needs a Content-Length header "
                       "(send a tar with format=tar to stream one of unknown length)")  # fmt: skip
    if where in KEPT:
        raise ApiError(400, "INVALID_ARGUMENT", f"{where!r}: a directory (not a file path)")
    return int(declared)


async def _upload_file(
    source: FileSource,
    key: str,
    generation: int,
    where: str,
    declared: int,
    body: AsyncIterator[bytes],
) -> None:
    """The body as a file at ``where``: extracted under a temporary name beside it, then
    renamed over it, so no reader sees a part and a failed upload leaves nothing (an upload
    cut off with its runtime cannot remove its part: the name tells its generation, and the
    next upload into the folder at a later generation removes it)."""
    folder = posixpath.dirname(where)
    temporary = posixpath.join(folder, upload_prefix(generation) + secrets.token_hex(8))
    archive = one_member(posixpath.basename(temporary), declared, body)
    try:
        await source.write_tar(key, generation, folder, archive)
        await source.replace(key, generation, temporary, where)
    except FilesError as exc:
        await source.discard(key, generation, temporary)
        # The runtime names the temporary file; the caller knows only the path it asked for.
        named = exc.message.replace(temporary, where)
        named = named.replace(posixpath.basename(temporary), posixpath.basename(where))
        raise FilesError(exc.kind, named) from exc
    except BaseException:
        await source.discard(key, generation, temporary)
        raise


async def _entry(source: FileSource, key: str, generation: int, path: str) -> FileEntryView:
    try:
        return FileEntryView.of(await source.stat(key, generation, path))
    except FilesError as exc:
        raise refused(exc) from exc


@router.get(
    "/v1/sandboxes/{name}/files",
    responses=file_responses(400, 401, 403, 404, 409, 422, 501, 503),
    summary="List a directory",
    tags=TAGS,
)
async def list_files(
    name: NamePath, principal: FilesReader, state: State, path: PathQuery = WORKSPACE_PATH
) -> FileList:
    where = checked_path("query parameter 'path'", path)
    source, key, generation = await ready(state, name, principal.name)
    limit = state.settings.files_list_max_entries
    try:
        entries, more = await source.list(key, generation, where, limit)
    except FilesError as exc:
        raise refused(exc) from exc
    return FileList(entries=[FileEntryView.of(e) for e in entries], truncated=more)


@router.get(
    "/v1/sandboxes/{name}/files/stat",
    responses=file_responses(401, 403, 404, 409, 422, 501, 503),
    summary="One path's entry (a symlink as itself)",
    tags=TAGS,
)
async def stat_file(
    name: NamePath, principal: FilesReader, state: State, path: PathQuery
) -> FileEntryView:
    where = checked_path("query parameter 'path'", path)
    source, key, generation = await ready(state, name, principal.name)
    return await _entry(source, key, generation, where)


@router.post(
    "/v1/sandboxes/{name}/files/mkdir",
    status_code=201,
    responses=file_responses(400, 401, 403, 404, 409, 422, 501, 503),
    summary="Make a directory",
    tags=TAGS,
)
async def make_directory(
    name: NamePath, principal: FilesWriter, state: State, body: MkdirRequest
) -> FileEntryView:
    where = checked_path("field 'path'", body.path)
    source, key, generation = await ready(state, name, principal.name)
    try:
        await source.mkdir(key, generation, where, body.parents)
    except FilesError as exc:
        raise refused(exc) from exc
    return await _entry(source, key, generation, where)


@router.delete(
    "/v1/sandboxes/{name}/files",
    status_code=204,
    response_class=Response,
    responses=file_responses(400, 401, 403, 404, 409, 422, 501, 503),
    summary="Remove a file, a symlink, an empty directory, or (recursive) a tree",
    tags=TAGS,
)
async def remove_file(
    name: NamePath,
    principal: FilesWriter,
    state: State,
    path: PathQuery,
    recursive: Annotated[bool, Query(description="remove a directory and all in it")] = False,
) -> Response:
    where = _changeable("query parameter 'path'", path)
    source, key, generation = await ready(state, name, principal.name)
    try:
        await source.remove(key, generation, where, recursive)
    except FilesError as exc:
        raise refused(exc) from exc
    return Response(status_code=204)


def _changeable(field: str, path: str) -> str:
    where = checked_path(field, path)
    if where in KEPT:
        raise ApiError(400, "INVALID_ARGUMENT", f"{field}: {where!r} may not be removed or moved")
    return where


@router.post(
    "/v1/sandboxes/{name}/files/move",
    responses=file_responses(400, 401, 403, 404, 409, 422, 501, 503),
    summary="Move (rename) a path",
    tags=TAGS,
)
async def move_file(
    name: NamePath, principal: FilesWriter, state: State, body: MoveRequest
) -> FileEntryView:
    origin = _changeable("field 'source'", body.source)
    target = _changeable("field 'destination'", body.destination)
    source, key, generation = await ready(state, name, principal.name)
    try:
        await source.move(key, generation, origin, target)
    except FilesError as exc:
        raise refused(exc) from exc
    return await _entry(source, key, generation, target)
