"""Request → decided outcome at low load (``python -m services.bench decided``).

A command that only changes the row (``:hold``, then ``:release``), sent one at a time through
the HTTP API with ``wait``, against the control plane as ``sandstream up`` runs it in one
process (processor, executor and watcher, here with the fake driver) on isolated topics and a
schema of its own. Each request is timed from send to the decided answer. Beside it, in the same
run and with the same client settings: Kafka's own round trip (the API's producer, acks=all, to
a consumer with the processor's fetch settings, one record at a time) and PostgreSQL's (a
``NOTIFY`` committed on one connection until another, listening, is woken).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import asyncpg
import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition

from drivers.fake import FakeDriver
from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.server import start_api
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.common.tokens import SCOPES, TokenStore
from services.localstack.isolation import isolated
from services.up.control_plane import ControlPlane

TOKEN = "sst_bench-admin"


def figures(ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100)
    return f"p50 {q[49]:6.1f}  p90 {q[89]:6.1f}  p99 {q[98]:6.1f} ms"


async def timed(n: int, once: Callable[[int], Awaitable[None]]) -> list[float]:
    """``once(i)`` for i in 0..n-1, one after the other: the milliseconds of each."""
    ms = []
    for i in range(n):
        began = time.perf_counter()
        await once(i)
        ms.append((time.perf_counter() - began) * 1000)
    return ms


async def api_round_trips(s: Settings, pool: asyncpg.Pool[asyncpg.Record], n: int) -> list[float]:
    """``n`` sequential hold/release requests with ``wait``, each until its decided answer."""
    plane = ControlPlane(s, FakeDriver(), pool, reconcile_interval=3600)
    await plane.start()
    publisher = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
    await publisher.__aenter__()
    app = create_app(s, pool, publisher, TokenStore.of(admin=(TOKEN, *SCOPES)))
    server = await start_api(app, "127.0.0.1", 0, access_log=False)
    try:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as client:
            body = {"name": "bench", "spec": {"image": "registry.example/agent:1"}}
            created = await client.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert created.status_code == 201, created.text

            async def hold_or_release(i: int) -> None:
                verb, body = ("hold", {"reason": "bench"}) if i % 2 == 0 else ("release", {})
                answer = await client.post(
                    f"/v1/sandboxes/bench:{verb}", params={"wait": 10}, json=body
                )
                decided = answer.json().get("status") in ("accepted", "rejected")
                assert answer.status_code == 200 and decided, answer.text

            await timed(10, hold_or_release)  # warm-up: connections, plans, caches
            return await timed(n, hold_or_release)
    finally:
        await server.stop()
        await publisher.__aexit__()
        await plane.stop()


async def kafka_round_trips(s: Settings, n: int) -> list[float]:
    """Kafka's own: the API's producer to a consumer with the processor's fetch settings."""
    publisher = CommandPublisher(kafka_client_args(s, "api"), topic=s.topic_commands)
    await publisher.__aenter__()
    consumer = AIOKafkaConsumer(
        **kafka_client_args(s, "audit"),
        enable_auto_commit=False,
        fetch_max_wait_ms=s.processor_fetch_max_wait_ms,
    )
    await consumer.start()
    try:
        partitions = [TopicPartition(s.topic_commands, p) for p in range(s.kafka_partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)
        producer = publisher.producer

        async def produce_consume(i: int) -> None:
            value = json.dumps({"n": i}).encode()
            await producer.send_and_wait(s.topic_commands, value=value, key=b"bench")
            seen = False
            while not seen:
                polled = await consumer.getmany(timeout_ms=1000)
                seen = any(r.value == value for rs in polled.values() for r in rs)

        await timed(10, produce_consume)
        return await timed(n, produce_consume)
    finally:
        await consumer.stop()
        await publisher.__aexit__()


async def notify_round_trips(s: Settings, n: int) -> list[float]:
    """PostgreSQL's own: a committed ``NOTIFY`` until a listening connection is woken."""
    channel = f"bench_{uuid.uuid4().hex[:8]}"
    sender = await asyncpg.connect(s.pg_dsn)
    listener = await asyncpg.connect(s.pg_dsn)
    woken = asyncio.Event()
    await listener.add_listener(channel, lambda *_: woken.set())
    try:

        async def notify(_: int) -> None:
            woken.clear()
            await sender.execute(f"NOTIFY {channel}")
            await woken.wait()

        await timed(10, notify)
        return await timed(n, notify)
    finally:
        await listener.close()
        await sender.close()


async def decided_figures(settings: Settings, n: int) -> None:
    async with isolated(settings, "bench") as (s, pool):
        api = await api_round_trips(s, pool, n)
        kafka = await kafka_round_trips(s, n)
        notify = await notify_round_trips(s, n)
    print(
        f"decided     {n} sequential :hold/:release with wait, request -> decided outcome\n"
        f"            API            {figures(api)}\n"
        f"            Kafka alone    {figures(kafka)}   (produce acks=all -> consume)\n"
        f"            NOTIFY alone   {figures(notify)}   (commit -> listener woken)\n"
        f"            p50 ratio to Kafka's {statistics.median(api) / statistics.median(kafka):.1f}"
    )
