"""Reading a topic to its end: a deadline on stalls, not on the whole read."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from aiokafka import ConsumerRecord, TopicPartition

from events import log_reader

TOPIC = "t"


class SlowConsumer:
    """A consumer whose every fetch takes ``pause`` seconds and brings one record."""

    def __init__(self, count: int, pause: float) -> None:
        self.count, self.pause, self.next = count, pause, 0

    def __call__(self, **_: Any) -> SlowConsumer:
        return self

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def assign(self, tps: list[TopicPartition]) -> None:
        pass

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.count for tp in tps}

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 0 for tp in tps}

    async def seek_to_beginning(self, *tps: TopicPartition) -> None:
        pass

    async def getmany(self, *tps: TopicPartition, **_: Any) -> dict[TopicPartition, list[Any]]:
        await asyncio.sleep(self.pause)  # a slow broker, not synchronisation
        tp = TopicPartition(TOPIC, 0)
        record = ConsumerRecord(TOPIC, 0, self.next, 0, 0, None, b"v", None, 0, 1, [])
        self.next += 1
        return {tp: [record]}


async def test_a_read_that_keeps_progressing_is_not_cut_off_by_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ten fetches of 0.3 s each take three times the 1 s timeout in all, none stalls."""
    monkeypatch.setattr(log_reader, "AIOKafkaConsumer", SlowConsumer(count=10, pause=0.3))
    got = [r.offset async for r in log_reader.read_to_end({}, TOPIC, 1, timeout=1.0)]
    assert got == list(range(10))


async def test_a_read_that_stalls_longer_than_the_timeout_fails() -> None:
    consumer = SlowConsumer(count=3, pause=0.0)
    consumer.getmany = _never  # type: ignore[method-assign]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(log_reader, "AIOKafkaConsumer", consumer)
        with pytest.raises(TimeoutError, match="still missing"):
            async for _ in log_reader.read_to_end({}, TOPIC, 1, timeout=0.2):
                pass


async def _never(*_: Any, timeout_ms: int = 0, **__: Any) -> dict[TopicPartition, list[Any]]:
    """A fetch whose records never come: it waits for them until its timeout, then is empty."""
    arrived = asyncio.Event()  # nothing ever sets it
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(arrived.wait(), timeout_ms / 1000)
    return {}
