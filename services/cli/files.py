"""`sandstream sandbox cp` and `sandstream sandbox files ls|stat|mkdir|rm|mv`: a sandbox's files
through the HTTP API (docs/cli.md#files). The sandbox side of `cp` is ``NAME:PATH``, as in
`podman cp`; files and directories are streamed both ways (a directory as a tar), never whole
in memory.

Where things land, as with `cp -r`: a destination that is an existing directory receives the
source under its own name; any other destination is the new name of the source.
"""

from __future__ import annotations

import os
import posixpath
import stat as stat_module
import tarfile
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Annotated, Any, Final

import httpx
import typer
from rich.table import Table

from services.cli.client import ApiFailure, Client, client_of, fail
from services.cli.render import Output, OutputOpt, out, print_json, print_table
from services.cli.sandbox import app as sandbox_app

files_app = typer.Typer(help="List and change a sandbox's files.", no_args_is_help=True)
sandbox_app.add_typer(files_app, name="files")

CHUNK: Final = 256 * 1024
STREAM_TIMEOUT: Final = httpx.Timeout(30.0, read=None, write=None)  # a transfer may take long


def _split(spec: str) -> tuple[str, str] | None:
    """``NAME:PATH`` as (name, path); None for a local path (no colon before any slash)."""
    name, colon, path = spec.partition(":")
    if not colon or "/" in name or not name:
        return None
    return name, path or "."


def _files(name: str) -> str:
    return f"/v1/sandboxes/{name}/files"


def _remote_stat(client: Client, name: str, path: str) -> dict[str, Any] | None:
    try:
        entry: dict[str, Any] = client.request(
            "GET", _files(name) + "/stat", params={"path": path}, timeout=client.waking
        ).json()
    except ApiFailure as exc:
        # 404 for the path, not for the sandbox ("sandbox 'x' not found")
        gone = exc.message.startswith("sandbox '")
        if exc.status == 404 and exc.api_code == "NOT_FOUND" and not gone:
            return None
        raise
    return entry


@sandbox_app.command("cp")
def copy(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="a local path, or NAME:PATH", show_default=False)],
    destination: Annotated[
        str, typer.Argument(help="a local path, or NAME:PATH", show_default=False)
    ],
) -> None:
    """Copy a file or a directory into a sandbox or out of it (one side NAME:PATH)."""
    remote_source, remote_destination = _split(source), _split(destination)
    if (remote_source is None) == (remote_destination is None):
        fail("cp: exactly one side must be NAME:PATH (the sandbox's), the other a local path")
    client = client_of(ctx)
    try:
        if remote_destination is not None:
            _upload(client, Path(source), *remote_destination)
        else:
            assert remote_source is not None
            _download(client, *remote_source, Path(destination))
    except OSError as exc:
        fail(f"cp: {exc}")


# --- into the sandbox ---------------------------------------------------------------------


def _upload(client: Client, local: Path, name: str, path: str) -> None:
    if not local.exists() and not local.is_symlink():
        fail(f"cp: {local}: no such file or directory")
    target = _remote_stat(client, name, path)
    into_dir = target is not None and target["type"] == "dir"
    if local.is_dir():
        folder, top = (path, local.name) if into_dir else (posixpath.dirname(path) or ".",
                                                           posixpath.basename(path))  # fmt: skip
        _send(client, name, folder, "tar", _tar_stream(local, top))
        out.print(f"{local} -> {name}:{posixpath.join(folder, top)}")
        return
    where = posixpath.join(path, local.name) if into_dir else path
    with local.open("rb") as handle:  # httpx sends a file with its length, in chunks
        _send(client, name, where, "raw", handle)
    out.print(f"{local} -> {name}:{where}")


def _send(
    client: Client, name: str, path: str, form: str, body: IO[bytes] | Iterator[bytes]
) -> None:
    try:
        response = client.http.put(
            _files(name) + "/content",
            params={"path": path, "format": form},
            content=body,
            timeout=STREAM_TIMEOUT,
        )
    except httpx.TransportError as exc:
        fail(f"cp: the transfer broke off ({exc})")
    if response.status_code not in (200, 201):
        raise ApiFailure.of(response)


class _Pipe:
    """A write end that hands what a tarfile writes to the reading side, in chunks."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()

    def writer(self) -> IO[bytes]:
        return os.fdopen(self._write, "wb")

    def chunks(self) -> Iterator[bytes]:
        with os.fdopen(self._read, "rb") as reading:
            while chunk := reading.read(CHUNK):
                yield chunk


def _tar_stream(local: Path, top: str) -> Iterator[bytes]:
    """A tar of ``local`` (its top renamed ``top``), written by a thread as it is read: the
    pipe between them holds a chunk or so, never the whole tree. Symlinks are kept as links."""
    pipe = _Pipe()
    failure: list[BaseException] = []

    def write() -> None:
        try:
            with pipe.writer() as raw, tarfile.open(fileobj=raw, mode="w|") as archive:
                archive.add(str(local), arcname=top, recursive=True)
        except BaseException as exc:  # reported to the reading side
            failure.append(exc)

    thread = threading.Thread(target=write, name="cp-tar", daemon=True)
    thread.start()
    yield from pipe.chunks()
    thread.join()
    if failure:
        fail(f"cp: reading {local} failed ({failure[0]})")


# --- out of the sandbox -------------------------------------------------------------------


def _download(client: Client, name: str, path: str, local: Path) -> None:
    entry = _remote_stat(client, name, path)
    if entry is None:
        fail(f"cp: {name}:{path}: no such file or directory")
    into_dir = local.is_dir()
    if entry["type"] == "dir":
        top = entry["name"] if into_dir else local.name
        parent = local if into_dir else local.parent
        _receive_tree(client, name, entry["path"], parent, entry["name"], top)
        out.print(f"{name}:{entry['path']} -> {parent / top}")
        return
    target = local / entry["name"] if into_dir else local
    _receive_file(client, name, entry["path"], target)
    out.print(f"{name}:{entry['path']} -> {target}")


def _stream(client: Client, name: str, path: str, form: str) -> Any:
    return client.http.stream(
        "GET",
        _files(name) + "/content",
        params={"path": path, "format": form},
        timeout=STREAM_TIMEOUT,
    )


def _receive_file(client: Client, name: str, path: str, target: Path) -> None:
    """Into a temporary file beside ``target``, renamed over it once whole."""
    partial = target.with_name(f".{target.name}.part")
    try:
        with _stream(client, name, path, "raw") as response:
            if response.status_code != 200:
                response.read()
                raise ApiFailure.of(response)
            with partial.open("wb") as handle:
                for chunk in response.iter_raw(CHUNK):
                    handle.write(chunk)
        partial.replace(target)
    except httpx.TransportError as exc:
        fail(f"cp: the transfer broke off ({exc})")
    finally:
        partial.unlink(missing_ok=True)


class _ResponseReader:
    """A response's body as a file object read by ``tarfile`` in stream mode."""

    def __init__(self, response: httpx.Response) -> None:
        self._chunks = response.iter_raw(CHUNK)
        self._buffer = b""

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buffer) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buffer += chunk
        if size < 0:
            size = len(self._buffer)
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data


def _receive_tree(
    client: Client, name: str, path: str, parent: Path, remote_top: str, top: str
) -> None:
    """The tar of a directory, extracted as it arrives with tarfile's ``data`` filter (no
    absolute names, no '..', no links out, no devices), its top renamed ``top``."""

    def renamed(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        head, _, rest = member.name.partition("/")
        if head != remote_top:
            return None
        member = member.replace(name=posixpath.join(top, rest) if rest else top, deep=False)
        return tarfile.data_filter(member, dest)

    try:
        with _stream(client, name, path, "tar") as response:
            if response.status_code != 200:
                response.read()
                raise ApiFailure.of(response)
            reader: Any = _ResponseReader(response)
            with tarfile.open(fileobj=reader, mode="r|") as archive:
                archive.extractall(parent, filter=renamed)
    except httpx.TransportError as exc:
        fail(f"cp: the transfer broke off ({exc}); what arrived is under {parent / top}")
    except tarfile.TarError as exc:
        fail(f"cp: a bad archive from the sandbox ({exc})")


# --- files ls | stat | mkdir | rm | mv -----------------------------------------------------


def _mode(entry: dict[str, Any]) -> str:
    kind = {"dir": stat_module.S_IFDIR, "symlink": stat_module.S_IFLNK,
            "file": stat_module.S_IFREG}.get(entry["type"], 0)  # fmt: skip
    return stat_module.filemode(kind | int(entry["mode"]))


def _when(entry: dict[str, Any]) -> str:
    return datetime.fromtimestamp(float(entry["mtime"]), UTC).strftime("%Y-%m-%d %H:%M:%S")


def _show(entries: list[dict[str, Any]]) -> None:
    table = Table(box=None, pad_edge=False)
    for column in ("MODE", "SIZE", "MODIFIED (UTC)", "NAME"):
        table.add_column(column, justify="right" if column == "SIZE" else "left")
    for entry in entries:
        shown = entry["name"] + ("/" if entry["type"] == "dir" else "")
        table.add_row(_mode(entry), str(entry["size"]), _when(entry), shown)
    print_table(table)


NameArg = Annotated[str, typer.Argument(help="the sandbox", show_default=False)]
PathArg = Annotated[
    str, typer.Argument(help="a path in the sandbox (relative: to /workspace)", show_default=False)
]


@files_app.command("ls")
def list_files(
    ctx: typer.Context,
    name: NameArg,
    path: Annotated[str, typer.Argument(help="a directory (default /workspace)")] = "/workspace",
    output: OutputOpt = Output.table,
) -> None:
    """List a directory of the sandbox."""
    client = client_of(ctx)
    listed = client.request("GET", _files(name), params={"path": path}, timeout=client.waking)
    answer = listed.json()
    if output == Output.json:
        print_json(answer)
        return
    _show(answer["entries"])
    if answer["truncated"]:
        out.print("(more entries than the API lists at once: not all are shown)")


@files_app.command("stat")
def stat_file(
    ctx: typer.Context, name: NameArg, path: PathArg, output: OutputOpt = Output.table
) -> None:
    """Show one path's entry (a symlink as itself)."""
    client = client_of(ctx)
    stat = client.request(
        "GET", _files(name) + "/stat", params={"path": path}, timeout=client.waking
    )
    entry = stat.json()
    if output == Output.json:
        print_json(entry)
        return
    _show([{**entry, "name": entry["path"]}])


@files_app.command("mkdir")
def make_directory(
    ctx: typer.Context,
    name: NameArg,
    path: PathArg,
    no_parents: Annotated[
        bool, typer.Option("--no-parents", help="fail if a parent is missing or it exists")
    ] = False,
) -> None:
    """Make a directory (and its missing parents)."""
    body = {"path": path, "parents": not no_parents}
    client = client_of(ctx)
    entry = client.request(
        "POST", _files(name) + "/mkdir", json_body=body, ok=(201,), timeout=client.waking
    )
    out.print(f"made {name}:{entry.json()['path']}")


@files_app.command("rm")
def remove(
    ctx: typer.Context,
    name: NameArg,
    path: PathArg,
    recursive: Annotated[
        bool, typer.Option("--recursive", "-r", help="a directory and all in it")
    ] = False,
) -> None:
    """Remove a file, a symlink, an empty directory, or (-r) a directory and all in it."""
    params = {"path": path, "recursive": "true" if recursive else "false"}
    client = client_of(ctx)
    client.request("DELETE", _files(name), params=params, ok=(204,), timeout=client.waking)
    out.print(f"removed {name}:{path}")


@files_app.command("mv")
def move(ctx: typer.Context, name: NameArg, source: PathArg, destination: PathArg) -> None:
    """Rename a path (a file or an empty directory at the destination is replaced)."""
    body = {"source": source, "destination": destination}
    client = client_of(ctx)
    entry = client.request(
        "POST", _files(name) + "/move", json_body=body, timeout=client.waking
    ).json()
    out.print(f"moved {name}:{source} -> {name}:{entry['path']}")
