"""The provider outbox on the real stack (Kafka, PostgreSQL, the processor, the fake driver):
the commands a provider change owes its sandboxes are stored with the change and sent until
Kafka acknowledges them.

An API whose Kafka never takes a command (it publishes to a topic that does not exist, which
Kafka refuses as it refuses a topic its principal may not write) answers a rotation and a
forced delete with the commands `pending`; they stay stored, its relay counts the failed
attempts, and two other API replicas (services of their own over a working producer) both
send them: the processor decides the first and takes the second for a duplicate (as it does a
late copy from a producer that outlived an outage), so each sandbox restarts once.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from typing import Any

import apikit
import factories as f
from apikit import unique
from harness import Env, eventually
from pydantic import SecretStr

from drivers.fake import FakeDriver
from events.codec import encode
from events.commands import DetachProvider, ProviderRotation, RotateCredentials
from events.publisher import CommandPublisher, now
from events.topics import MAX_INPUT_BYTES
from services.api import provider_outbox
from services.api.gateway import CommandGateway
from services.api.providers import ProviderService
from services.api.readmodel import ChangeFeed

KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
SETTINGS = {"credentials_key": KEY, "provider_outbox_seconds": 0.2}


async def test_commands_kafka_did_not_take_are_pending_and_each_lands_once() -> None:
    p, ready, stopped = unique("relay-p"), unique("relay-r"), unique("relay-s")
    async with apikit.running_api(
        FakeDriver(),
        settings_update=SETTINGS,
        publish_timeout=0.5,
        topic_override=f"missing-{unique()}",
    ) as api:
        env = api.env
        async with await env.publisher() as publisher:
            for name in (ready, stopped):
                await publisher.publish(f.create(name, providers=[p], occurred_at=now()))
            await api.wait_phase(stopped, "Ready")
            await publisher.publish(f.stop(stopped, occurred_at=now()))
        await api.wait_phase(ready, "Ready")
        await api.wait_phase(stopped, "Stopped")

        async with api.client() as c:
            r = await c.post("/v1/providers", json={"name": p, "credentials": {"K": "one"}})
            assert r.status_code == 201, r.text
            r = await c.put(f"/v1/providers/{p}/credentials", json={"credentials": {"K": "two"}})
            assert r.status_code == 200, r.text
            receipt = r.json()
        lines = {line["sandbox"]: line for line in receipt["sandboxes"]}
        assert (lines[ready]["action"], lines[stopped]["action"]) == ("restart", "skip")
        assert {line["delivery"] for line in lines.values()} == {"pending"}
        assert sorted(receipt["unsent"]) == sorted(line["command_id"] for line in lines.values())

        # Stored with the values; this API's relay keeps trying (and failing) meanwhile.
        await eventually(
            lambda: env.fetch("SELECT command_id, attempts FROM provider_outbox"),
            lambda rows: len(rows) == 2 and all(r["attempts"] >= 2 for r in rows),
            what="the stored commands tried again by the failing API's relay",
        )
        assert (await history_types(api, ready)).count("AgentRestarted") == 0

        # Two more replicas with a working producer: both send every stored command.
        async with await env.publisher() as b_pub, await env.publisher() as c_pub:
            replicas = [replica(env, pub) for pub in (b_pub, c_pub)]
            due = [await provider_outbox.due(env.pool, 0) for _ in replicas]
            assert [sorted(c.command_id for c in d) for d in due] == [sorted(receipt["unsent"])] * 2
            sent = await asyncio.gather(*(s.send(c) for s, c in zip(replicas, due, strict=True)))
            assert sent == [[], []]
            # And a late copy, as a producer that outlived the outage would deliver it.
            late = next(c for c in due[0] if c.key == ready)
            await b_pub.publish(late)
        await eventually(lambda: history_types(api, stopped),
                         lambda types: "AgentRestartSkipped" in types,
                         what=f"{stopped} skipped")  # fmt: skip
        await api.wait_phase(ready, "Ready")
        copies = await eventually(lambda: api.env.fetch(
            "SELECT disposition FROM history WHERE key = $1 AND message_type = 'RotateCredentials'",
            ready), lambda rows: len(rows) >= 2 and not any(r["disposition"] not in
                                                            ("applied", "duplicate") for r in rows),
            what="every copy decided")  # fmt: skip
        assert sorted({r["disposition"] for r in copies}) == ["applied", "duplicate"]
        assert [r["disposition"] for r in copies].count("applied") == 1
        assert (await history_types(api, ready)).count("AgentRestarted") == 1
        row = await env.fetch("SELECT generation FROM sandboxes WHERE key = $1", ready)
        assert row[0]["generation"] == 2
        assert await provider_outbox.pending(env.pool) == 0

        # A forced delete's detaches: stored with the delete, pending, sent by a replica.
        async with api.client() as c:
            r = await c.delete(f"/v1/providers/{p}", params={"force": "true"})
        assert r.status_code == 200, r.text
        assert sorted(r.json()["detached"]) == sorted([ready, stopped])
        assert len(r.json()["unsent"]) == 2
        async with await env.publisher() as b_pub:
            assert await replica(env, b_pub).send(await provider_outbox.due(env.pool, 0)) == []
        for name in (ready, stopped):
            await eventually(
                lambda n=name: env.fetch("SELECT providers FROM sandboxes WHERE key = $1", n),
                lambda rows: list(rows[0]["providers"]) == [],
                what=f"{p} detached from {name}",
            )


def replica(env: Env, publisher: CommandPublisher) -> ProviderService:
    """Another API replica's provider service: the same database, a producer of its own."""
    return ProviderService(
        env.settings, env.pool, CommandGateway(env.pool, publisher, ChangeFeed(env.pool))
    )


async def history_types(api: apikit.Api, name: str) -> list[str]:
    rows: list[Any] = await api.env.fetch(
        "SELECT event_types FROM history WHERE key = $1 ORDER BY id", name
    )
    return [t for r in rows for t in (r["event_types"] or [])]


def test_the_largest_outbox_command_is_far_below_the_processors_input_limit() -> None:
    """The outbox holds names and revisions, never a provider's values: its largest command
    (a rotation of 64 providers with the longest names, ids and actor) is a few kilobytes, so
    the gateway's size refusal (a command above ``processor_max_input_bytes``) can never keep
    one stored for ever, however large the values written."""
    common: dict[str, Any] = {
        "command_id": "c" * 128,
        "key": "s" * 63,
        "occurred_at": now(),
        "actor": "\U0001f600" * 200,
    }
    rotations = [
        ProviderRotation(provider=f"{i:02d}" + "p" * 126, revision=2**62) for i in range(64)
    ]
    rotate = RotateCredentials(type="RotateCredentials", rotations=rotations, **common)
    detach = DetachProvider(type="DetachProvider", provider="p" * 128, **common)
    assert max(len(encode(rotate)), len(encode(detach))) < 16 * 1024 < MAX_INPUT_BYTES
