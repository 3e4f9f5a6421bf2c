"""The checker's workload: random lifecycle commands through the HTTP API and observations
straight onto the observations topic, from a seed, on sandboxes of the shared fake (``cx-N``)
and a few on real Podman (named with the run's Podman prefix).

The seed pins the sequence of choices each worker makes; which command meets which fault is
up to the timing. Every command the checker sends is recorded with the API's answer, so the
end checks know what was acknowledged (2xx), what was refused and what got no answer.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
from aiokafka import AIOKafkaProducer

from events.codec import encode
from events.observations import RuntimeRemoved, RuntimeSnapshot
from services.common.settings import Settings

LIFECYCLE = ("stop", "start", "restart", "delete")
ACKNOWLEDGED = (200, 201, 202)
ACTOR = "chaos-observer"


@dataclass
class Sent:
    """One command the checker sent (retries with the same id update it)."""

    command_id: str
    key: str
    kind: str
    status: int | None = None  # the last answer: None when there was none (a timeout)
    acknowledged: bool = False  # some attempt got a 2xx


@dataclass
class Workload:
    settings: Settings
    client: httpx.AsyncClient
    producer: AIOKafkaProducer
    seed: int
    sandboxes: int  # on the shared fake
    podman: int = 0  # on real Podman: named with ``podman_prefix`` (drivers/routing.py)
    podman_prefix: str = "cxp-"
    image: str = "localhost/sandstream-base:1"
    sent: dict[str, Sent] = field(default_factory=dict)
    observations: list[tuple[bytes, bytes]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    _busy: set[str] = field(default_factory=set)
    _created: set[str] = field(default_factory=set)

    @property
    def names(self) -> list[str]:
        return [f"cx-{i}" for i in range(self.sandboxes)] + self.podman_names

    @property
    def podman_names(self) -> list[str]:
        return [f"{self.podman_prefix}{i}" for i in range(self.podman)]

    async def run(self, stop: asyncio.Event, workers: int = 6) -> None:
        await asyncio.gather(*(self._worker(stop, i) for i in range(workers)))

    async def _worker(self, stop: asyncio.Event, index: int) -> None:
        rng = random.Random(f"{self.seed}-{index}")
        while not stop.is_set():
            key = rng.choice(self.names)
            if key in self._busy:
                await asyncio.sleep(0)
                continue
            self._busy.add(key)
            try:
                await self._step(rng, key)
            finally:
                self._busy.discard(key)

    async def _step(self, rng: random.Random, key: str) -> None:
        if key not in self._created:
            await self._command(rng, key, "create")
            return
        roll = rng.random()
        if roll < 0.08:
            await self._late_observation(key)
        elif roll < 0.13 and self.observations:
            await self._publish_observation(*rng.choice(self.observations), "duplicate")
        elif roll < 0.18:
            await self._retry(rng, key)
        else:
            kind = rng.choices(LIFECYCLE, weights=(3, 3, 2, 1))[0]
            await self._command(rng, key, kind)

    async def send(self, key: str, kind: str) -> bool:
        """One command outside the seeded workers (the end's probe), recorded like theirs;
        whether the API acknowledged it."""
        cid = f"chaos-{self.seed}-probe-{len(self.sent)}"
        await self._command(random.Random(), key, kind, cid)
        return self.sent[cid].acknowledged

    async def _command(self, rng: random.Random, key: str, kind: str, cid: str = "") -> None:
        cid = cid or f"chaos-{self.seed}-{uuid.UUID(int=rng.getrandbits(128)).hex[:16]}"
        sent = self.sent.setdefault(cid, Sent(cid, key, kind))
        self.counts[f"command {kind}"] += 1
        try:
            if kind == "create":
                spec = {"image": self.image, "command": ["sleep", "3600"]}
                body = {"name": key, "spec": spec, "command_id": cid}
                response = await self.client.post("/v1/sandboxes", json=body)
            elif kind == "delete":
                response = await self.client.request(
                    "DELETE", f"/v1/sandboxes/{key}", json={"command_id": cid}
                )
            else:
                response = await self.client.post(f"/v1/sandboxes/{key}:{kind}", json={
                    "command_id": cid})  # fmt: skip
        except httpx.HTTPError:
            sent.status = None
            self.counts["no answer"] += 1
            return
        sent.status = response.status_code
        if response.status_code in ACKNOWLEDGED:
            sent.acknowledged = True
            if kind == "create":
                self._created.add(key)
            elif kind == "delete":
                self._created.discard(key)
        else:
            self.counts[f"answer {response.status_code}"] += 1

    async def _retry(self, rng: random.Random, key: str) -> None:
        """A client retry: the same command id again (one that got no answer, or any)."""
        earlier = [s for s in self.sent.values() if s.key == key and s.kind != "create"]
        unanswered = [s for s in earlier if not s.acknowledged]
        pick = unanswered or earlier
        if pick:
            sent = rng.choice(pick)
            self.counts["retry"] += 1
            await self._command(rng, key, sent.kind, sent.command_id)

    async def _late_observation(self, key: str) -> None:
        """An observation of an older generation arriving after a newer one was decided (a
        slow watcher): true of the past, stale now."""
        try:
            response = await self.client.get(f"/v1/sandboxes/{key}")
        except httpx.HTTPError:
            return
        if response.status_code != 200 or response.json().get("generation", 0) < 2:
            return
        generation = response.json()["generation"] - 1
        now = datetime.now(UTC)
        oid = f"chaos-late:{key}:{generation}:{uuid.uuid4().hex[:8]}"
        observation: RuntimeSnapshot | RuntimeRemoved
        if len(self.observations) % 2:
            observation = RuntimeSnapshot(type="RuntimeSnapshot", observation_id=oid, key=key,
                generation=generation, occurred_at=now, actor=ACTOR, state="exited",
                exit_code=143)  # fmt: skip
        else:
            observation = RuntimeRemoved(type="RuntimeRemoved", observation_id=oid, key=key,
                generation=generation, occurred_at=now, actor=ACTOR)  # fmt: skip
        record = (key.encode(), encode(observation))
        self.observations.append(record)
        await self._publish_observation(*record, "late")

    async def _publish_observation(self, key: bytes, value: bytes, what: str) -> None:
        try:
            await asyncio.wait_for(
                self.producer.send_and_wait(self.settings.topic_observations, value, key), 30
            )
        except Exception:
            return
        self.counts[f"observation {what}"] += 1
