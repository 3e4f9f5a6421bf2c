"""The provider-sync controller's Kubernetes source: Secrets selected by label in a namespace,
one Secret per provider (services/provider_sync/sources.py says how a Secret maps to one).

Imported only when that source is configured (it loads the Kubernetes client).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiException, CoreV1Api
from kubernetes_asyncio.config import ConfigException

from drivers.kubernetes import KubeConfig, api_client
from services.provider_sync.sources import Desired, SourceUnavailable, read_secrets


@dataclass
class KubeSecretSource:
    """The Secrets matching ``selector`` in the namespace of ``cfg``: one Secret per provider.
    Polled: a list each interval, compared by the Secrets' resource versions."""

    cfg: KubeConfig
    selector: str
    _api: Any = field(default=None, repr=False)

    async def _list(self) -> list[dict[str, Any]]:
        try:
            if self._api is None:
                self._api = await api_client(self.cfg)
            core = CoreV1Api(self._api)
            answer = await core.list_namespaced_secret(
                self.cfg.namespace,
                label_selector=self.selector,
                _request_timeout=self.cfg.request_timeout,
            )
        except (ApiException, ConfigException, aiohttp.ClientError, TimeoutError) as exc:
            # The reason only: an API error's body is not echoed (it is about Secrets).
            why = f"HTTP {exc.status} {exc.reason}" if isinstance(exc, ApiException) else repr(exc)
            raise SourceUnavailable(f"kubernetes secrets: {why}") from None
        serialized = self._api.sanitize_for_serialization(answer)
        items: list[dict[str, Any]] = serialized.get("items") or []
        return items

    async def signature(self) -> Hashable:
        return tuple(
            sorted(
                (s["metadata"]["name"], s["metadata"]["resourceVersion"])
                for s in await self._list()
            )
        )

    async def read(self) -> Desired:
        return read_secrets(await self._list())

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None
