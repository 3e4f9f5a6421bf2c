"""File operations run as commands inside a runtime, through a backend's exec: stat, list,
mkdir, remove, move and an upload's final rename (which removes other generations' stale
temporary files beside it), with the image's ``stat``, ``find``, ``mkdir``, ``rm``, ``rmdir``,
``mv`` and ``sh``. A backend supplies ``_events`` (its exec);
failures are read from the tool's message (``kind_of``), and an exit of 126 or 127 (the tool
is missing) is ``unsupported``. Paths are passed as arguments, after ``--``, never spliced
into a shell script.
"""

from __future__ import annotations

import builtins
import contextlib
import posixpath
import re
import stat as stat_module
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Final

from drivers.files import (
    UPLOAD_PREFIX,
    EntryType,
    FileEntry,
    FilesError,
    first_line,
    kind_of,
)
from drivers.protocol import DriverError, ExecEvent, ExecExit

STAT_FORMAT: Final = "%f %s %Y %n"  # raw mode (hex), size, mtime, name: one line per entry
_STAT_LINE: Final = re.compile(r"^([0-9a-f]+) (\d+) (\d+) (.*)$", re.DOTALL)
MAX_ERROR_OUTPUT: Final = 64 * 1024  # the most stderr kept of a command (its message)
# A non-recursive remove: rmdir for a directory (never what a symlink points to), rm otherwise.
_REMOVE_ONE: Final = 'if [ -d "$1" ] && [ ! -L "$1" ]; then exec rmdir -- "$1"; fi; exec rm -- "$1"'
# The rename of an upload over its path (a failure removes the upload), then the removal of
# the temporary files beside it named as upload_prefix names them for an *older* generation
# than this one ($3): uploads cut off with their runtime. Never this generation's (an upload
# under way), nor a newer one's (a runtime killed at once can still run its last exec while
# its successor's Pod starts on a Kubernetes node). The sweep never fails the upload.
_REPLACE: Final = (
    'mv -f -T -- "$1" "$2" || { rc=$?; rm -f -- "$1"; exit "$rc"; }\n'
    f'for f in "${{1%/*}}"/{UPLOAD_PREFIX}g[0-9]*; do\n'
    f"  n=${{f##*/{UPLOAD_PREFIX}g}}; n=${{n%%-*}}\n"
    '  case "$n" in ""|*[!0-9]*) continue ;; esac\n'
    '  [ "$n" -lt "$3" ] || continue\n'
    '  if [ -f "$f" ] && [ ! -L "$f" ]; then rm -f -- "$f" || :; fi\n'
    "done\n"
    "exit 0"
)


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


def joined(lines: builtins.list[str], more: builtins.list[str], start: str) -> builtins.list[str]:
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


def child(line: str, start: str) -> FileEntry | None:
    match = _STAT_LINE.match(line)
    if match is None or not match.group(4).startswith(start):
        return None
    name = match.group(4)[len(start) :]
    return entry_of(line, posixpath.join(start, name), name)


class ExecFiles(ABC):
    """The exec-run half of a FileSource."""

    @abstractmethod
    def _events(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        stdin: AsyncIterator[bytes] | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """The command's output, then its exit (DriverError when it cannot run)."""

    async def _run(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        stdin: AsyncIterator[bytes] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The command's stdout as it comes; a failed exit raises FilesError from its stderr."""
        errors = bytearray()
        code: int | None = None
        stream = self._events(key, generation, command, stdin)
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

    async def _call(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        stdin: AsyncIterator[bytes] | None = None,
    ) -> bytes:
        out = bytearray()
        async for chunk in self._run(key, generation, command, stdin):
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
                lines = joined(lines, complete, start)
                if len(lines) > limit + 1:  # the directory itself, then the entries
                    more = True
                    break
        finally:
            await stream.aclose()
        if buffer:
            lines = joined(lines, [buffer], start)
        entries = [e for e in (child(line, start) for line in lines[1:]) if e is not None]
        first = entry_of(lines[0], path, "") if lines else None
        if first is not None and first.type != "dir":
            raise FilesError("not_dir", f"{path!r}: not a directory")
        entries.sort(key=lambda e: e.name)
        return entries[:limit], more or len(entries) > limit

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
        script = ["sh", "-c", _REPLACE, "sh", temporary, path, str(generation)]
        await self._call(key, generation, script)

    async def discard(self, key: str, generation: int, temporary: str) -> None:
        """Remove a failed upload's temporary file (best effort: a failure is ignored)."""
        with contextlib.suppress(FilesError):
            await self._call(key, generation, ["rm", "-f", "--", temporary])
