"""Creates at a steady rate, each timed from its send until its row shows what is waited for,
beside Kafka's own produce → consume latency for the same records in the same run.

A row is looked for when the processor's per-batch NOTIFY says a batch committed; Kafka's own
figure is a plain, group-less consumer of the commands topic noting when each record arrives.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from events.codec import encode
from events.commands import CreateSandbox
from events.topics import CHANGES_CHANNEL
from services.bench.workload import SPEC, T0
from services.common.kafka_clients import kafka_client_args
from services.common.notify_channels import listen
from services.common.settings import Settings

# The keys among $1 whose row exists (the create decided), or is Ready (launched and seen).
ROW = "SELECT key FROM sandboxes WHERE key = ANY($1)"
READY = "SELECT key FROM sandboxes WHERE key = ANY($1) AND phase = 'Ready'"


@dataclass(frozen=True)
class Steady:
    rate: int  # asked
    sent_rate: float  # achieved
    ms: list[float]  # send → row, sorted, of those seen
    kafka_ms: list[float]  # send → Kafka's own reader has it, sorted
    count: int

    def p(self, q: int, kafka: bool = False) -> float:
        values = self.kafka_ms if kafka else self.ms
        if len(values) < 2:
            return values[0] if values else float("nan")
        return statistics.quantiles(values, n=100)[q - 1]

    def __str__(self) -> str:
        return (
            f"{len(self.ms)}/{self.count} at {self.rate}/s (sent {self.sent_rate:,.0f}/s): "
            f"p50 {self.p(50):.1f} ms  p99 {self.p(99):.1f} ms  |  Kafka alone p50 "
            f"{self.p(50, True):.1f} ms  p99 {self.p(99, True):.1f} ms"
        )


async def steady_creates(
    s: Settings, rate: int, seconds: float, prefix: str, done_sql: str, wait: float = 60
) -> Steady:
    """``rate`` creates a second for ``seconds`` (keys ``prefix``-i), each timed until
    ``done_sql`` returns its key; those not done within ``wait`` s of the last send are left
    out (the count says so)."""
    count = max(1, int(rate * seconds))
    sent: dict[str, float] = {}
    pending: set[str] = set()  # sent, not done yet (kept small: no scans of `sent`)
    done: dict[str, float] = {}
    arrived: dict[str, float] = {}
    finished = asyncio.Event()
    session = {"search_path": s.pg_schema}
    listener = await asyncpg.connect(s.pg_dsn, server_settings=session)
    reader = await asyncpg.connect(s.pg_dsn, server_settings=session)
    woken = asyncio.Event()
    await listen(listener, CHANGES_CHANNEL, lambda *_: woken.set())
    producer = AIOKafkaProducer(
        **kafka_client_args(s, "api"), enable_idempotence=True, acks="all", linger_ms=0
    )
    await producer.start()
    tail = await _tail_reader(s)
    tasks = [
        asyncio.create_task(_collect(reader, done_sql, pending, done, woken, finished)),
        asyncio.create_task(_note_arrivals(tail, arrived, finished)),
    ]
    try:
        payloads = [(f"{prefix}-{i}", encode(create(f"{prefix}-{i}"))) for i in range(count)]
        begin = time.perf_counter()
        for i, (key, payload) in enumerate(payloads):
            if (delay := begin + i / rate - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            sent[key] = time.perf_counter()
            pending.add(key)
            await producer.send(s.topic_commands, value=payload, key=key.encode())
        sent_rate = count / max(time.perf_counter() - begin, 1 / rate)  # before the flush
        await producer.flush()
        deadline = time.perf_counter() + wait
        while len(done) < count and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
    finally:
        finished.set()
        woken.set()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        await tail.stop()
        await producer.stop()
        await listener.close()
        await reader.close()
    ms = sorted((done[k] - sent[k]) * 1000 for k in done)
    kafka_ms = sorted((arrived[k] - sent[k]) * 1000 for k in arrived if k in sent)
    return Steady(rate, sent_rate, ms, kafka_ms, count)


def create(key: str) -> CreateSandbox:
    return CreateSandbox(type="CreateSandbox", command_id=f"{key}-c", key=key, spec=SPEC,
                         occurred_at=T0, actor="bench")  # fmt: skip


async def _collect(
    reader: asyncpg.Connection[asyncpg.Record],
    done_sql: str,
    pending: set[str],
    done: dict[str, float],
    woken: asyncio.Event,
    finished: asyncio.Event,
) -> None:
    while not finished.is_set():
        await woken.wait()
        woken.clear()
        seen_at = time.perf_counter()
        for row in await reader.fetch(done_sql, list(pending)):
            pending.discard(row["key"])
            done.setdefault(row["key"], seen_at)


async def _tail_reader(s: Settings) -> AIOKafkaConsumer:
    """A group-less consumer of the commands topic, positioned at its end."""
    reader = AIOKafkaConsumer(
        **kafka_client_args(s, "audit"),
        enable_auto_commit=False,
        fetch_max_wait_ms=s.processor_fetch_max_wait_ms,
    )
    await reader.start()
    parts = [TopicPartition(s.topic_commands, p) for p in range(s.kafka_partitions)]
    reader.assign(parts)
    await reader.seek_to_end(*parts)
    for tp in parts:  # resolve the end offsets now, before anything is sent
        await reader.position(tp)
    return reader


async def _note_arrivals(
    reader: AIOKafkaConsumer, arrived: dict[str, float], finished: asyncio.Event
) -> None:
    while not finished.is_set():
        batch = await reader.getmany(timeout_ms=100)
        seen_at = time.perf_counter()
        for records in batch.values():
            for record in records:
                if record.key is not None:
                    arrived.setdefault(record.key.decode(), seen_at)
