"""The warm pools the peer benchmark's warm phase compares (services/bench/peer_warm.py runs
it), each as the load generator sees it: how a pool of the benchmark's Pod is made, how a
sandbox is claimed from it and released, and how the claim's Ready, the pool's Ready members
and the Pod of each claim are reported; and the ClaimTrack of when each of those happened.

- **agent-sandbox** (its extensions): a SandboxTemplate holding the Pod, a SandboxWarmPool of
  it, a SandboxClaim per claim; Ready as the claim's Ready condition, the pool's Ready members
  as its ``status.readyReplicas``, warm or cold as the claimed Sandbox's launch-type label;
- **sandstream**: a template holding the same Pod's spec, a pool of it (``/v1/pools``), a
  ``POST /v1/sandboxes`` naming the template per claim; Ready as the claim's answer says (a
  warm claim answers with the adopted member, Ready) or else as its watch shows the row; the
  pool's Ready members as the watch shows its unclaimed rows.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from services.bench.peer_kube import Kube
from services.bench.peer_stats import pod_ready, row_phase, sandbox_ready, sse_events
from services.bench.peer_systems import COMMAND, OURS, PEER, SandstreamApi, Track
from services.localstack import agent_sandbox

POOL = "warm"  # the template's and the pool's name, in each system


@dataclass
class ClaimTrack(Track):
    """A Track of claims, with each claim's Pod (by the system's key for it), whether it was
    served warm, when each Pod was seen Running+Ready, and the pool's Ready members over time."""

    pod: dict[str, str] = field(default_factory=dict)  # claim -> its Pod's key
    warm: dict[str, bool] = field(default_factory=dict)  # claim -> served warm
    pod_ready_at: dict[str, float] = field(default_factory=dict)  # Pod key -> seen Ready
    pool: list[tuple[float, int]] = field(default_factory=list)  # (when, Ready members)

    def pool_now(self, ready: int) -> None:
        if not self.pool or self.pool[-1][1] != ready:
            self.pool.append((time.perf_counter(), ready))
            self.changed.set()

    @property
    def pool_ready(self) -> int:
        return self.pool[-1][1] if self.pool else 0

    def refilled_at(self, since: float, size: int) -> float | None:
        """When the pool was back at ``size`` Ready after it last fell below it since
        ``since`` (None: not yet, or it never fell)."""
        fell = False
        for at, ready in self.pool:
            if at < since:
                continue
            if ready < size:
                fell = True
            elif fell:
                return at
        return None

    def pod_seen(self, key: str, ready: bool) -> None:
        if not ready:
            self.pod_ready_at.pop(key, None)
        elif key not in self.pod_ready_at:
            self.pod_ready_at[key] = time.perf_counter()
            self.changed.set()


class WarmSystem(Protocol):
    label: str
    namespace: str
    track: ClaimTrack

    def pod_key(self, pod_name: str) -> str | None: ...
    async def create_pool(self, size: int) -> None: ...
    async def delete_pool(self) -> None: ...
    async def claim(self, name: str) -> None: ...
    async def release(self, name: str) -> None: ...
    async def watch(self) -> None: ...
    async def warm_up(self, connections: int) -> None: ...
    async def kafka_requests(self) -> dict[tuple[str, str], float]: ...


class AgentClaims:
    """agent-sandbox's extensions: SandboxTemplate, SandboxWarmPool, SandboxClaim."""

    label = PEER

    def __init__(self, kube: Kube, namespace: str, spec: dict[str, Any]) -> None:
        self.kube, self.namespace, self.spec = kube, namespace, spec
        self.track = ClaimTrack()
        self.api_version = f"{agent_sandbox.EXTENSIONS_GROUP}/{agent_sandbox.API_VERSION}"
        self.base = f"/apis/{self.api_version}/namespaces/{namespace}"
        core = f"{agent_sandbox.GROUP}/{agent_sandbox.API_VERSION}"
        self.sandboxes = f"/apis/{core}/namespaces/{namespace}/sandboxes"
        self.launch: dict[str, bool] = {}  # Sandbox -> launched warm (its label)

    def pod_key(self, pod_name: str) -> str | None:
        return pod_name  # the Sandbox's Pod has the Sandbox's name

    async def create_pool(self, size: int) -> None:
        await self.kube.create(
            f"{self.base}/sandboxtemplates",
            {"apiVersion": self.api_version, "kind": "SandboxTemplate",
             "metadata": {"name": POOL}, "spec": {"podTemplate": {"spec": self.spec}}},
        )  # fmt: skip
        await self.kube.create(
            f"{self.base}/sandboxwarmpools",
            {"apiVersion": self.api_version, "kind": "SandboxWarmPool",
             "metadata": {"name": POOL},
             "spec": {"replicas": size, "sandboxTemplateRef": {"name": POOL}}},
        )  # fmt: skip

    async def delete_pool(self) -> None:
        await self.kube.delete(f"{self.base}/sandboxwarmpools/{POOL}")
        await self.kube.delete(f"{self.base}/sandboxtemplates/{POOL}")

    async def claim(self, name: str) -> None:
        await self.kube.create(
            f"{self.base}/sandboxclaims",
            {"apiVersion": self.api_version, "kind": "SandboxClaim", "metadata": {"name": name},
             "spec": {"warmPoolRef": {"name": POOL}}},
        )  # fmt: skip

    async def release(self, name: str) -> None:
        await self.kube.delete(f"{self.base}/sandboxclaims/{name}")

    async def kafka_requests(self) -> dict[tuple[str, str], float]:
        return {}  # no Kafka

    async def warm_up(self, connections: int) -> None:
        path = f"{self.base}/sandboxclaims"
        await asyncio.gather(*(self.kube.get(path, limit=1) for _ in range(connections)))

    async def watch(self) -> None:
        await asyncio.gather(self._claims(), self._sandboxes(), self._pools())

    async def _claims(self) -> None:
        track, path = self.track, f"{self.base}/sandboxclaims"

        def seen(kind: str, claim: dict[str, Any]) -> None:
            name = claim["metadata"]["name"]
            if kind == "DELETED":
                track.note(track.gone, name)
                return
            sandbox = ((claim.get("status") or {}).get("sandbox") or {}).get("name")
            if sandbox:
                track.pod[name] = sandbox
            if sandbox_ready(claim):  # its Ready condition: the adopted Sandbox's Ready
                track.note(track.ready, name)
                if sandbox in self.launch:
                    track.warm[name] = self.launch[sandbox]

        await self.kube.watch(
            path, seen, await self.kube.resource_version(path), track.listed("gone")
        )

    async def _sandboxes(self) -> None:
        def seen(kind: str, sandbox: dict[str, Any]) -> None:
            launch = (sandbox["metadata"].get("labels") or {}).get(agent_sandbox.LAUNCH_TYPE_LABEL)
            if kind != "DELETED" and launch is not None:
                self.launch[sandbox["metadata"]["name"]] = launch == "warm"

        path = self.sandboxes
        await self.kube.watch(path, seen, await self.kube.resource_version(path))

    async def _pools(self) -> None:
        def seen(kind: str, pool: dict[str, Any]) -> None:
            if pool["metadata"]["name"] == POOL:
                ready = 0 if kind == "DELETED" else (pool.get("status") or {}).get("readyReplicas")
                self.track.pool_now(int(ready or 0))

        path = f"{self.base}/sandboxwarmpools"
        await self.kube.watch(path, seen, await self.kube.resource_version(path))

    def warm_of(self, name: str) -> bool | None:
        """Whether the claim was served warm, by its Sandbox's launch-type label."""
        sandbox = self.track.pod.get(name)
        return self.launch.get(sandbox) if sandbox else self.track.warm.get(name)


class SandstreamClaims:
    """sandstream: a template, a pool of it, and creates naming the template (claims)."""

    label = OURS

    def __init__(self, api: SandstreamApi) -> None:
        self.api, self.namespace = api, api.namespace
        self.track = ClaimTrack()
        self._members: dict[str, bool] = {}  # unclaimed member key -> Ready

    def pod_key(self, pod_name: str) -> str | None:
        return self.api.item_of(pod_name)  # the row's key: the member's, for a warm claim

    async def create_pool(self, size: int) -> None:
        spec = {"image": self.api.image, "command": COMMAND}
        await self.api.send("POST", "/v1/templates", (201,), json={"name": POOL, "spec": spec})
        body = {"name": POOL, "template": POOL, "size": size}
        await self.api.send("POST", "/v1/pools", (201,), json=body)

    async def delete_pool(self) -> None:
        await self.api.send("DELETE", f"/v1/pools/{POOL}", (200, 404))
        await self.api.send("DELETE", f"/v1/templates/{POOL}", (200, 204, 404))

    async def claim(self, name: str) -> None:
        body = {"name": name, "command_id": f"claim-{name}", "template": {"name": POOL}}
        answer = (await self.api.send("POST", "/v1/sandboxes", (200, 201, 202), json=body)).json()
        claim = answer.get("claim") or {}
        self.track.warm[name] = bool(claim.get("warm"))
        self.track.pod[name] = claim.get("member") or name
        if answer.get("phase") == "Ready":  # a warm claim's answer: the adopted member, Ready
            self.track.note(self.track.ready, name)

    async def release(self, name: str) -> None:
        await self.api.send("DELETE", f"/v1/sandboxes/{name}", (200, 202, 404))

    async def kafka_requests(self) -> dict[tuple[str, str], float]:
        """The Kafka requests ``up``'s clients sent so far, by (client, request type)."""
        return await self.api.kafka_requests()

    async def warm_up(self, connections: int) -> None:
        calls = [self.api.client.get(f"/v1/pools/{POOL}") for _ in range(connections)]
        await asyncio.gather(*calls)

    async def watch(self) -> None:
        last_id: str | None = None
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                async with self.api.client.stream(
                    "GET", "/v1/watch", headers=headers, timeout=httpx.Timeout(None, connect=10)
                ) as response:
                    buffer = ""
                    async for text in response.aiter_text():
                        events, buffer = sse_events(buffer + text)
                        for event, data in events:
                            if event == "sandbox":
                                row = json.loads(data)
                                last_id = str(row.get("change_seq", last_id))
                                self._seen(row)
            except (httpx.TransportError, httpx.StreamError):
                await asyncio.sleep(0.2)

    def _seen(self, row: dict[str, Any]) -> None:
        track, phase = self.track, row_phase(row)
        name, key = row["name"], row.get("member_key") or row["name"]
        if row.get("pool") == POOL and name == key:  # an unclaimed member of the pool
            if phase == "Deleted":
                self._members.pop(key, None)
            else:
                self._members[key] = phase == "Ready"
            track.pool_now(sum(self._members.values()))
            return
        if self._members.pop(key, None) is not None:  # adopted: it left the pool
            track.pool_now(sum(self._members.values()))
        if name not in track.requested:
            return
        track.pod.setdefault(name, key)
        if phase == "Ready":
            track.note(track.ready, name)
        elif phase == "Deleted":
            track.note(track.gone, name)


async def watch_claim_pods(kube: Kube, system: WarmSystem) -> None:
    """The Pods of the system's namespace, Running+Ready with an IP or not, by its key."""
    path = f"/api/v1/namespaces/{system.namespace}/pods"

    def seen(kind: str, pod: dict[str, Any]) -> None:
        key = system.pod_key(pod["metadata"]["name"])
        if key is not None:
            system.track.pod_seen(key, kind != "DELETED" and pod_ready(pod))

    await kube.watch(path, seen, await kube.resource_version(path))
