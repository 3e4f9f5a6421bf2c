"""The Kubernetes driver's reads of a key's Pods, and the creation of a generation's Pod: from
its Pod cache (drivers/kube_cache.py) where the cache can be trusted, from the apiserver where
a cache that lags behind another driver's Pods could be wrong (docs/drivers.md, "What it asks
the apiserver, per sandbox").
"""

from __future__ import annotations

from dataclasses import dataclass

from drivers.kube_api import KubeApi
from drivers.kube_cache import PodCache
from drivers.kube_objects import PodSettings, PodView, pod_manifest, pod_name, read_pod
from drivers.protocol import DriverError, LaunchSpec


@dataclass
class KeyPods:
    api: KubeApi
    cache: PodCache
    wait: float  # how long a first read waits for the cache's first listing

    async def views(self, key: str) -> tuple[list[PodView], bool]:
        """The key's Pods from the cache (True) or, when it cannot answer, a listing (False)."""
        views = await self.cache.views(key, self.wait)
        if views is not None:
            return views, True
        return await self.api.list_views(key), False

    async def since(self, key: str, version: int | None) -> list[PodView]:
        """The key's Pods as of ``version`` or later: the cache if it has caught up with it,
        else (or without a version) a listing."""
        if self.cache.live and version is not None and self.cache.version >= version:
            views = await self.cache.views(key, 0)
            if views is not None:
                return views
        return await self.api.list_views(key)

    async def generation(self, key: str, generation: int) -> PodView | None:
        """The generation's Pod: from the cache, and when the cache has none, read by name
        (it may not have seen a Pod made a moment ago by another driver)."""
        seen, cached = await self.views(key)
        views = [v for v in seen if v.info.generation == generation]
        if views:
            return views[-1]
        if not cached:
            return None
        pod = await self.api.fetch_pod(pod_name(key, generation))
        view = read_pod(pod) if pod is not None else None
        if view is None or (view.info.key, view.info.generation) != (key, generation):
            return None
        self.cache.note(view)
        return view

    async def create(self, spec: LaunchSpec, settings: PodSettings) -> tuple[PodView, bool]:
        """The generation's Pod, and whether it existed already (made by an earlier launch)."""
        manifest = pod_manifest(spec, settings)
        name = manifest["metadata"]["name"]
        created = await self.api.create("pods", manifest, exist_ok=True)
        if created is not None and (view := read_pod(created)) is not None:
            self.cache.note(view)
            return view, False
        # The name was taken: by an earlier launch of ours, or a stranger.
        existing = await self.api.fetch_pod(name)
        if existing is None:
            raise DriverError(
                f"pod {name} was taken, then removed, while it was being created", retryable=True
            )
        view = read_pod(existing)
        if view is None or view.info.generation != spec.generation:
            raise DriverError(
                f"pod name {name} is in use by a pod sandstream does not manage", retryable=False
            )
        self.cache.note(view)
        if view.terminating or (view.info.identity, view.info.sandbox_id) != (
            spec.identity,
            spec.sandbox_id,
        ):
            # Not this launch's to adopt (the cache it planned on had not shown it): retried,
            # the launch replaces it first.
            raise DriverError(
                f"pod {name} exists for another incarnation or is being removed", retryable=True
            )
        return view, True
