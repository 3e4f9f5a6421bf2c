"""The driver watcher reads its stream ahead while a publish is in flight and sends what
arrived meanwhile in one Kafka request, keeping each sandbox's observations in order and one
at a time (real Kafka; a stub driver whose stream is given)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import factories as f
from aiokafka import AIOKafkaConsumer
from harness import eventually, isolated_env
from prometheus_client import REGISTRY

from drivers.protocol import Driver
from events.codec import OBSERVATIONS, decode
from events.observations import Observation
from events.publisher import RenewingProducer
from services.common.kafka_clients import kafka_client_args
from services.executor.watcher import Queued, Watcher, _batch, _End

CLIENT = "sandstream-watcher-test"


class Given:
    """A driver whose watch stream yields ``observations``, then stays open."""

    def __init__(self, observations: list[Observation]) -> None:
        self.observations = observations

    async def watch(self) -> AsyncIterator[Observation]:
        for observation in self.observations:
            yield observation
        await asyncio.Event().wait()


def produces() -> float:
    labels = {"client": CLIENT, "request": "Produce"}
    return REGISTRY.get_sample_value("sandstream_kafka_requests_total", labels) or 0.0


def test_a_batch_ends_before_a_second_observation_of_a_sandbox_and_at_the_streams_end() -> None:
    a1, b1, a2, c1 = f.running("a"), f.running("b"), f.exited("a"), f.running("c")
    queue: asyncio.Queue[Queued] = asyncio.Queue()
    for item in (b1, a2, c1):
        queue.put_nowait(item)
    assert _batch(a1, queue) == ([a1, b1], a2)
    assert _batch(a2, queue) == ([a2, c1], None)
    end = _End()
    queue.put_nowait(end)
    assert _batch(c1, queue) == ([c1], end)


async def test_observations_queued_behind_a_publish_go_out_together_in_order() -> None:
    async with isolated_env(partitions=2) as env:
        s = env.settings
        sent = [f.running(f"sb-{i}") for i in range(20)] + [f.exited("sb-0"), f.removed("sb-0")]
        producer = RenewingProducer(kafka_client_args(s, "watcher", CLIENT))
        await producer.start()
        reader = AIOKafkaConsumer(
            s.topic_observations, **kafka_client_args(s, "audit"), auto_offset_reset="earliest"
        )
        await reader.start()
        stop = asyncio.Event()
        before = produces()
        watcher = Watcher(cast(Driver, Given(sent)), producer, s)
        task = asyncio.create_task(watcher.run(stop))
        got: list[Any] = []

        async def read() -> int:
            for records in (await reader.getmany(timeout_ms=500)).values():
                got.extend(decode(OBSERVATIONS, r.value) for r in records)
            return len(got)

        try:
            await eventually(read, lambda n: n >= len(sent), what="every observation published")
        finally:
            stop.set()
            task.cancel()  # as the driver side stops it: the stream stays open
            await asyncio.gather(task, return_exceptions=True)
            await reader.stop()
            await producer.stop()
        assert sorted(o.observation_id for o in got) == sorted(o.observation_id for o in sent)
        of_sb0 = [o.observation_id for o in got if o.key == "sb-0"]
        assert of_sb0 == [sent[0].observation_id, sent[20].observation_id, sent[21].observation_id]
        # One at a time: 22 requests. Read ahead: the first alone or with the others, then one
        # for each of sb-0's next two (never in a batch with an earlier one of sb-0).
        assert produces() - before <= 4
