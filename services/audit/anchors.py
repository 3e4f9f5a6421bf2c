"""The chain heads the log vouches for: the newest head of each history chain that the
processor's checkpoints (services/processor/checkpoints.py) name, read from the checkpoints
topic, outside PostgreSQL. A history that no longer holds one of them was cut short."""

from __future__ import annotations

from dataclasses import dataclass, field

from events.log_reader import read_to_end
from projections.chain import ChainId
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.processor.checkpoints import parse_checkpoint


@dataclass(frozen=True, slots=True)
class Anchor:
    head: bytes  # the chain's newest entry hash as of the checkpoint
    at: str  # where the checkpoint is: topic[partition]@offset
    order: tuple[int, int]  # (the input offsets' sum, the record's offset): later is greater


@dataclass(slots=True)
class Anchors:
    # chain label -> input partition that wrote it -> its latest checkpointed head. (A chain
    # has one writing partition, but a dead letter of a misplaced record reaches its key's
    # chain from another: each partition's latest head must be in the chain.)
    heads: dict[ChainId, dict[int, Anchor]] = field(default_factory=dict)
    records: int = 0
    unreadable: list[str] = field(default_factory=list)  # where, and why


async def read_anchors(settings: Settings) -> Anchors:
    """Every checkpoint on the topic as of now, reduced to the latest head per chain and input
    partition. Read before the history is: whatever a checkpoint names was committed before
    it was published, so a snapshot of the history taken after holds it."""
    found = Anchors()
    client = kafka_client_args(settings, "audit")
    topic = settings.topic_checkpoints
    async for record in read_to_end(client, topic, settings.kafka_partitions, from_zero=False):
        found.records += 1
        where = f"{topic}[{record.partition}]@{record.offset}"
        try:
            checkpoint = parse_checkpoint(record.value or b"")
        except ValueError as exc:
            found.unreadable.append(f"{where}: {exc}")
            continue
        order = (checkpoint.order, record.offset)
        for chain, head in checkpoint.heads.items():
            latest = found.heads.setdefault(chain, {})
            known = latest.get(checkpoint.partition)
            if known is None or known.order < order:
                latest[checkpoint.partition] = Anchor(head, where, order)
    return found
