"""The provider-sync controller: keeps providers in step with an outside source
(services/provider_sync/sources.py: a directory, or Kubernetes Secrets selected by label).

The controller checks the source every ``interval`` seconds and, when anything in it changed
(or a previous reconcile failed), sends **one** update with every provider whose values differ
from the stored ones: a sandbox attached to several of them restarts once.

It compares salted fingerprints only and persists nothing of its own, so a restarted controller
finds nothing changed, re-sends nothing and restarts no one. It never deletes a provider (one
that disappears from the source is left as it was), and a key whose value cannot be read (a
file caught half-written) keeps its stored value: it is reported, never taken as removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

from aiokafka.errors import KafkaError

from projections.store import CONNECTION_ERRORS
from services.api.providers import ProviderService, Receipt
from services.common import metrics, providers
from services.common.providers import Update
from services.common.settings import Settings
from services.provider_sync.sources import SOURCE_ERRORS, DirectorySource, Source

log = logging.getLogger("sandstream.provider-sync")


def sync_source(
    settings: Settings,
    directory: Path | None = None,
    selector: str | None = None,
    namespace: str | None = None,
) -> Source | None:
    """The source the arguments (else the settings) name: a directory or Kubernetes Secrets
    selected by label; None when neither is set. ValueError when both are."""
    directory = directory or settings.provider_sync_dir
    selector = selector or settings.provider_sync_kube_selector
    if directory is not None and selector:
        raise ValueError("provider sync: a directory or a Kubernetes label selector, not both")
    if directory is not None:
        return DirectorySource(directory)
    if not selector:
        return None
    from drivers.kubernetes import KubeConfig
    from services.provider_sync.kube_secrets import KubeSecretSource

    cfg = KubeConfig(
        namespace=namespace or settings.provider_sync_kube_namespace or settings.kube_namespace,
        kubeconfig=settings.kube_config,
        context=settings.kube_context,
    )
    return KubeSecretSource(cfg, selector)


def update_of(name: str, found: dict[str, str | None]) -> Update:
    """The update of provider ``name`` to what the source holds: the keys it could not read
    keep their stored values (never removed, never rotated)."""
    values = {k: v for k, v in found.items() if v is not None}
    return Update(name, values, keep=frozenset(k for k, v in found.items() if v is None))


@dataclass
class ProviderSync:
    service: ProviderService
    source: Source
    restart: bool = True
    interval: float = 1.0
    actor: str = "provider-sync"

    async def reconcile(self) -> Receipt | None:
        """One pass: one update of every provider that differs; None when nothing does."""
        desired = await self.source.read()
        metrics.PROVIDER_SYNC_UNREADABLE.set(
            sum(v is None for found in desired.values() for v in found.values())
        )
        if not desired:
            return None
        vault = await self.service.vault()
        async with self.service.pool.acquire() as conn:
            stored = {
                i.name: i.fingerprints() for i in await providers.list_providers(conn, desired)
            }
        changed = []
        for name, found in desired.items():
            update = update_of(name, found)
            before = stored.get(name)
            after = {k: vault.fingerprint(name, k, v) for k, v in update.values.items()}
            after |= {k: before[k] for k in update.keep if before and k in before}
            if before != after:
                changed.append(update)
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
        """Reconcile on every change of the source until ``stop``; then close the source. A
        change is acted on once the source kept it for one interval: a value file still being
        written (its size or time still moving) is not read half-way."""
        seen: Hashable | None = None
        settling: Hashable | None = None
        try:
            while not stop.is_set():
                try:
                    current = await self.source.signature()
                    if current != seen and current == settling:
                        await self.reconcile()
                        seen = current
                    settling = current
                except (KafkaError, *CONNECTION_ERRORS, *SOURCE_ERRORS) as exc:
                    log.warning("reconcile failed (will retry): %r", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
        finally:
            await self.source.close()
