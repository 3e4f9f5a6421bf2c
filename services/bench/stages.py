"""CPU of the processor's pure stages: parse, decide and plan of the bench's log, in this process.

No Kafka, no PostgreSQL: the log's records are made as the consumer would hand them over (on
the partition their key belongs to), then parsed (decoded, validated, checked), folded and
planned into the write, 5,000 at a time as the processor's polls would be, each stage timed with
``time.thread_time``. The write, the publish and the consumer's own work are left out. A run is
the CPU per input of the whole log; the median of several runs is printed, and the minimum.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from aiokafka import ConsumerRecord

from events.topics import partition_for
from projections.chain import ChainId, chain_of
from projections.fold import OutcomeKey, fold
from projections.lifecycle import Sandbox
from services.bench.workload import lifecycle_messages
from services.common.settings import Settings
from services.processor.intake import Parsed, parse
from services.processor.plan import plan_batch

BATCH = 5_000
STAGES = ("parse", "decide", "plan")


def consumer_records(settings: Settings, keys: int) -> list[ConsumerRecord[bytes, bytes]]:
    """The bench's log as consumer records, each on its key's partition."""
    topics = {"commands": settings.topic_commands, "observations": settings.topic_observations}
    offsets: dict[tuple[str, int], int] = {}
    records = []
    for n, (role, key, value) in enumerate(lifecycle_messages(keys)[0]):
        topic, partition = topics[role], partition_for(key, settings.kafka_partitions)
        offset = offsets[(topic, partition)] = offsets.get((topic, partition), -1) + 1
        record = ConsumerRecord(topic, partition, offset, 1_767_225_600_000 + n, 0, key, value,
                                None, len(key), len(value), ())  # fmt: skip
        records.append(record)
    return records


def stages_cpu(settings: Settings, records: list[ConsumerRecord[bytes, bytes]]) -> dict[str, float]:
    """µs of CPU per input of each stage, for ``records`` from no rows, batch by batch."""
    states: dict[str, Sandbox | None] = {}
    outcomes: dict[OutcomeKey, Any] = {}
    heads: dict[ChainId, bytes | None] = {}
    placed: dict[str, int] = {}
    spent = dict.fromkeys(STAGES, 0.0)
    gc.collect()  # each run starts with the same heap
    for start in range(0, len(records), BATCH):
        batch = records[start : start + BATCH]
        began = time.thread_time()
        items = [parse(r, settings.topic_commands, settings.kafka_partitions, placed)
                 for r in batch]  # fmt: skip
        parsed = time.thread_time()
        inputs = [(i.cause, i.message) for i in items if isinstance(i, Parsed)]
        result = fold(states, outcomes, inputs, limits=settings.lifecycle_limits)
        decided = time.thread_time()
        read_at = {(r.topic, r.partition): 0 for r in batch}
        plan = plan_batch(items, result, read_at, settings, states, heads)
        planned = time.thread_time()
        spent["parse"] += parsed - began
        spent["decide"] += decided - parsed
        spent["plan"] += planned - decided
        states = result.states
        outcomes.update(result.outcomes)
        heads.update({chain_of(h.key, h.partition): h.entry_hash for h in plan.history})
    return {stage: seconds / len(records) * 1e6 for stage, seconds in spent.items()}


def stage_figures(settings: Settings, keys: int, runs: int) -> None:
    records = consumer_records(settings, keys)
    figures = [stages_cpu(settings, records) for _ in range(runs)]
    print(f"stages      {len(records):,} inputs, {runs} runs (µs/input of CPU, median and min):")
    for stage in (*STAGES, "all three"):
        values = [sum(f.values()) if stage == "all three" else f[stage] for f in figures]
        print(f"  {stage:<10} {statistics.median(values):6.1f}  min {min(values):6.1f}")
