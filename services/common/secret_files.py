"""Secrets kept in files of their own (mode 0600): created once, refused when others can read
them. The PostgreSQL password and the credentials key live in such files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pydantic import SecretStr


def create_secret_file(path: Path, value: str) -> bool:
    """Write ``value`` to ``path`` with mode 0600 from the start, unless the file exists (a
    concurrent writer's value stands); True if written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(value + "\n")
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
