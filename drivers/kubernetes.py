"""The Kubernetes driver: one Pod per generation, a PersistentVolumeClaim per incarnation.

It talks to the API server with kubernetes-asyncio (aiohttp underneath, so nothing blocks the
event loop) and works on plain JSON dicts; the objects it makes and how it reads them back
are in drivers/kube_objects.py, the mapping in docs/drivers.md.

- **launch** creates the claim (if a storage class is configured) and the Pod, then waits on a
  watch of that one Pod until it runs (or has already ended); older generations' Pods are
  deleted first, with their grace periods, and awaited.
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
import json
import logging
import math
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, TypeVar, cast
from uuid import UUID

import aiohttp
from kubernetes_asyncio import client, config

from drivers.kube_objects import (
    ACTOR,
    MANAGED_SELECTOR,
    PodSettings,
    PodView,
    Shape,
    api_error_message,
    claim_manifest,
    key_selector,
    owned_by,
    pod_manifest,
    read_pod,
    removed,
    secret_generation,
    secret_manifest,
    secret_name,
    shape,
    snapshot,
    sort_views,
)
from drivers.protocol import (
    LABEL_KEY,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    MANAGED_BY,
    DriverError,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
    grace_period,
)

log = logging.getLogger("sandstream.drivers.kubernetes")

T = TypeVar("T")
# Statuses a retry can fix: conflicts, throttling, timeouts, the server's own trouble.
_RETRYABLE_STATUS: Final = frozenset({0, 408, 409, 423, 429, 500, 502, 503, 504})
_TRANSPORT_ERRORS: Final = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


@dataclass(frozen=True)
class KubeConfig:
    """Where the cluster is and how sandbox Pods are made there.

    ``kubeconfig`` None: ``$KUBECONFIG`` or ``~/.kube/config``, and inside a cluster the Pod's
    service account. ``storage_class`` None: the workspace is an emptyDir, which lives with
    the Pod and so does not survive a stop (docs/drivers.md).
    """

    namespace: str = "sandstream"
    kubeconfig: Path | None = None
    context: str | None = None
    service_account: str | None = None
    image_pull_policy: str = "IfNotPresent"
    cpu_limit: str | None = None
    memory_limit: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    storage_class: str | None = None
    workspace_size: str = "1Gi"
    stop_timeout: float = 10.0  # grace period when neither caller nor sandbox sets one
    launch_timeout: float = 120.0  # how long a launch waits for its Pod to run
    removal_margin: float = 30.0  # how long past the grace period a Pod may take to go
    request_timeout: float = 30.0
    watch_timeout_seconds: int = 240  # the server ends each watch after this; resumed at once
    reconnect_delay: float = 0.2
    max_reconnect_delay: float = 5.0
    max_connections: int = 256

    @property
    def pod_settings(self) -> PodSettings:
        return PodSettings(
            stop_timeout=self.stop_timeout,
            service_account=self.service_account,
            image_pull_policy=self.image_pull_policy,
            cpu_limit=self.cpu_limit,
            memory_limit=self.memory_limit,
            node_selector=dict(self.node_selector),
            storage_class=self.storage_class,
            workspace_size=self.workspace_size,
        )


async def api_client(cfg: KubeConfig) -> client.ApiClient:
    """A client of the cluster ``cfg`` names (the kubeconfig, else the in-cluster account)."""
    configuration = client.Configuration()
    try:
        await config.load_kube_config(
            config_file=str(cfg.kubeconfig) if cfg.kubeconfig else None,
            context=cfg.context,
            client_configuration=configuration,
            persist_config=False,
        )
    except config.ConfigException:
        if cfg.kubeconfig is not None:
            raise
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    # One connection per call in flight: many slow stops must not starve the others.
    configuration.connection_pool_maxsize = cfg.max_connections
    return client.ApiClient(configuration)


def parse_node_selector(text: str) -> dict[str, str]:
    """``"disk=ssd,zone=a"`` -> ``{"disk": "ssd", "zone": "a"}``; ValueError names a bad part."""
    selector = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"node selector: expected KEY=VALUE, got {part!r}")
        selector[name.strip()] = value.strip()
    return selector


class ApiStatusError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class _Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class _Deadline(Exception):
    """The awaited condition did not hold by the deadline."""

    def __init__(self, last: PodView | None) -> None:
        super().__init__("still present")
        self.last = last


class KubernetesDriver:
    """The driver for one namespace of a Kubernetes cluster."""

    def __init__(self, cfg: KubeConfig | None = None, *, actor: str = ACTOR) -> None:
        self.cfg = cfg or KubeConfig()
        self.namespace = self.cfg.namespace
        self.actor = actor
        self._pods = self.cfg.pod_settings
        self._api: client.ApiClient | None = None
        self._connecting = asyncio.Lock()
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._responses: set[aiohttp.ClientResponse] = set()
        self._watching = 0  # watch streams whose watch request is open
        self.listings = 0  # full listings taken by watch streams (the first, then after 410s)
        self._closed = False

    # -- the protocol ------------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        return await self._call(self._launch, spec, key=spec.key, generation=spec.generation)

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self._call(
            self._stop, key, generation, timeout, key=key, generation=generation
        )

    async def kill(self, key: str, generation: int) -> OpResult:
        # Not under the key's lock: it may be held by the very stop this kill is forcing.
        return await self._call(
            self._kill, key, generation, key=key, generation=generation, exclusive=False
        )

    async def delete(self, key: str, sandbox_id: UUID | None = None) -> bool:
        return await self._call(self._delete, key, sandbox_id, key=key, generation=None)

    async def get(self, key: str) -> builtins.list[RuntimeInfo]:
        views = await self._call(self._list_views, key, key=None, generation=None)
        return [v.info for v in views]

    async def list(self) -> builtins.list[RuntimeInfo]:
        views = await self._call(self._list_views, None, key=None, generation=None)
        return [v.info for v in views]

    async def watch(self) -> AsyncIterator[WatchObservation]:
        """A listing, then changes; resumed from the last resourceVersion after a break, listed
        again after a 410 Gone. Pods seen before a relisting and missing from it are reported
        removed (source="list")."""
        known: dict[str, tuple[str, int]] = {}  # uid -> (key, generation)
        shapes: dict[str, Shape] = {}  # uid -> what was last reported of it
        version: str | None = None
        delay = self.cfg.reconnect_delay
        while not self._closed:
            try:
                if version is None:
                    views, version = await self._list_all()
                    self.listings += 1
                    listed = {v.uid: (v.info.key, v.info.generation) for v in views}
                    for view in views:
                        shapes[view.uid] = shape(view)
                        yield snapshot(view, source="list", actor=self.actor)
                    for uid, (key, generation) in known.items():
                        if uid not in listed:
                            shapes.pop(uid, None)
                            yield removed(key, generation, uid, resource_version=None)
                    known = listed
                async with contextlib.aclosing(self._watch_pods(version)) as events:
                    async for kind, pod in events:
                        delay = self.cfg.reconnect_delay
                        version = str(pod.get("metadata", {}).get("resourceVersion") or version)
                        if kind == "BOOKMARK":
                            continue
                        for observation in self._observe(kind, pod, known, shapes):
                            yield observation
                delay = self.cfg.reconnect_delay  # the server ended the watch: resume at once
            except _Gone:
                log.info("kubernetes watch: resourceVersion %s expired; listing again", version)
                version = None
            except (*_TRANSPORT_ERRORS, ApiStatusError) as exc:
                if self._closed:
                    return
                log.warning("kubernetes watch: %s; reconnecting in %.1fs", _describe(exc), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.max_reconnect_delay)

    async def close(self) -> None:
        self._closed = True
        for response in builtins.list(self._responses):
            response.close()
        if self._api is not None:
            await self._api.close()

    # -- extras ------------------------------------------------------------------------------

    @property
    def connected_watchers(self) -> int:
        """Watch streams whose watch request is open: from then on no change is missed."""
        return self._watching

    def reconnect_watchers(self) -> None:
        """Break every open watch connection: the streams resume from their last version."""
        for response in builtins.list(self._responses):
            response.close()

    async def claims(self, key: str) -> builtins.list[str]:
        """Names of the key's workspace claims (for tests and operators)."""
        found = await self._call(self._claims, key, None, key=None, generation=None)
        return [str(c["metadata"]["name"]) for c in found]

    # -- operations --------------------------------------------------------------------------

    async def _launch(self, spec: LaunchSpec) -> LaunchResult:
        views = await self._list_views(spec.key)
        newer = [v for v in views if v.info.generation > spec.generation]
        if newer:
            newest = newer[-1].info
            raise DriverError(
                f"launch of generation {spec.generation} superseded: generation "
                f"{newest.generation} of {spec.key} exists",
                retryable=False,
                observed=newest.state,
                exit_code=newest.exit_code,
            )
        current: PodView | None = None
        doomed: builtins.list[PodView] = []
        for view in views:
            info = view.info
            if (
                info.generation < spec.generation
                or view.terminating
                or info.identity != spec.identity
                or info.sandbox_id != spec.sandbox_id
            ):
                # Older generations go; so does a Pod of this generation that is being deleted
                # (a stop raced us) or was launched for another intent (the persisted one wins).
                doomed.append(view)
            else:
                current = view
        await asyncio.gather(*(self._remove_pod(v, self._grace(v)) for v in doomed))
        # The replaced generations' Secrets go with their Pods (not left to the collector).
        await self._remove_secrets(spec.key, lambda _, g: g < spec.generation)
        if current is not None and current.info.state != "created":
            return LaunchResult(current.uid, spec.generation, spec.identity, False, adopted=True)
        adopted = current is not None
        if current is None:
            if self._pods.storage_class is not None:
                await self._create(
                    "persistentvolumeclaims", claim_manifest(spec, self._pods), exist_ok=True
                )
            if spec.secrets:
                await self._write_secret(spec)
            current, adopted = await self._create_pod(spec)
            if spec.secrets:
                await self._own_secret(spec, current)
        try:
            started, _ = await self._await_pod(
                current, lambda v: v is None or v.info.state != "created", self.cfg.launch_timeout
            )
        except _Deadline:
            raise DriverError(
                f"pod {current.name} not running {self.cfg.launch_timeout:.0f}s after its "
                "creation (unschedulable, or its image cannot be pulled)",
                retryable=True,
                observed="created",
            ) from None
        if started is None:
            raise DriverError(
                f"pod {current.name} was removed while it started", retryable=True, observed=None
            )
        return LaunchResult(started.uid, spec.generation, spec.identity, True, adopted=adopted)

    async def _create_pod(self, spec: LaunchSpec) -> tuple[PodView, bool]:
        """The generation's Pod, and whether it existed already (made by an earlier launch)."""
        manifest = pod_manifest(spec, self._pods)
        name = manifest["metadata"]["name"]
        created = await self._create("pods", manifest, exist_ok=True)
        if created is not None and (view := read_pod(created)) is not None:
            return view, False
        # The name was taken: by an earlier launch of ours, or a stranger.
        existing = await self._read_pod(name)
        if existing is None:
            raise DriverError(
                f"pod {name} was taken, then removed, while it was being created", retryable=True
            )
        view = read_pod(existing)
        if view is None or view.info.generation != spec.generation:
            raise DriverError(
                f"pod name {name} is in use by a pod sandstream does not manage", retryable=False
            )
        return view, True

    async def _stop(self, key: str, generation: int, timeout: float | None) -> OpResult:
        views = [v for v in await self._list_views(key) if v.info.generation == generation]
        if not views:
            return OpResult("already_absent")
        view = views[-1]
        last = await self._remove_pod(view, self._grace(view, timeout))
        await self._remove_secrets(key, lambda _, g: g == generation)
        if last is None:
            return OpResult("already_absent")
        return OpResult("succeeded", view.uid, last.info.exit_code)

    async def _kill(self, key: str, generation: int) -> OpResult:
        """Delete the generation's Pod with no grace period: the API server removes it at once
        (a kubelet then SIGKILLs its container), and a stop waiting for it returns too."""
        views = [v for v in await self._list_views(key) if v.info.generation == generation]
        if not views:
            return OpResult("already_absent")
        last = await self._remove_pod(views[-1], 0.0)
        if last is None:
            return OpResult("already_absent")
        return OpResult("succeeded", views[-1].uid, last.info.exit_code)

    async def _delete(self, key: str, sandbox_id: UUID | None) -> bool:
        views = [v for v in await self._list_views(key) if sandbox_id in (None, v.info.sandbox_id)]
        await asyncio.gather(*(self._remove_pod(v, self._grace(v)) for v in views))
        secrets = await self._remove_secrets(key, lambda i, _: sandbox_id in (None, i))
        claims = await self._claims(key, sandbox_id)
        for claim in claims:
            await self._delete_object(
                "persistentvolumeclaims", claim["metadata"]["name"], claim["metadata"]["uid"]
            )
        deadline = time.monotonic() + self.cfg.removal_margin
        while claims and await self._claims(key, sandbox_id):
            # The claim goes once its protection finalizer is dropped, i.e. no Pod uses it.
            if time.monotonic() > deadline:
                raise DriverError(
                    f"workspace claims of {key} still present after the pods were removed",
                    retryable=True,
                    observed=None,
                )
            await asyncio.sleep(0.1)
        return bool(views or claims or secrets)

    # -- provider values: one Secret per generation ------------------------------------------

    async def _write_secret(self, spec: LaunchSpec) -> None:
        """Create the generation's Secret with the values read for this launch; one left by an
        interrupted launch of the same generation is replaced (these values are newer)."""
        core = await self._core()
        create: Callable[..., Awaitable[Any]] = core.create_namespaced_secret
        replace: Callable[..., Awaitable[Any]] = core.replace_namespaced_secret
        manifest = secret_manifest(spec)
        try:
            await self._json(create(self.namespace, manifest, **self._opts()))
        except ApiStatusError as exc:
            if exc.status != 409:
                raise
            name = manifest["metadata"]["name"]
            await self._json(replace(name, self.namespace, manifest, **self._opts()))

    async def _own_secret(self, spec: LaunchSpec, pod: PodView) -> None:
        """Make the Pod the Secret's owner: a Pod removed by anyone takes its Secret along."""
        core = await self._core()
        fresh = await self._read_pod(pod.name)
        if fresh is None:
            return  # gone already: the next launch or the delete removes the Secret
        name = secret_name(spec.key, spec.generation)
        await self._json(
            core.patch_namespaced_secret(name, self.namespace, owned_by(fresh), **self._opts())
        )

    async def _remove_secrets(self, key: str, which: Callable[[UUID, int], bool]) -> int:
        """Delete the key's Secrets whose (sandbox id, generation) ``which`` selects."""
        core = await self._core()
        answer = await self._json(
            core.list_namespaced_secret(
                self.namespace, label_selector=key_selector(key), **self._opts()
            )
        )
        doomed = [
            s
            for s in answer.get("items") or []
            if (found := secret_generation(s)) is not None and which(*found)
        ]
        for secret in doomed:
            meta = secret["metadata"]
            await self._delete_object("secrets", meta["name"], meta["uid"])
        return len(doomed)

    def _grace(self, view: PodView, timeout: float | None = None) -> float:
        return grace_period(timeout, view.stop_timeout, self.cfg.stop_timeout)

    async def _remove_pod(self, view: PodView, grace: float) -> PodView | None:
        """Delete the Pod with ``grace`` and wait until it is gone: its last view (a deleted
        Pod's final status may carry the exit code), or None when it was already gone."""
        deleted = await self._delete_object("pods", view.name, view.uid, grace=math.ceil(grace))
        if deleted is None:
            return None
        # Read it back: a delete without grace (or of an unscheduled Pod) removes it at once, and
        # a watch from the delete's answer would not see that removal again.
        fresh = await self._read_pod(view.name)
        current = read_pod(fresh) if fresh else None
        if current is None or current.uid != view.uid:
            return read_pod(deleted) or view
        limit = grace + self.cfg.removal_margin
        try:
            _, last = await self._await_pod(current, lambda v: v is None, limit)
        except _Deadline as exc:
            still = exc.last or view
            raise DriverError(
                f"pod {view.name} still terminating {limit:.0f}s after its deletion "
                "(a finalizer, or an unreachable node)",
                retryable=True,
                observed=still.info.state,
                exit_code=still.info.exit_code,
            ) from None
        return last

    async def _await_pod(
        self, view: PodView, until: Callable[[PodView | None], bool], timeout: float
    ) -> tuple[PodView | None, PodView]:
        """Wait until ``until`` holds for the Pod (None once it is gone), following a watch of
        that one Pod, re-read and watched again whenever a watch ends. Returns the Pod's view
        (None: gone) and the last view of it seen; _Deadline at the deadline."""
        deadline = time.monotonic() + timeout
        current: PodView | None = view
        last = view
        while not until(current):
            remaining = deadline - time.monotonic()
            if current is None or remaining <= 0:
                raise _Deadline(current)
            events = self._watch_pods(
                current.resource_version,
                field_selector=f"metadata.name={view.name}",
                timeout_seconds=max(1, math.ceil(remaining)),
            )
            with contextlib.suppress(_Gone, TimeoutError):
                async with asyncio.timeout(remaining), contextlib.aclosing(events):
                    async for kind, pod in events:
                        seen = read_pod(pod)
                        if kind == "BOOKMARK" or seen is None or seen.uid != view.uid:
                            continue
                        last = seen
                        current = None if kind == "DELETED" else seen
                        if until(current):
                            return current, last
            if current is not None:
                fresh = await self._read_pod(view.name)
                seen = read_pod(fresh) if fresh else None
                current = seen if seen is not None and seen.uid == view.uid else None
                last = current or last
        return current, last

    # -- API plumbing ------------------------------------------------------------------------

    async def _core(self) -> client.CoreV1Api:
        if self._api is None:
            async with self._connecting:
                if self._api is None:
                    self._api = await self._connect()
        return client.CoreV1Api(self._api)

    async def _connect(self) -> client.ApiClient:
        return await api_client(self.cfg)

    async def _json(self, call: Awaitable[Any]) -> dict[str, Any]:
        """Await a raw (``_preload_content=False``) call and decode its JSON body."""
        response = await call
        async with response:
            body = await response.read()
            if not 200 <= response.status < 300:
                raise ApiStatusError(response.status, api_error_message(body))
        decoded: dict[str, Any] = json.loads(body)
        return decoded

    def _opts(self) -> dict[str, Any]:
        return {"_preload_content": False, "_request_timeout": self.cfg.request_timeout}

    async def _list_raw(self, selector: str) -> tuple[builtins.list[dict[str, Any]], str]:
        core = await self._core()
        answer = await self._json(
            core.list_namespaced_pod(self.namespace, label_selector=selector, **self._opts())
        )
        return answer.get("items") or [], str(answer["metadata"].get("resourceVersion", ""))

    async def _list_views(self, key: str | None) -> builtins.list[PodView]:
        items, _ = await self._list_raw(key_selector(key) if key else MANAGED_SELECTOR)
        views = [v for v in map(read_pod, items) if v is not None and key in (None, v.info.key)]
        return sort_views(views)

    async def _list_all(self) -> tuple[builtins.list[PodView], str]:
        items, version = await self._list_raw(MANAGED_SELECTOR)
        return sort_views([v for v in map(read_pod, items) if v is not None]), version

    async def _read_pod(self, name: str) -> dict[str, Any] | None:
        core = await self._core()
        try:
            return await self._json(core.read_namespaced_pod(name, self.namespace, **self._opts()))
        except ApiStatusError as exc:
            if exc.status == 404:
                return None
            raise

    async def _claims(self, key: str, sandbox_id: UUID | None) -> builtins.list[dict[str, Any]]:
        core = await self._core()
        answer = await self._json(
            core.list_namespaced_persistent_volume_claim(
                self.namespace, label_selector=key_selector(key), **self._opts()
            )
        )
        return [
            c
            for c in answer.get("items") or []
            if (c["metadata"].get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGED_BY
            and (c["metadata"].get("labels") or {}).get(LABEL_KEY) == key
            and (
                sandbox_id is None
                or (c["metadata"].get("labels") or {}).get(LABEL_SANDBOX_ID) == str(sandbox_id)
            )
        ]

    async def _create(
        self, resource: str, manifest: dict[str, Any], *, exist_ok: bool
    ) -> dict[str, Any] | None:
        """Create a Pod or claim; None when the name exists (with ``exist_ok``)."""
        core = await self._core()
        create: Callable[..., Awaitable[Any]] = (
            core.create_namespaced_pod
            if resource == "pods"
            else core.create_namespaced_persistent_volume_claim
        )
        try:
            return await self._json(create(self.namespace, manifest, **self._opts()))
        except ApiStatusError as exc:
            if exc.status == 409 and exist_ok:
                return None
            raise

    async def _delete_object(
        self, resource: str, name: str, uid: str, grace: int | None = None
    ) -> dict[str, Any] | None:
        """Delete exactly the object with ``uid`` (a precondition: never a successor of the
        same name); its state after the delete, or None when it was already gone."""
        core = await self._core()
        delete: Callable[..., Awaitable[Any]] = {
            "pods": core.delete_namespaced_pod,
            "persistentvolumeclaims": core.delete_namespaced_persistent_volume_claim,
            "secrets": core.delete_namespaced_secret,
        }[resource]
        body: dict[str, Any] = {"preconditions": {"uid": uid}}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            answer = await self._json(delete(name, self.namespace, body=body, **self._opts()))
        except ApiStatusError as exc:
            if exc.status == 404 or (exc.status == 409 and "precondition" in exc.message.lower()):
                return None
            raise
        # A delete answers with the object (still terminating) or, when it is gone at once, a
        # Status; either way the object existed.
        return answer if answer.get("kind") != "Status" else {}

    async def _watch_pods(
        self,
        version: str,
        *,
        field_selector: str | None = None,
        timeout_seconds: int | None = None,
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """(event type, object) of one watch request from ``version``, until the server ends
        it. Raises _Gone on 410 and ApiStatusError on other error events.

        The request is made and read here rather than with ``kubernetes_asyncio.watch.Watch``,
        which retries a 410 by itself and reconnects silently: this driver must relist on a
        410 and must know when its watch is open.
        """
        core = await self._core()
        seconds = timeout_seconds or self.cfg.watch_timeout_seconds
        args: dict[str, Any] = {
            "label_selector": MANAGED_SELECTOR,
            "watch": True,
            "allow_watch_bookmarks": True,
            "resource_version": version,
            "timeout_seconds": seconds,
            "_preload_content": False,
            # Bookmarks arrive about once a minute; a read silent for much longer is dead.
            "_request_timeout": aiohttp.ClientTimeout(
                sock_connect=self.cfg.request_timeout, sock_read=seconds + 30
            ),
        }
        if field_selector:
            args["field_selector"] = field_selector
        response = cast(
            aiohttp.ClientResponse, await core.list_namespaced_pod(self.namespace, **args)
        )
        self._responses.add(response)
        counted = field_selector is None
        try:
            if response.status == 410:
                raise _Gone()
            if not 200 <= response.status < 300:
                raise ApiStatusError(response.status, api_error_message(await response.read()))
            if counted:
                self._watching += 1
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = str(event.get("type", "")), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise ApiStatusError(int(obj.get("code") or 0), str(obj.get("message")))
                yield kind, obj
        finally:
            if counted and response.status == 200:
                self._watching -= 1
            self._responses.discard(response)
            response.close()

    def _observe(
        self,
        kind: str,
        pod: dict[str, Any],
        known: dict[str, tuple[str, int]],
        shapes: dict[str, Shape],
    ) -> builtins.list[WatchObservation]:
        view = read_pod(pod)
        if view is None:
            return []
        out: builtins.list[WatchObservation] = []
        if kind == "DELETED":
            if view.info.state == "exited" and shapes.get(view.uid, ("",))[0] != "exited":
                # The final status carried the exit: report it before the removal.
                out.append(snapshot(view, source="watch", actor=self.actor))
            known.pop(view.uid, None)
            shapes.pop(view.uid, None)
            out.append(
                removed(
                    view.info.key,
                    view.info.generation,
                    view.uid,
                    resource_version=view.resource_version,
                    actor=self.actor,
                    now=datetime.now(UTC),
                )
            )
            return out
        known[view.uid] = (view.info.key, view.info.generation)
        if shapes.get(view.uid) != shape(view):
            shapes[view.uid] = shape(view)
            out.append(snapshot(view, source="watch", actor=self.actor))
        return out

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
        except (*_TRANSPORT_ERRORS, ApiStatusError, config.ConfigException) as exc:
            error = DriverError(
                f"{getattr(fn, '__name__', 'call').lstrip('_')} failed: {_describe(exc)}",
                retryable=_retryable(exc),
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
                v for v in await self._list_views(key) if generation in (None, v.info.generation)
            ]
            if views:
                error.observed, error.exit_code = views[-1].info.state, views[-1].info.exit_code
            elif generation is not None or not await self._claims(key, None):
                error.observed = "absent"
        except (*_TRANSPORT_ERRORS, ApiStatusError) as exc:
            log.info("cannot observe %s after a failure: %s", key, _describe(exc))


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, ApiStatusError):
        return exc.status in _RETRYABLE_STATUS
    return not isinstance(exc, config.ConfigException)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiStatusError):
        return f"kubernetes: {exc}"
    return f"kubernetes: {type(exc).__name__}: {exc}"
