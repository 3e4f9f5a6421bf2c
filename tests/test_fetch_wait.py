"""The processor's fetches wait long at the broker only when that delays nothing: an idle
processor fetches every ``processor_idle_fetch_max_wait_ms`` with all its partitions (any new
record returns the fetch at once), and a fetch that leaves out a partition whose records are
still buffered waits at most ``processor_fetch_max_wait_ms``. Checked on the fetch requests a
real consumer sends to the real broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from harness import eventually, isolated_env

from services.common.kafka_clients import kafka_client_args
from services.processor.fetch_wait import adapt_fetch_wait

BUSY_MS, IDLE_MS = 50, 400


@dataclass
class Fetch:
    wait_ms: int
    partitions: set[tuple[str, int]]


@dataclass
class Sent:
    """The fetch requests a consumer's client sends, in order."""

    fetches: list[Fetch] = field(default_factory=list)

    def watch(self, consumer: AIOKafkaConsumer) -> None:
        client: Any = consumer._client
        send = client.send

        async def recording(node_id: int, request: Any, *args: Any, **kwargs: Any) -> Any:
            if type(request).__name__ == "FetchRequest":
                parts = {(t, p[0]) for t, ps in request._topics for p in ps}
                self.fetches.append(Fetch(request._max_wait_ms, parts))
            return await send(node_id, request, *args, **kwargs)

        client.send = recording

    def after(self, count: int) -> list[Fetch]:
        return self.fetches[count:]


async def test_an_idle_processor_fetches_every_partition_with_the_idle_wait() -> None:
    async with isolated_env(
        partitions=3, processor_fetch_max_wait_ms=BUSY_MS, processor_idle_fetch_max_wait_ms=IDLE_MS
    ) as env:
        processor = await env.start_processor()
        assert processor.consumer is not None
        sent = Sent()
        sent.watch(processor.consumer)
        await eventually(lambda: len(sent.fetches), lambda n: n >= 3, what="three fetches")
        s = env.settings
        every = {(t, p) for t in (s.topic_commands, s.topic_observations) for p in range(3)}
        assert [f.wait_ms for f in sent.fetches] == [IDLE_MS] * len(sent.fetches)
        assert all(f.partitions == every for f in sent.fetches), sent.fetches


@asynccontextmanager
async def adapted_consumer(settings: Any, tps: list[TopicPartition]) -> AsyncIterator[Any]:
    consumer = AIOKafkaConsumer(**kafka_client_args(settings, "audit"), enable_auto_commit=False)
    await consumer.start()
    try:
        adapt_fetch_wait(consumer, busy_ms=BUSY_MS, idle_ms=IDLE_MS)
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        yield consumer
    finally:
        await consumer.stop()


async def test_a_fetch_leaving_out_a_buffered_partition_waits_the_short_wait() -> None:
    async with isolated_env(partitions=2) as env:
        topic = env.settings.topic_commands
        tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
        async with adapted_consumer(env.settings, tps) as consumer:
            sent = Sent()
            sent.watch(consumer)
            await eventually(lambda: len(sent.fetches), lambda n: n >= 1, what="a fetch")
            seen = len(sent.fetches)
            await env.produce_to(topic, 0, b"k", b"v")
            # The fetch that returned the record is followed by one without partition 0 (its
            # record is buffered until taken): that one waits the short wait.
            later = await eventually(
                lambda: sent.after(seen),
                lambda fs: any(f.partitions == {(topic, 1)} for f in fs),
                what="a fetch without the buffered partition",
            )
            for fetch in later:
                if fetch.partitions == {(topic, 1)}:
                    assert fetch.wait_ms == BUSY_MS, later
            taken = await consumer.getmany(timeout_ms=10_000)
            assert [r.value for r in taken[tps[0]]] == [b"v"]
            # Once taken, nothing is buffered: the next fetches hold both partitions, idle.
            seen = len(sent.fetches)
            await eventually(
                lambda: sent.after(seen), lambda fs: len(fs) >= 2, what="two more fetches"
            )
            assert sent.after(seen)[-1] == Fetch(IDLE_MS, {(topic, 0), (topic, 1)})
