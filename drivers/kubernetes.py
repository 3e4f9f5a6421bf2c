"""The Kubernetes driver: one Pod per generation, a PersistentVolumeClaim per incarnation.

It talks to the API server with kubernetes-asyncio (aiohttp underneath, so nothing blocks the
event loop) and works on plain JSON dicts. This module is the driver's operations and its
watch loop; the rest is in its own modules (docs/drivers.md):

- ``kube_config``: ``KubeConfig`` and the API client it connects with;
- ``kube_api``: the API calls in the namespace (Pods, claims, Secrets, one watch request);
- ``kube_cache``: the Pod cache (one listing and watch of the namespace's sandstream Pods)
  its calls read and wait on, instead of a listing and a watch each;
- ``kube_pods``: a key's Pods as the calls read them (the cache, or the apiserver where a
  lagging cache could be wrong), and the creation of a generation's Pod;
- ``kube_waits``: waiting on one Pod until it runs or is gone, and removing it;
- ``kube_watch``: what the watch stream reports of each Pod;
- ``kube_objects``: the objects it makes and how it reads them back (pure).

- **launch** creates the claim (if a storage class is configured) and the Pod, then waits
  until it runs (or has already ended); older generations' Pods are deleted first, with their
  grace periods, and awaited (drivers/launch_precheck.py), and the rules are applied again
  once the cache has caught up with the create (it may have lagged behind another driver).
- **stop** deletes the generation's Pod with the sandbox's grace period and waits until it is
  gone; the claim stays. **delete** removes the key's Pods, then its claims.
- Calls of one key run one at a time (a lock per key); calls of different keys share nothing
  but the HTTP connection pool, which is sized so that slow stops cannot use it up.
- **watch** lists, then watches from the listing's resourceVersion with bookmarks; a broken
  connection resumes from the last version seen (after a back-off), a 410 Gone lists again.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar
from uuid import UUID

from kubernetes_asyncio import config

from drivers.kube_api import TRANSPORT_ERRORS, ApiStatusError, Gone, KubeApi, describe, retryable
from drivers.kube_cache import PodCache, version_number
from drivers.kube_config import KubeConfig, api_client, parse_node_selector, parse_tolerations
from drivers.kube_objects import ACTOR, WORKSPACE_DIES_WITH_POD, PodView, claim_manifest
from drivers.kube_pods import KeyPods
from drivers.kube_waits import Deadline, await_pod, remove_pod
from drivers.kube_watch import Reported
from drivers.launch_precheck import launch_precheck
from drivers.protocol import (
    DriverError,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
    grace_period,
    observed_state,
)
from events.backoff import Backoff

# The configuration is imported from here by its users (settings, provider-sync, tests).
__all__ = [
    "KubeConfig",
    "KubernetesDriver",
    "api_client",
    "parse_node_selector",
    "parse_tolerations",
]

log = logging.getLogger("sandstream.drivers.kubernetes")

T = TypeVar("T")


class KubernetesDriver:
    """The driver for one namespace of a Kubernetes cluster."""

    def __init__(self, cfg: KubeConfig | None = None, *, actor: str = ACTOR) -> None:
        self.cfg = cfg or KubeConfig()
        self.namespace = self.cfg.namespace
        self.actor = actor
        self._pods = self.cfg.pod_settings
        self._api = KubeApi(self.cfg)
        # The Pods as one watch shows them, for this driver's own calls (not its watch()).
        self._cache = PodCache(self._api, self.cfg.reconnect_delay, self.cfg.max_reconnect_delay)
        self._pods_of = KeyPods(self._api, self._cache, self.cfg.request_timeout)
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.listings = 0  # full listings taken by watch streams (the first, then after 410s)
        self._closed = False

    # -- the protocol ------------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        return await self._call(self._launch, spec, key=spec.key, generation=spec.generation)

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self._call(
            self._stop, key, generation, timeout, key=key, generation=generation
        )

    async def suspend(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self._call(
            self._suspend, key, generation, timeout, key=key, generation=generation
        )

    async def kill(self, key: str, generation: int) -> OpResult:
        # Not under the key's lock: it may be held by the very stop this kill is forcing.
        return await self._call(
            self._kill, key, generation, key=key, generation=generation, exclusive=False
        )

    async def delete(self, key: str, sandbox_id: UUID | None = None) -> bool:
        return await self._call(self._delete, key, sandbox_id, key=key, generation=None)

    async def incarnations(self) -> builtins.set[tuple[str, UUID]]:
        """The HoldingsDriver capability: incarnations with a Pod, a claim or a Secret."""
        return await self._call(self._api.incarnations, key=None, generation=None)

    async def get(self, key: str) -> builtins.list[RuntimeInfo]:
        views = await self._call(self._api.list_views, key, key=None, generation=None)
        return [v.info for v in views]

    async def list(self) -> builtins.list[RuntimeInfo]:
        views = await self._call(self._api.list_views, None, key=None, generation=None)
        return [v.info for v in views]

    async def watch(self) -> AsyncIterator[WatchObservation]:
        """A listing, then changes; resumed from the last resourceVersion after a break, listed
        again after a 410 Gone. Pods seen before a relisting and missing from it are reported
        removed (source="list")."""
        reported = Reported(self.actor)
        version: str | None = None
        cfg = self.cfg
        backoff = Backoff(cfg.reconnect_delay, cfg.max_reconnect_delay, log, "kubernetes watch")
        while not self._closed:
            try:
                if version is None:
                    views, version = await self._api.list_all()
                    self.listings += 1
                    for observation in reported.listed(views):
                        yield observation
                async with contextlib.aclosing(self._api.watch_pods(version)) as events:
                    async for kind, pod in events:
                        backoff.succeeded()
                        version = str(pod.get("metadata", {}).get("resourceVersion") or version)
                        if kind == "BOOKMARK":
                            continue
                        for observation in reported.observe(kind, pod):
                            yield observation
                backoff.succeeded()  # the server ended the watch: resume at once
            except Gone:
                log.info("kubernetes watch: resourceVersion %s expired; listing again", version)
                version = None
            except (*TRANSPORT_ERRORS, ApiStatusError) as exc:
                if self._closed:
                    return
                await asyncio.sleep(backoff.failed(describe(exc)))

    async def close(self) -> None:
        self._closed = True
        await self._cache.close()
        await self._api.close()

    # -- extras ------------------------------------------------------------------------------

    @property
    def connected_watchers(self) -> int:
        """Watch streams whose watch request is open: from then on no change is missed."""
        return self._api.watching

    def reconnect_watchers(self) -> None:
        """Break every open watch connection: the streams resume from their last version."""
        self._api.break_watches()

    async def claims(self, key: str) -> builtins.list[str]:
        """Names of the key's workspace claims (for tests and operators)."""
        found = await self._call(self._api.claims, key, None, key=None, generation=None)
        return [str(c["metadata"]["name"]) for c in found]

    # -- operations --------------------------------------------------------------------------

    async def _launch(self, spec: LaunchSpec) -> LaunchResult:
        seen, cached = await self._pods_of.views(spec.key)
        plan = launch_precheck(spec, seen)
        await asyncio.gather(*(self._remove_pod(v, self._grace(v)) for v in plan.replace))
        if plan.refusal is not None:
            raise plan.refusal
        if spec.generation > 1 or plan.replace:
            # The replaced generations' Secrets go with their Pods (not left to the collector);
            # a first generation has none older.
            await self._api.remove_secrets(spec.key, lambda _, g: g < spec.generation)
        current = plan.current
        if current is not None and not plan.starts:
            return LaunchResult(current.uid, spec.generation, spec.identity, False, adopted=True)
        adopted = current is not None
        if current is None:
            if self._pods.storage_class is not None:
                await self._api.create(
                    "persistentvolumeclaims", claim_manifest(spec, self._pods), exist_ok=True
                )
            if spec.secrets:
                await self._api.write_secret(spec)
            current, adopted = await self._pods_of.create(spec, self._pods)
            if spec.secrets:
                await self._api.own_secret(spec, current)
        try:
            started, _ = await await_pod(
                self._api,
                current,
                lambda v: v is None or v.info.state != "created" or v.pull_failure is not None,
                self.cfg.launch_timeout,
                self._cache,
            )
        except Deadline:
            raise not_running(current, self.cfg.launch_timeout) from None
        if started is None:
            raise DriverError(
                f"pod {current.name} was removed while it started", retryable=True, observed=None
            )
        if started.pull_failure is not None:
            unpullable(spec, started)
        if cached and not adopted:
            await self._recheck(spec, current)
        return LaunchResult(started.uid, spec.generation, spec.identity, True, adopted=adopted)

    async def _recheck(self, spec: LaunchSpec, created: PodView) -> None:
        """The launch's rules again, over the key's Pods as of after its create: the cache it
        planned on may have lagged behind a Pod another driver made just before. A newer
        generation found now removes the Pod just made (the launch was superseded); older
        ones are replaced now."""
        seen = await self._pods_of.since(spec.key, version_number(created.resource_version))
        late = launch_precheck(spec, [v for v in seen if v.uid != created.uid])
        if any(v.info.generation > spec.generation for v in seen):
            await self._remove_pod(created, 0.0)
            assert late.refusal is not None
            raise late.refusal
        if late.replace:
            await asyncio.gather(*(self._remove_pod(v, self._grace(v)) for v in late.replace))
            await self._api.remove_secrets(spec.key, lambda _, g: g < spec.generation)

    async def _stop(self, key: str, generation: int, timeout: float | None) -> OpResult:
        view = await self._pods_of.generation(key, generation)
        if view is None:
            return OpResult("already_absent")
        last = await self._remove_pod(view, self._grace(view, timeout))
        await self._api.remove_secrets(key, lambda _, g: g == generation)
        if last is None:
            return OpResult("already_absent")
        return OpResult("succeeded", view.uid, last.info.exit_code)

    async def _suspend(self, key: str, generation: int, timeout: float | None) -> OpResult:
        # A stop removes the Pod and keeps the claim (an emptyDir would die with the Pod).
        if self._pods.storage_class is None:
            raise DriverError(WORKSPACE_DIES_WITH_POD, retryable=False)
        view = await self._pods_of.generation(key, generation)
        if view is not None and view.claim is None:
            raise claimless(view)
        return await self._stop(key, generation, timeout)

    async def _kill(self, key: str, generation: int) -> OpResult:
        """Delete the generation's Pod with no grace period: the API server removes it at once
        (a kubelet then SIGKILLs its container), and a stop waiting for it returns too."""
        view = await self._pods_of.generation(key, generation)
        if view is None:
            return OpResult("already_absent")
        last = await self._remove_pod(view, 0.0)
        if last is None:
            return OpResult("already_absent")
        return OpResult("succeeded", view.uid, last.info.exit_code)

    async def _delete(self, key: str, sandbox_id: UUID | None) -> bool:
        def ours(views: builtins.list[PodView]) -> builtins.list[PodView]:
            return [v for v in views if sandbox_id in (None, v.info.sandbox_id)]

        seen, cached = await self._pods_of.views(key)
        views = ours(seen)
        if cached and not views:
            views, cached = ours(await self._api.list_views(key)), False  # absent: confirmed
        removed = await self._remove_pods(views)
        if cached:
            # Pods made meanwhile by another driver (the cache had not seen them yet).
            # Their removals, seen by the cache, came after this delete began.
            anchors = [version_number(v.resource_version) for v in removed if v is not None]
            since = max((a for a in anchors if a is not None), default=None)
            done = {v.uid for v in views}
            again = await self._pods_of.since(key, since)
            later = [v for v in ours(again) if v.uid not in done]
            views += later
            removed += await self._remove_pods(later)
        # Secrets and claims are looked for unless the Pods removed show that there are none:
        # a Pod refers to its Secret and mounts its claim.
        secrets = 0
        if not views or any(v.secret for v in views):
            secrets = await self._api.remove_secrets(key, lambda i, _: sandbox_id in (None, i))
        claims: builtins.list[dict[str, Any]] = []
        if not views or self._pods.storage_class is not None or any(v.claim for v in views):
            claims = await self._api.claims(key, sandbox_id)
        for claim in claims:
            await self._api.delete_object(
                "persistentvolumeclaims", claim["metadata"]["name"], claim["metadata"]["uid"]
            )
        deadline = time.monotonic() + self.cfg.removal_margin
        while claims and await self._api.claims(key, sandbox_id):
            # The claim goes once its protection finalizer is dropped, i.e. no Pod uses it.
            if time.monotonic() > deadline:
                raise DriverError(
                    f"workspace claims of {key} still present after the pods were removed",
                    retryable=True,
                    observed=None,
                )
            await asyncio.sleep(0.1)
        return bool(views or claims or secrets)

    async def _remove_pods(self, views: builtins.list[PodView]) -> builtins.list[PodView | None]:
        return list(await asyncio.gather(*(self._remove_pod(v, self._grace(v)) for v in views)))

    def _grace(self, view: PodView, timeout: float | None = None) -> float:
        return grace_period(timeout, view.stop_timeout, self.cfg.stop_timeout)

    async def _remove_pod(self, view: PodView, grace: float) -> PodView | None:
        return await remove_pod(self._api, view, grace, self.cfg.removal_margin, self._cache)

    # -- plumbing ----------------------------------------------------------------------------

    async def _call(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        key: str | None,
        generation: int | None,
        exclusive: bool = True,
    ) -> T:
        """Run one operation; ``exclusive`` calls with a ``key`` hold that key's lock. API and
        transport errors become DriverErrors with the backend state they left (if readable)."""
        try:
            if key is None or not exclusive:
                return await fn(*args)
            async with self._lock(key):
                return await fn(*args)
        except DriverError as exc:
            if key is not None:
                await self._add_observed(exc, key, generation)
            raise
        except (*TRANSPORT_ERRORS, ApiStatusError, config.ConfigException) as exc:
            error = DriverError(
                f"{getattr(fn, '__name__', 'call').lstrip('_')} failed: {describe(exc)}",
                retryable=retryable(exc),
            )
            if key is not None:
                await self._add_observed(error, key, generation)
            raise error from exc

    def _lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def _add_observed(self, error: DriverError, key: str, generation: int | None) -> None:
        if error.observed is not None:
            return
        try:
            views = [
                v
                for v in await self._api.list_views(key)
                if generation in (None, v.info.generation)
            ]
            if views:
                info = views[-1].info
                error.observed, error.exit_code = observed_state(info.state), info.exit_code
            elif generation is not None or not await self._api.claims(key, None):
                error.observed = "absent"
        except (*TRANSPORT_ERRORS, ApiStatusError) as exc:
            log.info("cannot observe %s after a failure: %s", key, describe(exc))


def not_running(pod: PodView, timeout: float) -> DriverError:
    """A launch whose Pod is still Pending at its timeout: retryable (it may yet be
    scheduled, or its image still be downloading)."""
    return DriverError(
        f"pod {pod.name} not running {timeout:.0f}s after its creation (unschedulable, or its "
        "image still downloading)",
        retryable=True,
        observed="created",
    )


def claimless(pod: PodView) -> DriverError:
    """The refusal to suspend a Pod that mounts no workspace claim: launched before a storage
    class was set, its workspace is an emptyDir all the same, removed with the Pod."""
    return DriverError(
        f"pod {pod.name} mounts no workspace claim (made before a storage class was set): its "
        "workspace is an emptyDir removed with the Pod, so a suspend would lose it",
        retryable=False,
        observed=observed_state(pod.info.state),
    )


def unpullable(spec: LaunchSpec, pod: PodView) -> NoReturn:
    """Fail for good a launch whose image cannot be pulled, in the kubelet's words. The Pod
    stays (Pending: the kubelet tries again now and then) until a start replaces it or a
    delete removes it: removed now, its removal would race this failure to the processor and
    could name the wrong cause ("runtime removed outside sandstream")."""
    raise DriverError(
        f"pod {pod.name} cannot pull image {spec.spec.image!r} ({pod.pull_failure})",
        retryable=False,
        observed="created",
    )
