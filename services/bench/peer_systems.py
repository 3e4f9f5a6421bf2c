"""The three systems the peer benchmark compares (services/bench/peer.py runs it), each as the
load generator sees it: how a sandbox is asked for and deleted, how its Ready and its going
are reported, and which Pod is whose; and the Track of when each of those happened.

- **bare Pods**: the load generator creates the Pods itself: the cluster's own floor;
- **agent-sandbox**: Sandbox objects; its controller makes a Pod of the same name for each;
- **sandstream**: sandboxes through sandstream's HTTP API; Ready and gone as its watch
  (server-sent events) shows the rows.

Every system gets the same Pod: the one sandstream's Kubernetes driver makes for the spec.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

import httpx

from drivers.kube_objects import PodSettings, pod_manifest
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.bench.peer_kube import REQUEST_TIMEOUT, Kube
from services.bench.peer_stats import (
    pod_ready,
    request_counts,
    row_phase,
    sandbox_ready,
    sse_events,
)
from services.localstack import agent_sandbox

CONNECTIONS = 50  # the load generator's connections per system
COMMAND = ["sleep", "3600"]
FLOOR, PEER, OURS = "bare Pods", "agent-sandbox", "sandstream"


def pod_spec(image: str) -> dict[str, Any]:
    """The Pod spec sandstream's driver makes for a sandbox of ``image`` running ``sleep``
    (without its per-sandbox hostname and identity variables): what all three systems get."""
    launch = LaunchSpec(
        key="template",
        sandbox_id=UUID(int=0),
        generation=1,
        identity="rid-template",
        spec=SandboxSpec(image=image, command=COMMAND),
    )
    spec: dict[str, Any] = dict(pod_manifest(launch, PodSettings())["spec"])
    spec.pop("hostname", None)
    spec["containers"] = [{k: v for k, v in c.items() if k != "env"} for c in spec["containers"]]
    return spec


# ------------------------------------------------------------------------------ tracking


@dataclass
class Track:
    """When each sandbox was asked for, reported Ready, seen Ready as a Pod, asked to go,
    reported gone, seen gone as a Pod (perf_counter seconds)."""

    requested: dict[str, float] = field(default_factory=dict)
    answered: dict[str, float] = field(default_factory=dict)  # the create request's answer
    ready: dict[str, float] = field(default_factory=dict)
    pod_ready: dict[str, float] = field(default_factory=dict)
    deleting: dict[str, float] = field(default_factory=dict)
    delete_answered: dict[str, float] = field(default_factory=dict)  # the delete's answer
    gone: dict[str, float] = field(default_factory=dict)
    pod_gone: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def note(self, table: dict[str, float], name: str) -> None:
        if name not in table:
            table[name] = time.perf_counter()
            self.changed.set()

    def listed(
        self, *tables: str | None, name_of: Callable[[str], str | None] = lambda n: n
    ) -> Callable[[list[dict[str, Any]]], None]:
        """For a watch listed again: what is asked to go and is not in the list is gone (its
        deletion fell in the gap); noted in the ``tables`` named."""

        def gone(items: list[dict[str, Any]]) -> None:
            present = {name_of(i["metadata"]["name"]) for i in items}
            for name in [n for n in self.deleting if n not in present]:
                for table in tables:
                    if table is not None:
                        self.note(getattr(self, table), name)

        return gone

    def settled(self, names: Iterable[str], table: Mapping[str, float]) -> bool:
        """Every one of ``names`` is in ``table``, or its request failed."""
        return all(n in table or n in self.failed for n in names)

    def all_gone(self, names: Iterable[str]) -> bool:
        """Every one of ``names`` gone, or its request failed (so it never will be)."""
        return self.settled(names, self.gone_at())

    def gone_at(self) -> dict[str, float]:
        """Gone: reported so and the Pod gone, whichever came last."""
        return {n: max(t, self.pod_gone[n]) for n, t in self.gone.items() if n in self.pod_gone}

    async def until(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while not done():
            self.changed.clear()
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except TimeoutError:
                return done()
        return True


class System(Protocol):
    label: str
    namespace: str

    def item_of(self, pod_name: str) -> str | None: ...
    async def create(self, name: str) -> None: ...
    async def delete(self, name: str) -> None: ...
    async def watch(self, track: Track) -> None: ...


class BarePods:
    """The load generator creates the Pods itself: the Pod's own state is the report."""

    label = FLOOR

    def __init__(self, kube: Kube, namespace: str, spec: dict[str, Any]) -> None:
        self.kube, self.namespace, self.spec = kube, namespace, spec
        self.path = f"/api/v1/namespaces/{namespace}/pods"

    def item_of(self, pod_name: str) -> str | None:
        return pod_name

    async def create(self, name: str) -> None:
        await self.kube.create(
            self.path, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                        "spec": self.spec}
        )  # fmt: skip

    async def delete(self, name: str) -> None:
        await self.kube.delete(f"{self.path}/{name}")

    async def watch(self, track: Track) -> None:
        return  # the Pod watch every system has notes Ready and gone for this one


class AgentSandboxes:
    """Sandbox objects; agent-sandbox's controller makes a Pod of the same name for each."""

    label = PEER

    def __init__(self, kube: Kube, namespace: str, spec: dict[str, Any]) -> None:
        self.kube, self.namespace, self.spec = kube, namespace, spec
        api = f"{agent_sandbox.GROUP}/{agent_sandbox.API_VERSION}"
        self.api_version = api
        self.path = f"/apis/{api}/namespaces/{namespace}/sandboxes"

    def item_of(self, pod_name: str) -> str | None:
        return pod_name

    async def create(self, name: str) -> None:
        await self.kube.create(
            self.path,
            {"apiVersion": self.api_version, "kind": "Sandbox", "metadata": {"name": name},
             "spec": {"podTemplate": {"spec": self.spec}}},
        )  # fmt: skip

    async def delete(self, name: str) -> None:
        await self.kube.delete(f"{self.path}/{name}")

    async def watch(self, track: Track) -> None:
        def seen(kind: str, sandbox: dict[str, Any]) -> None:
            name = sandbox["metadata"]["name"]
            if kind == "DELETED":
                track.note(track.gone, name)
            elif sandbox_ready(sandbox):
                track.note(track.ready, name)

        await self.kube.watch(
            self.path, seen, await self.kube.resource_version(self.path), track.listed("gone")
        )


# Idle connections dropped before uvicorn's 5 s closes them under a request.
LIMITS = httpx.Limits(
    max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS, keepalive_expiry=2.0
)


class SandstreamApi:
    """Sandboxes created and deleted through sandstream's HTTP API; Ready and gone as its
    watch (server-sent events) shows the rows."""

    label = OURS

    def __init__(self, url: str, token: str, namespace: str, image: str) -> None:
        self.namespace, self.image = namespace, image
        self.client = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            limits=LIMITS,
            timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10.0),
        )

    def item_of(self, pod_name: str) -> str | None:
        # drivers/kube_objects.pod_name: sandstream-<key>-g<generation>
        if not pod_name.startswith("sandstream-"):
            return None
        return pod_name.removeprefix("sandstream-").rpartition("-g")[0] or None

    async def create(self, name: str) -> None:
        # A command id of its own: a create sent again is the same command, not a second one.
        body = {"name": name, "command_id": f"create-{name}",
                "spec": {"image": self.image, "command": COMMAND}}  # fmt: skip
        await self.send("POST", "/v1/sandboxes", (200, 201, 202), json=body)

    async def delete(self, name: str) -> None:
        await self.send("DELETE", f"/v1/sandboxes/{name}", (200, 202, 404))

    async def send(
        self, method: str, path: str, ok: tuple[int, ...], **kwargs: Any
    ) -> httpx.Response:
        """Sent again once after a dropped connection (one the server closed while it sat
        idle: uvicorn closes them after 5 s, and a burst's deletes follow a long wait for
        Ready); both requests are idempotent."""
        for attempt in (1, 2):
            try:
                response = await self.client.request(method, path, **kwargs)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
                if attempt == 2:
                    raise
        if response.status_code not in ok:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        return response

    async def kafka_requests(self) -> dict[tuple[str, str], float]:
        """The Kafka requests ``up``'s clients sent so far, by (client, request type)."""
        text = (await self.send("GET", "/metrics", (200,))).text
        return request_counts(text, "sandstream_kafka_requests_total", ("client", "request"))

    async def watch(self, track: Track) -> None:
        last_id: str | None = None
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                async with self.client.stream(
                    "GET", "/v1/watch", headers=headers, timeout=httpx.Timeout(None, connect=10)
                ) as response:
                    buffer = ""
                    async for text in response.aiter_text():
                        events, buffer = sse_events(buffer + text)
                        for event, data in events:
                            if event != "sandbox":
                                continue
                            row = json.loads(data)
                            last_id = str(row.get("change_seq", last_id))
                            phase = row_phase(row)
                            if phase == "Ready":
                                track.note(track.ready, row["name"])
                            elif phase == "Deleted":
                                track.note(track.gone, row["name"])
            except (httpx.TransportError, httpx.StreamError):
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        await self.client.aclose()


async def watch_pods(kube: Kube, system: System, track: Track, reports: bool) -> None:
    """The Pods of the system's namespace: Running+Ready with an IP, and gone (``reports``:
    these are the system's own reports too)."""
    path = f"/api/v1/namespaces/{system.namespace}/pods"

    def seen(kind: str, pod: dict[str, Any]) -> None:
        name = system.item_of(pod["metadata"]["name"])
        if name is None:
            return
        if kind == "DELETED":
            track.note(track.pod_gone, name)
            if reports:
                track.note(track.gone, name)
        elif pod_ready(pod):
            track.note(track.pod_ready, name)
            if reports:
                track.note(track.ready, name)

    listed = track.listed("pod_gone", "gone" if reports else None, name_of=system.item_of)
    await kube.watch(path, seen, await kube.resource_version(path), listed)
