"""Secrets kept in files of their own (mode 0600): created once, refused when others can read
them. The PostgreSQL password and the credentials key live in such files."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from pydantic import SecretStr


def create_secret_file(path: Path, value: str) -> bool:
    """Write ``value`` to ``path`` with mode 0600 from the start, unless the file exists (a
    concurrent writer's value stands); True if written. The file appears whole: it is written
    aside and linked into place, so a reader never sees it half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _written_aside(path, value + "\n")
    try:
        os.link(partial, path)  # atomic, and fails if the file exists
    except FileExistsError:
        return False
    finally:
        os.unlink(partial)
    _sync_directory(path.parent)
    return True


def read_secret_file(path: Path) -> SecretStr | None:
    """The secret in ``path`` (None when there is no such file); ValueError when the file is
    readable by group or others."""
    try:
        check_private(path)
        return SecretStr(path.read_text(encoding="utf-8").strip())
    except FileNotFoundError:
        return None


def check_private(path: Path) -> None:
    """ValueError when ``path`` is accessible by group or others; OSError when it is missing."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ValueError(
            f"{path} is accessible by other users (mode {mode:04o}); run: chmod 600 {path}"
        )


def replace_secret_file(path: Path, value: str) -> None:
    """Replace ``path`` with ``value``, mode 0600 from the first byte on: written aside (and
    flushed to disk), then renamed over it, so a reader sees the old file or the new one,
    never a part of either (nor, after a crash, an empty one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _written_aside(path, value)
    try:
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise
    _sync_directory(path.parent)


def _written_aside(path: Path, value: str) -> str:
    """A new file beside ``path`` (mode 0600 from its creation) holding ``value``, on disk."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(value)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        os.unlink(partial)
        raise
    return partial


def _sync_directory(directory: Path) -> None:
    """Flush a directory's entries (a rename or link in it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
