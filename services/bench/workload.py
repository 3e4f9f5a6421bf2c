"""The benchmarks' generated log: per sandbox a create, a running snapshot, a stop and an exited
snapshot, every one a state change (what the processor, both ceilings and the stage benchmarks
drain), and its producer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from aiokafka import AIOKafkaProducer

from events.codec import encode
from events.commands import CreateSandbox, StopSandbox
from events.common import SandboxSpec
from events.observations import RuntimeSnapshot
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SPEC = SandboxSpec(image="localhost/sandstream-base:1", command=["sleep", "3600"])


def lifecycle_messages(
    keys: int, varied: bool = False
) -> tuple[list[tuple[str, bytes, bytes]], int]:
    """Per key: create, running, stop, exited — 4 messages, every one a state change.
    ``varied``: some sandboxes with a grace period of their own, an exit code 0 and an actor
    whose name needs escaping in JSON (for the same-work ceiling's equality test)."""
    out: list[tuple[str, bytes, bytes]] = []
    for phase in range(4):
        for k in range(keys):
            key = f"bench-{k}"
            at = T0 + timedelta(milliseconds=phase)
            actor = 'ops "night" é' if varied and k % 5 == 1 else "bench"
            common = {"key": key, "occurred_at": at, "actor": actor}
            message: CreateSandbox | StopSandbox | RuntimeSnapshot
            topic = "commands"
            if phase == 0:
                spec = SPEC
                if varied and k % 4:
                    spec = SPEC.model_copy(update={"stop_timeout_seconds": 5 * (k % 4)})
                message = CreateSandbox(
                    type="CreateSandbox", command_id=f"c-{k}", spec=spec, **common
                )
            elif phase == 2:
                message = StopSandbox(type="StopSandbox", command_id=f"s-{k}", **common)
            else:
                topic = "observations"
                exited = 0 if varied and k % 3 == 0 else 143
                message = RuntimeSnapshot(
                    type="RuntimeSnapshot",
                    observation_id=f"o{phase}-{k}",
                    generation=1,
                    state="running" if phase == 1 else "exited",
                    exit_code=None if phase == 1 else exited,
                    **common,
                )
            out.append((topic, key.encode(), encode(message)))
    return out, len(out)


async def produce_all(settings: Settings, records: Sequence[tuple[str, bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(
        **kafka_client_args(settings, "admin"),  # writes both inputs: the API's and a driver's
        enable_idempotence=True,
        acks="all",
        linger_ms=20,
        max_batch_size=512 * 1024,
    )
    await producer.start()
    topics = {"commands": settings.topic_commands, "observations": settings.topic_observations}
    try:
        for start in range(0, len(records), 20_000):
            futures = [
                await producer.send(topics[t], value=v, key=k)
                for t, k, v in records[start : start + 20_000]
            ]
            await asyncio.gather(*futures)
    finally:
        await producer.stop()
