"""Rebuild benchmark: the time and peak memory to rebuild the read model from the decided events
of a 1,000,000-input log (250,000 sandboxes x create, running, stop, exited).

The events are decided once for a template sandbox by the real lifecycle rules, then copied
for every other sandbox with its own name and id (deciding a million inputs in the benchmark
itself would measure the fold, not the rebuild). The rebuild runs in a child process, so its
peak resident memory can be read from the operating system.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid

from aiokafka import AIOKafkaProducer

from events.codec import COMMANDS, OBSERVATIONS, decode, encode
from events.common import Cause
from projections.fold import fold
from projections.lifecycle import Message
from services.bench.workload import lifecycle_messages
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack.isolation import isolated

TEMPLATE = "bench-0"
# The rebuild's two steps, as `sandstream rebuild` runs them: fold the events, write the rows.
CHILD = """
import asyncio, json, resource, time
from services.common.settings import Settings
from services.processor.rebuild import fold_events_topic, write_rows
settings = Settings()  # from the environment: a dump would mask the password
async def main():
    started = time.perf_counter()
    rows = await fold_events_topic(settings)
    folded = time.perf_counter()
    conn = await write_rows(settings, settings.pg_schema + "_rebuilt", rows)
    await conn.execute(f"DROP SCHEMA {settings.pg_schema}_rebuilt CASCADE")
    await conn.close()
    written = time.perf_counter()
    print(json.dumps({"rows": len(rows), "fold_s": round(folded - started, 1),
                      "write_s": round(written - folded, 1),
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
asyncio.run(main())
"""


def template_events() -> list[bytes]:
    """The encoded decided events of the template sandbox's four inputs, in order."""
    records, _ = lifecycle_messages(1)
    inputs = []
    for offset, (topic, _, value) in enumerate(records):
        message: Message = (
            decode(COMMANDS, value) if topic == "commands" else decode(OBSERVATIONS, value)
        )
        inputs.append((Cause(topic=topic, partition=0, offset=offset, message_type=message.type),
                       message))  # fmt: skip
    result = fold({}, {}, inputs)
    return [encode(event) for step in result.steps for event in step.decision.events]


def copies(template: list[bytes], keys: int) -> list[tuple[bytes, bytes]]:
    """(key, value) of every sandbox's events: the template's with another name and id."""
    ids = {str(json.loads(v).get("sandbox_id")) for v in template} - {"None"}
    out = []
    for k in range(keys):
        name = f"bench-{k}"
        own = str(uuid.uuid5(uuid.NAMESPACE_URL, name))
        for value in template:
            text = value.decode().replace(f'"{TEMPLATE}"', f'"{name}"')
            for old in ids:
                text = text.replace(old, own)
            out.append((name.encode(), text.encode()))
    return out


async def rebuild_figures(settings: Settings, keys: int) -> None:
    async with isolated(settings, "bench") as (s, _):
        events = copies(template_events(), keys)
        producer = AIOKafkaProducer(**kafka_client_args(s, "admin"), acks="all",
                                    linger_ms=20, max_batch_size=512 * 1024)  # fmt: skip
        await producer.start()
        try:
            for start in range(0, len(events), 20_000):
                futures = [await producer.send(s.topic_events, value=v, key=k)
                           for k, v in events[start : start + 20_000]]  # fmt: skip
                await asyncio.gather(*futures)
        finally:
            await producer.stop()
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, env={**os.environ, **s.as_env()},
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        started = time.perf_counter()
        out, _ = await child.communicate()
        wall = time.perf_counter() - started
        child_figures = json.loads(out)
        print(
            f"rebuild     {keys * 4:>9,} inputs ({len(events):,} decided events, "
            f"{child_figures['rows']:,} rows)  {wall:6.1f} s (fold {child_figures['fold_s']} s, "
            f"write {child_figures['write_s']} s)  peak RSS {child_figures['peak_mib']:,} MiB"
        )
