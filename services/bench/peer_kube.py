"""The peer benchmark's Kubernetes client: creates, deletes, watches that resume, manifests
applied as their YAML, service-account tokens, the apiserver's metrics.

One httpx client for every request the bench makes to the apiserver (its connection pool kept
warm), the same kind of client the bench uses for sandstream's API: the load generator costs
every system alike.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final

import httpx

# The REST path of each kind the bench applies from a manifest (cluster-wide: no {ns}).
KIND_PATHS: Final = {
    "Namespace": "/api/v1/namespaces",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
}
# A request answered slowly under load is a slow answer, not a failure: the phase's own
# timeout bounds the wait.
REQUEST_TIMEOUT = 300.0
_KIND = re.compile(r"^kind:\s*(\w+)\s*$", re.MULTILINE)
_NAMESPACE = re.compile(r"^(\s*)namespace:\s*\S+\s*$", re.MULTILINE)


class KubeError(RuntimeError):
    """The apiserver refused a request; the message has its status and answer."""


def yaml_documents(text: str, namespace: str | None = None) -> list[tuple[str, str]]:
    """The documents of a multi-document YAML manifest as (kind, text), each ``namespace:``
    line set to ``namespace`` when given. Enough YAML for the manifests the bench applies
    (the apiserver itself parses what is sent, as ``application/yaml``)."""
    found = []
    for doc in re.split(r"^---\s*$", text, flags=re.MULTILINE):
        kind = _KIND.search(doc)
        if kind is None:
            continue  # comments only
        if namespace is not None:
            doc = _NAMESPACE.sub(lambda m: f"{m.group(1)}namespace: {namespace}", doc)
        found.append((kind.group(1), doc.strip() + "\n"))
    return found


class Kube:
    """The apiserver at ``server``, as the holder of ``token``."""

    def __init__(self, server: str, ca_file: Path, token: str, connections: int = 50) -> None:
        self.server = server
        self.ca_file = ca_file
        self.client = httpx.AsyncClient(
            base_url=server,
            verify=ssl.create_default_context(cafile=str(ca_file)),
            headers={"Authorization": f"Bearer {token}"},
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10.0),
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def _checked(self, request: Awaitable[httpx.Response], ok: tuple[int, ...]) -> Any:
        response = await request
        if response.status_code not in ok:
            raise KubeError(f"HTTP {response.status_code}: {response.text[:400]}")
        return response.json() if response.content else None

    async def create(self, path: str, body: Mapping[str, Any], exist_ok: bool = False) -> Any:
        ok = (200, 201, 202, 409) if exist_ok else (200, 201, 202)
        return await self._checked(self.client.post(path, json=body), ok)

    async def delete(self, path: str, missing_ok: bool = True) -> None:
        ok = (200, 202, 404) if missing_ok else (200, 202)
        await self._checked(self.client.delete(path), ok)

    async def get(self, path: str, **params: Any) -> Any:
        return await self._checked(self.client.get(path, params=params), (200,))

    async def apply_yaml(self, kind: str, text: str, namespace: str | None = None) -> None:
        """Create one manifest document (left as it is if it exists)."""
        path = KIND_PATHS[kind].format(ns=namespace)
        response = await self.client.post(
            path, content=text, headers={"Content-Type": "application/yaml"}
        )
        if response.status_code not in (200, 201, 409):
            raise KubeError(f"creating {kind}: HTTP {response.status_code}: {response.text[:400]}")

    async def ensure_namespace(self, name: str, timeout: float = 60.0) -> None:
        """The namespace, once the controller manager has made its ``default`` ServiceAccount
        (Pods are refused before)."""
        await self.create("/api/v1/namespaces", {"metadata": {"name": name}}, exist_ok=True)
        async with asyncio.timeout(timeout):
            while True:
                response = await self.client.get(
                    f"/api/v1/namespaces/{name}/serviceaccounts/default"
                )
                if response.status_code == 200:
                    return
                await asyncio.sleep(0.1)

    async def token(self, namespace: str, account: str, seconds: int = 86400) -> str:
        """A token of the ServiceAccount (TokenRequest)."""
        answer = await self.create(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": seconds}},
        )  # fmt: skip
        return str(answer["status"]["token"])

    async def metrics(self) -> str:
        response = await self.client.get("/metrics")
        response.raise_for_status()
        return response.text

    async def resource_version(self, path: str) -> str:
        answer = await self.get(path, limit=1)
        return str(answer["metadata"]["resourceVersion"])

    async def watch(
        self,
        path: str,
        on_event: Callable[[str, dict[str, Any]], None],
        resource_version: str,
        on_list: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        """Follow ``path``'s changes from ``resource_version`` until cancelled, calling
        ``on_event(type, object)`` for each. A stream the apiserver ends (it closes those that
        fall behind under load, and each after its timeout) is resumed from the last version
        seen; after a 410 Gone (the version is older than the apiserver keeps) it lists
        ``path`` again, hands every object to ``on_event`` as ``ADDED`` and the whole list to
        ``on_list`` (so that deletions missed meanwhile can be told), and watches from there."""
        version = resource_version
        while True:
            params = {"watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                      "timeoutSeconds": "300"}  # fmt: skip
            try:
                async with self.client.stream(
                    "GET", path, params=params, timeout=httpx.Timeout(None, connect=10.0)
                ) as response:
                    if response.status_code == 410:
                        raise WatchGone
                    if response.status_code != 200:
                        raise KubeError(f"watch {path}: HTTP {response.status_code}")
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            if obj.get("code") == 410:
                                raise WatchGone
                            raise KubeError(f"watch {path}: {obj.get('message')}")
                        version = (obj.get("metadata") or {}).get("resourceVersion", version)
                        if event["type"] != "BOOKMARK":
                            on_event(event["type"], obj)
            except WatchGone:
                listed = await self.get(path)
                version = str(listed["metadata"]["resourceVersion"])
                items = listed.get("items") or []
                for item in items:
                    on_event("ADDED", item)
                if on_list is not None:
                    on_list(items)
            except (httpx.TransportError, httpx.StreamError):
                await asyncio.sleep(0.2)


class WatchGone(Exception):
    """The version a watch resumed from is older than the apiserver keeps."""
