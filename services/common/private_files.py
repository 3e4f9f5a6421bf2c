"""Files only their owner may read: secrets sandstream writes (keys, passwords) and reads back."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_private(path: Path, missing: str, error: type[Exception]) -> str:
    """The text of ``path``; ``error`` when it is missing (saying ``missing``) or readable by
    group or others."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError as exc:
        raise error(f"{path}: {missing}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise error(f"{path}: readable by others (chmod 600 it)")
    return path.read_text()


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, readable by its owner only from the first byte on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    partial.replace(path)
