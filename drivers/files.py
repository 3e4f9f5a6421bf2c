"""A sandbox's files, read and written inside its running runtime: an optional capability of a
backend, as logs are (drivers/logs.py). Implementations: :class:`drivers.podman_files.
PodmanFiles`, :class:`RoutedFiles` for a routing driver's two backends, :class:`NoFiles`.

Paths are absolute and normalised (:func:`sandbox_path`) before they reach a source; the
runtime resolves them inside the sandbox's own root (a symlink is followed as the sandbox
would follow it, so it never leads out of the sandbox). Failures are :class:`FilesError`
with a ``kind`` the doors map to an answer.
"""

from __future__ import annotations

import builtins
import posixpath
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final, Literal, Protocol, runtime_checkable

from drivers.protocol import WORKSPACE_PATH

EntryType = Literal["file", "dir", "symlink", "other"]
ErrorKind = Literal[
    "not_found",  # no such file or directory
    "exists",  # the path exists already (mkdir without parents)
    "is_dir",  # a directory where a file was asked for
    "not_dir",  # a file where a directory was asked for (also in the middle of a path)
    "not_empty",  # a directory to remove (not recursively) that holds entries
    "read_only",  # a read-only file system (the sandbox's root)
    "denied",  # the file system's permissions refuse it (inside the sandbox)
    "invalid",  # a request the runtime cannot carry out as asked (bad archive, ...)
    "not_running",  # the runtime is gone or not running
    "unsupported",  # this backend, or the sandbox's image, cannot do it
    "unavailable",  # the backend is unreachable or failed
]
MAX_PATH: Final = 4096
UPLOAD_PREFIX: Final = ".sandstream-upload-"  # a raw upload's temporary file, beside its path


def upload_prefix(generation: int) -> str:
    """The start of the names of the temporary files that raw uploads into ``generation``'s
    runtime write (then a random part): an upload cut off with its runtime (a stop, a suspend,
    a restart) leaves one that only a runtime of another generation finds, so it is stale."""
    return f"{UPLOAD_PREFIX}g{generation}-"


class FilesError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    path: str
    type: EntryType
    size: int
    mode: int  # the permission bits (0o7777)
    mtime: float  # seconds since the epoch


def sandbox_path(path: str) -> str:
    """``path`` as the absolute, normalised path the runtime is asked for: relative paths are
    taken relative to the workspace, ``.`` and ``..`` components are resolved by name (``..``
    of ``/`` is ``/``, as in the kernel), repeated and trailing slashes dropped. Raises
    ValueError for an empty path, a NUL byte or a path longer than MAX_PATH."""
    if not path:
        raise ValueError("must not be empty")
    if "\0" in path:
        raise ValueError("must not contain a NUL byte")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise ValueError(f"longer than {MAX_PATH} bytes")
    joined = posixpath.join(WORKSPACE_PATH, path)
    normal = posixpath.normpath(joined)
    return "/" + normal.lstrip("/")  # normpath keeps a leading '//'


# The messages of errno values, as the runtime's tools (busybox, coreutils) and Podman's API
# put them (matched case-insensitively, first match wins).
_ERRNO: Final[tuple[tuple[str, ErrorKind], ...]] = (
    ("no such container", "not_running"),
    ("no container", "not_running"),
    ("is not running", "not_running"),
    ("container state improper", "not_running"),
    ("read-only file system", "read_only"),
    ("no such file or directory", "not_found"),
    ("not a directory", "not_dir"),
    ("is a directory", "is_dir"),
    ("directory not empty", "not_empty"),
    ("file exists", "exists"),
    ("permission denied", "denied"),
    ("operation not permitted", "denied"),
    ("resource busy", "denied"),
    ("invalid argument", "invalid"),
    ("executable file not found", "unsupported"),
    ("not found in $path", "unsupported"),
    ("applet not found", "unsupported"),
)


def kind_of(message: str) -> ErrorKind:
    """The kind of a failure from its message (``unavailable`` when nothing matches)."""
    lowered = message.lower()
    for text, kind in _ERRNO:
        if text in lowered:
            return kind
    return "unavailable"


def first_line(message: str, limit: int = 300) -> str:
    """A runtime's message, shortened for an answer: its first line, at most ``limit`` chars."""
    lines = message.strip().splitlines()
    return lines[0][:limit] if lines else ""


@runtime_checkable
class FileSource(Protocol):
    """A backend's access to the files of a generation's running runtime."""

    def read_tar(self, key: str, generation: int, path: str) -> AsyncIterator[bytes]:
        """A tar archive of ``path`` (a file, or a directory and all under it), streamed;
        the first chunk raises FilesError when the path or the runtime is missing."""
        ...

    async def write_tar(
        self, key: str, generation: int, path: str, archive: AsyncIterator[bytes]
    ) -> None:
        """Extract the tar stream ``archive`` into the directory ``path`` (made if missing)."""
        ...

    async def stat(self, key: str, generation: int, path: str) -> FileEntry:
        """The entry of ``path`` itself (a symlink is reported as one, not followed)."""
        ...

    async def list(
        self, key: str, generation: int, path: str, limit: int
    ) -> tuple[builtins.list[FileEntry], bool]:
        """The entries of the directory ``path`` (a symlink to one is followed), by name; at
        most ``limit`` of them, and whether there were more."""
        ...

    async def mkdir(self, key: str, generation: int, path: str, parents: bool) -> None: ...

    async def remove(self, key: str, generation: int, path: str, recursive: bool) -> None: ...

    async def move(self, key: str, generation: int, source: str, destination: str) -> None:
        """Rename ``source`` to ``destination`` (replacing a file or an empty directory
        there, as rename(2) does)."""
        ...

    async def replace(self, key: str, generation: int, temporary: str, path: str) -> None:
        """Rename the uploaded ``temporary`` over ``path`` (a file); if ``path`` is a
        directory, fail with ``is_dir`` and remove ``temporary``. Once renamed, remove the
        temporary files of other generations' uploads beside ``path`` (:func:`upload_prefix`:
        stale, their runtime went away mid-upload), never those of this generation's."""
        ...

    async def discard(self, key: str, generation: int, temporary: str) -> None:
        """Remove a failed upload's ``temporary`` file (best effort: never raises)."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RoutedFiles:
    """The files of a routing driver's sandboxes: names starting with ``prefix`` from
    ``routed``, the others from ``default`` (the rule of drivers.routing)."""

    default: FileSource
    routed: FileSource
    prefix: str

    def of(self, key: str) -> FileSource:
        return self.routed if key.startswith(self.prefix) else self.default

    async def close(self) -> None:
        await self.default.close()
        await self.routed.close()


@dataclass(frozen=True, slots=True)
class NoFiles:
    """A backend that serves no files (the fake driver, Kubernetes for now): every call says
    why."""

    reason: str

    def of(self, key: str) -> NoFiles:
        return self

    def _refuse(self) -> FilesError:
        return FilesError("unsupported", self.reason)

    def read_tar(self, key: str, generation: int, path: str) -> AsyncIterator[bytes]:
        raise self._refuse()

    async def write_tar(
        self, key: str, generation: int, path: str, archive: AsyncIterator[bytes]
    ) -> None:
        raise self._refuse()

    async def stat(self, key: str, generation: int, path: str) -> FileEntry:
        raise self._refuse()

    async def list(
        self, key: str, generation: int, path: str, limit: int
    ) -> tuple[builtins.list[FileEntry], bool]:
        raise self._refuse()

    async def mkdir(self, key: str, generation: int, path: str, parents: bool) -> None:
        raise self._refuse()

    async def remove(self, key: str, generation: int, path: str, recursive: bool) -> None:
        raise self._refuse()

    async def move(self, key: str, generation: int, source: str, destination: str) -> None:
        raise self._refuse()

    async def replace(self, key: str, generation: int, temporary: str, path: str) -> None:
        raise self._refuse()

    async def discard(self, key: str, generation: int, temporary: str) -> None:
        return None

    async def close(self) -> None:
        return None


FilesBackend = FileSource | RoutedFiles | NoFiles


def source_of(backend: FilesBackend, key: str) -> FileSource:
    """The source that serves ``key``'s files."""
    if isinstance(backend, RoutedFiles | NoFiles):
        return backend.of(key)
    return backend
