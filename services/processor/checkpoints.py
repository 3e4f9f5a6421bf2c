"""Chain checkpoints: the newest hash of each history chain a batch wrote, put in the batch's
outbox (so written in its transaction) and published on the checkpoints topic, outside
PostgreSQL. The audit compares them with the history: a chain whose checkpointed head no entry
holds was cut short, or its hashes rewritten (docs/audit.md). Pure.

One record per input partition a batch wrote (more only past ``HEADS_PER_RECORD`` chains),
keyed by the partition's number so that each partition's checkpoints stay in order on one
partition of the topic::

    {"type": "ChainCheckpoint", "schema_version": 1, "partition": 3,
     "offsets": {"sandbox.commands": 120, "sandbox.observations": 98},
     "heads": [["agent-2", "<sha256 hex>"], [null, "<sha256 hex>"]]}

``offsets`` are the partition's input offsets after the batch: every write of a partition
moves them forward, so their sum orders its checkpoints (a republished one repeats an older
sum). A head's chain is its key (``chain_label``), or null for the partition's unkeyed chain.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Final

import orjson

from projections.chain import LABEL_MAX, ChainId, chain_label
from projections.store import HistoryRow, OutboxRecord

CHECKPOINT_TYPE: Final = "ChainCheckpoint"
# Heads per record: a label is at most 255 characters, so a record stays far below Kafka's
# 1 MiB however many chains a batch wrote.
HEADS_PER_RECORD: Final = 1000


_chain = attrgetter("key", "partition")
_entry_hash = attrgetter("entry_hash")


def checkpoint_records(
    history: Sequence[HistoryRow],
    offsets: Mapping[tuple[str, int], tuple[int, int]],
    topic: str,
) -> list[OutboxRecord]:
    """The checkpoint records of a batch: ``history`` its rows in write order (linked),
    ``offsets`` its compare-and-set of the input offsets, ``(from, to)`` per (topic,
    partition)."""
    # In write order: the last row of a chain is its head (read in C: a row per input).
    newest = dict(zip(map(_chain, history), map(_entry_hash, history), strict=True))
    heads: dict[int, list[list[str | None]]] = defaultdict(list)
    for (key, partition), head in newest.items():
        if head is not None:
            label = key if key is None or len(key) <= LABEL_MAX else chain_label((key, None))[0]
            heads[partition].append([label, head.hex()])
    records = []
    for partition, chains in heads.items():
        after = {t: new for (t, p), (_, new) in offsets.items() if p == partition}
        for start in range(0, len(chains), HEADS_PER_RECORD):
            value = orjson.dumps(
                {
                    "type": CHECKPOINT_TYPE,
                    "schema_version": 1,
                    "partition": partition,
                    "offsets": after,
                    "heads": chains[start : start + HEADS_PER_RECORD],
                }
            )
            records.append(OutboxRecord(partition, topic, str(partition).encode(), value))
    return records


@dataclass(frozen=True, slots=True)
class Checkpoint:
    partition: int  # the input partition whose write it records
    order: int  # the sum of that partition's input offsets after the write
    heads: dict[ChainId, bytes]  # chain label -> its newest entry hash then


def parse_checkpoint(value: bytes) -> Checkpoint:
    """A checkpoint record's content; ValueError when it is not one."""
    try:
        body: Any = orjson.loads(value)
        if body.get("type") != CHECKPOINT_TYPE or body.get("schema_version") != 1:
            raise ValueError("not a ChainCheckpoint of schema version 1")
        partition = int(body["partition"])
        order = sum(int(o) for o in body["offsets"].values())
        heads: dict[ChainId, bytes] = {}
        for label, head in body["heads"]:
            chain: ChainId = (str(label), None) if label is not None else (None, partition)
            heads[chain] = bytes.fromhex(head)
        return Checkpoint(partition, order, heads)
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
        raise ValueError(f"not a chain checkpoint: {exc!r}") from exc
