"""The provider-sync controller: keeps providers in step with a directory.

The directory has one folder per provider and one file per key, its content the value (the
layout of a mounted Kubernetes Secret: names starting with a dot, such as ``..data``, are
skipped; symbolic links are followed). The controller checks the directory every ``interval``
seconds and, when anything in it changed (or a previous reconcile failed), sends **one** update
with every provider whose values differ from the stored ones: a sandbox attached to several of
them restarts once.

It compares salted fingerprints only and persists nothing of its own, so a restarted controller
finds nothing changed, re-sends nothing and restarts no one. It never deletes a provider (a
folder that disappears leaves its provider as it was) and skips folders and files whose names
are not valid provider or key names (logged by name).

Kubernetes Secrets selected by label are a second source once the Kubernetes driver exists; not
yet available.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from aiokafka.errors import KafkaError

from projections.store import CONNECTION_ERRORS
from services.api.providers import ProviderService, Receipt
from services.common import providers
from services.common.providers import Update

log = logging.getLogger("sandstream.provider-sync")

_PROVIDER = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
Signature = tuple[tuple[str, int, int], ...]


def read_directory(root: Path) -> dict[str, dict[str, str]]:
    """provider -> key -> value, from ``root``'s folders and files."""
    found: dict[str, dict[str, str]] = {}
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        if not _PROVIDER.fullmatch(folder.name):
            log.warning("skipping folder %r: not a provider name", folder.name)
            continue
        values = {}
        for file in sorted(folder.iterdir()):
            if file.name.startswith(".") or not file.is_file():
                continue
            if not _KEY.fullmatch(file.name) or file.name.startswith(providers.RESERVED_PREFIX):
                log.warning("skipping %s/%s: not a key name, or reserved", folder.name, file.name)
                continue
            values[file.name] = file.read_text()
        found[folder.name] = values
    return found


def signature(root: Path) -> Signature:
    """What changes when any value file changes (its resolved path, mtime, size)."""
    items = []
    for path in sorted(root.glob("*/*")):
        with contextlib.suppress(OSError):
            st = path.stat()
            items.append((str(path.resolve()), st.st_mtime_ns, st.st_size))
    return tuple(items)


@dataclass
class ProviderSync:
    service: ProviderService
    directory: Path
    restart: bool = True
    interval: float = 1.0
    actor: str = "provider-sync"

    async def reconcile(self) -> Receipt | None:
        """One pass: one update of every provider that differs; None when nothing does."""
        desired = read_directory(self.directory)
        if not desired:
            return None
        vault = await self.service.vault()
        async with self.service.pool.acquire() as conn:
            stored = {
                i.name: i.fingerprints() for i in await providers.list_providers(conn, desired)
            }
        changed = [
            Update(name, values)
            for name, values in desired.items()
            if stored.get(name) != {k: vault.fingerprint(name, k, v) for k, v in values.items()}
        ]
        if not changed:
            return None
        receipt = await self.service.update(
            changed, actor=self.actor, restart=self.restart, create=None
        )
        for line in receipt.sandboxes:
            log.info("%s (%s): %s, %s", line.sandbox, ", ".join(line.providers), line.action,
                     line.reason)  # fmt: skip
        return receipt

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile on every change of the directory until ``stop``."""
        seen: Signature | None = None
        while not stop.is_set():
            current = signature(self.directory)
            if current != seen:
                try:
                    await self.reconcile()
                except (OSError, KafkaError, *CONNECTION_ERRORS) as exc:
                    log.warning("reconcile failed (will retry): %r", exc)
                else:
                    seen = current
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
