"""Where the provider-sync controller reads the desired values: a directory, or Kubernetes
Secrets selected by label. Each source answers two questions: a cheap ``signature`` that
changes whenever any value may have changed, and ``read``, every provider's keys and values.

Both apply the same rules to what they find: names that are not valid provider or key names,
and key names under the reserved prefix, are skipped and logged by name. A value that cannot be
read (not UTF-8 text, as a file caught half-written may be, or a file that cannot be opened) is
``None``: the key is there, its stored value is kept (logged by name, never a value).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.common import providers

log = logging.getLogger("sandstream.provider-sync")

# provider -> key -> value; None: the key is there but its value could not be read (keep it)
Desired = dict[str, dict[str, str | None]]

_PROVIDER = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
# The Secret annotation naming its provider; without it the provider is the Secret's name.
PROVIDER_ANNOTATION = "sandstream.io/provider"


class Source(Protocol):
    async def signature(self) -> Hashable: ...

    async def read(self) -> Desired: ...

    async def close(self) -> None: ...


class SourceUnavailable(Exception):
    """The source cannot be read right now (the controller tries again next interval)."""


SOURCE_ERRORS: tuple[type[Exception], ...] = (OSError, SourceUnavailable)


def valid_provider(name: str, where: str) -> bool:
    if _PROVIDER.fullmatch(name):
        return True
    log.warning("skipping %s %r: not a provider name", where, name)
    return False


def valid_key(provider: str, key: str) -> bool:
    if _KEY.fullmatch(key) and not key.startswith(providers.RESERVED_PREFIX):
        return True
    log.warning("skipping %s/%s: not a key name, or reserved", provider, key)
    return False


def read_directory(root: Path) -> Desired:
    """provider -> key -> value, from ``root``'s folders and files."""
    found: Desired = {}
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        if not valid_provider(folder.name, "folder"):
            continue
        values: dict[str, str | None] = {}
        for file in sorted(folder.iterdir()):
            # A dangling link is a value file whose target is being replaced (read: kept).
            if file.name.startswith(".") or not (file.is_file() or file.is_symlink()):
                continue
            if valid_key(folder.name, file.name):
                values[file.name] = read_value(file)
        found[folder.name] = values
    return found


def read_value(file: Path) -> str | None:
    """The text of a value file; None (logged by name, never the bytes) when it is not UTF-8
    or cannot be read: its stored value is kept."""
    try:
        return file.read_bytes().decode()
    except UnicodeDecodeError:
        unreadable(file.parent.name, file.name, "not UTF-8 text")
    except OSError as exc:  # unreadable, or gone since the listing (the next pass sees that)
        unreadable(file.parent.name, file.name, exc.strerror or type(exc).__name__)
    return None


def unreadable(provider: str, key: str, why: str) -> None:
    log.warning("keeping the stored value of %s/%s: its value cannot be read (%s)",
                provider, key, why)  # fmt: skip


@dataclass(frozen=True)
class DirectorySource:
    """One folder per provider, one file per key whose content is the value (the layout of a
    mounted Kubernetes Secret: names starting with a dot, such as ``..data``, are skipped;
    symbolic links are followed)."""

    root: Path

    async def signature(self) -> Hashable:
        """What changes when any value file changes (its resolved path, mtime, size)."""
        items = []
        for path in sorted(self.root.glob("*/*")):
            with contextlib.suppress(OSError):
                st = path.stat()
                items.append((str(path.resolve()), st.st_mtime_ns, st.st_size))
        return tuple(items)

    async def read(self) -> Desired:
        return await asyncio.to_thread(read_directory, self.root)

    async def close(self) -> None:
        pass


def secret_provider(secret: Mapping[str, Any]) -> tuple[str, dict[str, str | None]] | None:
    """(provider, key -> value) of one Secret: the provider is its ``sandstream.io/provider``
    annotation, else its name; the keys are its data keys. None when the name is not valid."""
    meta = secret.get("metadata") or {}
    name = str((meta.get("annotations") or {}).get(PROVIDER_ANNOTATION) or meta.get("name", ""))
    if not valid_provider(name, f"secret {meta.get('name')!r} of provider"):
        return None
    values: dict[str, str | None] = {}
    for key, encoded in sorted((secret.get("data") or {}).items()):
        if not valid_key(name, key):
            continue
        try:
            values[key] = base64.b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            unreadable(name, key, "not UTF-8 text")
            values[key] = None
    return name, values


def read_secrets(items: Sequence[Mapping[str, Any]]) -> Desired:
    """provider -> key -> value from the selected Secrets. Two Secrets naming one provider are
    ambiguous: both are skipped (logged), rather than one silently winning."""
    found: Desired = {}
    seen: dict[str, int] = {}
    for secret in items:
        parsed = secret_provider(secret)
        if parsed is None:
            continue
        name, values = parsed
        seen[name] = seen.get(name, 0) + 1
        found[name] = values
    for name, count in seen.items():
        if count > 1:
            log.warning("skipping provider %r: %d selected Secrets name it", name, count)
            del found[name]
    return found
