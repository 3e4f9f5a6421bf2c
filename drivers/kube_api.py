"""The Kubernetes driver's API calls in its namespace, on plain JSON dicts: Pods listed, read,
created, deleted and watched, workspace claims, provider Secrets, and how errors are classified.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Final, cast
from uuid import UUID

import aiohttp
from kubernetes_asyncio import client, config

from drivers.kube_config import KubeConfig, api_client
from drivers.kube_objects import (
    MANAGED_SELECTOR,
    PodView,
    api_error_message,
    key_selector,
    owned_by,
    read_pod,
    secret_generation,
    secret_manifest,
    secret_name,
    sort_views,
)
from drivers.labels import incarnation_of
from drivers.protocol import LABEL_KEY, LABEL_MANAGED_BY, LABEL_SANDBOX_ID, MANAGED_BY, LaunchSpec

# Statuses a retry can fix: conflicts, throttling, timeouts, the server's own trouble.
_RETRYABLE_STATUS: Final = frozenset({0, 408, 409, 423, 429, 500, 502, 503, 504})
TRANSPORT_ERRORS: Final = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class ApiStatusError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, ApiStatusError):
        return exc.status in _RETRYABLE_STATUS
    return not isinstance(exc, config.ConfigException)


def describe(exc: BaseException) -> str:
    if isinstance(exc, ApiStatusError):
        return f"kubernetes: {exc}"
    return f"kubernetes: {type(exc).__name__}: {exc}"


class KubeApi:
    """One namespace of the cluster ``cfg`` names, connected on first use."""

    def __init__(self, cfg: KubeConfig) -> None:
        self.cfg = cfg
        self.namespace = cfg.namespace
        self._client: client.ApiClient | None = None
        self._connecting = asyncio.Lock()
        self._responses: set[aiohttp.ClientResponse] = set()
        self.watching = 0  # watch streams (of every Pod) whose watch request is open

    async def close(self) -> None:
        self.break_watches()
        if self._client is not None:
            await self._client.close()

    def break_watches(self) -> None:
        """Close every open watch connection (its reader sees the stream end)."""
        for response in list(self._responses):
            response.close()

    # -- plumbing ----------------------------------------------------------------------------

    async def core(self) -> client.CoreV1Api:
        if self._client is None:
            async with self._connecting:
                if self._client is None:
                    self._client = await self.connect()
        return client.CoreV1Api(self._client)

    async def connect(self) -> client.ApiClient:
        return await api_client(self.cfg)

    async def answer(self, call: Awaitable[Any]) -> dict[str, Any]:
        """Await a raw (``_preload_content=False``) call and decode its JSON body."""
        response = await call
        async with response:
            body = await response.read()
            if not 200 <= response.status < 300:
                raise ApiStatusError(response.status, api_error_message(body))
        decoded: dict[str, Any] = json.loads(body)
        return decoded

    def opts(self) -> dict[str, Any]:
        return {"_preload_content": False, "_request_timeout": self.cfg.request_timeout}

    async def list_raw(self, selector: str) -> tuple[list[dict[str, Any]], str]:
        core = await self.core()
        answer = await self.answer(
            core.list_namespaced_pod(self.namespace, label_selector=selector, **self.opts())
        )
        return answer.get("items") or [], str(answer["metadata"].get("resourceVersion", ""))

    async def list_views(self, key: str | None) -> list[PodView]:
        items, _ = await self.list_raw(key_selector(key) if key else MANAGED_SELECTOR)
        views = [v for v in map(read_pod, items) if v is not None and key in (None, v.info.key)]
        return sort_views(views)

    async def list_all(self) -> tuple[list[PodView], str]:
        items, version = await self.list_raw(MANAGED_SELECTOR)
        return sort_views([v for v in map(read_pod, items) if v is not None]), version

    async def fetch_pod(self, name: str) -> dict[str, Any] | None:
        core = await self.core()
        try:
            return await self.answer(core.read_namespaced_pod(name, self.namespace, **self.opts()))
        except ApiStatusError as exc:
            if exc.status == 404:
                return None
            raise

    async def incarnations(self) -> set[tuple[str, UUID]]:
        """The incarnations of our Pods, claims and Secrets in the namespace."""
        core = await self.core()
        found: set[tuple[str, UUID]] = set()
        for list_objects in (
            core.list_namespaced_pod,
            core.list_namespaced_persistent_volume_claim,
            core.list_namespaced_secret,
        ):
            answer = await self.answer(
                list_objects(self.namespace, label_selector=MANAGED_SELECTOR, **self.opts())
            )
            for item in answer.get("items") or []:
                incarnation = incarnation_of(item["metadata"].get("labels"))
                if incarnation is not None:
                    found.add(incarnation)
        return found

    async def claims(self, key: str, sandbox_id: UUID | None) -> list[dict[str, Any]]:
        core = await self.core()
        answer = await self.answer(
            core.list_namespaced_persistent_volume_claim(
                self.namespace, label_selector=key_selector(key), **self.opts()
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

    async def create(
        self, resource: str, manifest: dict[str, Any], *, exist_ok: bool
    ) -> dict[str, Any] | None:
        """Create a Pod or claim; None when the name exists (with ``exist_ok``)."""
        core = await self.core()
        create: Callable[..., Awaitable[Any]] = (
            core.create_namespaced_pod
            if resource == "pods"
            else core.create_namespaced_persistent_volume_claim
        )
        try:
            return await self.answer(create(self.namespace, manifest, **self.opts()))
        except ApiStatusError as exc:
            if exc.status == 409 and exist_ok:
                return None
            raise

    async def delete_object(
        self, resource: str, name: str, uid: str, grace: int | None = None
    ) -> dict[str, Any] | None:
        """Delete exactly the object with ``uid`` (a precondition: never a successor of the
        same name); its state after the delete, or None when it was already gone."""
        core = await self.core()
        delete: Callable[..., Awaitable[Any]] = {
            "pods": core.delete_namespaced_pod,
            "persistentvolumeclaims": core.delete_namespaced_persistent_volume_claim,
            "secrets": core.delete_namespaced_secret,
        }[resource]
        body: dict[str, Any] = {"preconditions": {"uid": uid}}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            answer = await self.answer(delete(name, self.namespace, body=body, **self.opts()))
        except ApiStatusError as exc:
            if exc.status == 404 or (exc.status == 409 and "precondition" in exc.message.lower()):
                return None
            raise
        # A delete answers with the object (still terminating) or, when it is gone at once, a
        # Status; either way the object existed.
        return answer if answer.get("kind") != "Status" else {}

    async def watch_pods(
        self,
        version: str,
        *,
        field_selector: str | None = None,
        timeout_seconds: int | None = None,
        count: bool | None = None,
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """(event type, object) of one watch request from ``version``, until the server ends
        it. Raises Gone on 410 and ApiStatusError on other error events. ``count``: whether
        it counts in ``watching`` (by default, a watch of every Pod does).

        The request is made and read here rather than with ``kubernetes_asyncio.watch.Watch``,
        which retries a 410 by itself and reconnects silently: this driver must relist on a
        410 and must know when its watch is open.
        """
        core = await self.core()
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
        counted = field_selector is None if count is None else count
        try:
            if response.status == 410:
                raise Gone()
            if not 200 <= response.status < 300:
                raise ApiStatusError(response.status, api_error_message(await response.read()))
            if counted:
                self.watching += 1
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = str(event.get("type", "")), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise ApiStatusError(int(obj.get("code") or 0), str(obj.get("message")))
                yield kind, obj
        finally:
            if counted and response.status == 200:
                self.watching -= 1
            self._responses.discard(response)
            response.close()

    # -- provider values: one Secret per generation ------------------------------------------

    async def write_secret(self, spec: LaunchSpec) -> None:
        """Create the generation's Secret with the values read for this launch; one left by an
        interrupted launch of the same generation is replaced (these values are newer)."""
        core = await self.core()
        create: Callable[..., Awaitable[Any]] = core.create_namespaced_secret
        replace: Callable[..., Awaitable[Any]] = core.replace_namespaced_secret
        manifest = secret_manifest(spec)
        try:
            await self.answer(create(self.namespace, manifest, **self.opts()))
        except ApiStatusError as exc:
            if exc.status != 409:
                raise
            name = manifest["metadata"]["name"]
            await self.answer(replace(name, self.namespace, manifest, **self.opts()))

    async def own_secret(self, spec: LaunchSpec, pod: PodView) -> None:
        """Make the Pod the Secret's owner: a Pod removed by anyone takes its Secret along (one
        removed already has its Secret collected at once)."""
        core = await self.core()
        name = secret_name(spec.key, spec.generation)
        owner = {"metadata": {"name": pod.name, "uid": pod.uid}}
        await self.answer(
            core.patch_namespaced_secret(name, self.namespace, owned_by(owner), **self.opts())
        )

    async def remove_secrets(self, key: str, which: Callable[[UUID, int], bool]) -> int:
        """Delete the key's Secrets whose (sandbox id, generation) ``which`` selects."""
        core = await self.core()
        answer = await self.answer(
            core.list_namespaced_secret(
                self.namespace, label_selector=key_selector(key), **self.opts()
            )
        )
        doomed = [
            s
            for s in answer.get("items") or []
            if (found := secret_generation(s)) is not None and which(*found)
        ]
        for secret in doomed:
            meta = secret["metadata"]
            await self.delete_object("secrets", meta["name"], meta["uid"])
        return len(doomed)
