"""Intake: a poll's records of the partitions owned merged per partition, each checked for
size, decoded, validated and checked to be on its key's partition (``Parsed``, or ``Rejected``
with the reason), and the input topics' partition count checked against the log's.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TypeAlias

from aiokafka import ConsumerRecord, TopicPartition

from events.codec import COMMANDS, OBSERVATIONS, DecodeError, check_key, decode, storable
from events.commands import CommandBase, DetachProvider, RotateCredentials
from events.common import Cause
from events.deadletter import key_text
from events.observations import DeadlineDue
from events.topics import MAX_INPUT_BYTES, partition_for
from events.trusted import builder
from projections.chain import ChainId, chain_of
from projections.lifecycle import Message
from projections.records import maker
from services.common.settings import Settings

Record: TypeAlias = ConsumerRecord[bytes, bytes]
Poll: TypeAlias = dict[TopicPartition, list[Record]]  # what the consumer returns

# Keys whose partition parse remembers across batches (murmur2 in Python costs microseconds).
PLACED_KEYS = 100_000


@dataclass(frozen=True, slots=True)
class Parsed:
    record: Record
    cause: Cause
    message: Message


@dataclass(frozen=True, slots=True)
class Rejected:
    record: Record
    reason: str


Item: TypeAlias = Parsed | Rejected
_parsed = maker(Parsed)  # one per input: Parsed(...) through its slots


def input_topics(settings: Settings) -> list[str]:
    return [settings.topic_commands, settings.topic_observations]


def record_time(record: Record) -> datetime:
    return datetime.fromtimestamp(record.timestamp / 1000, tz=UTC)


# A record's timestamp_type when the broker stamped it as it appended it (the topic's
# message.timestamp.type=LogAppendTime; 0 is CreateTime, the producer's word).
LOG_APPEND_TIME: Final = 1


# Inputs that may reach the log long after their time, sent until Kafka takes them, whose
# time is only when they fall to be decided: the commands a provider change owes its sandboxes
# (stored with the change, sent by the provider outbox: docs/adr/0007) and the scheduler's
# DeadlineDue (kept through an outage by publish_until_sent). Every other command is stamped
# by its door right before it is published; every other observation carries when it was seen.
RELAYED: Final = (RotateCredentials, DetachProvider, DeadlineDue)


def as_of(message: Message, logged_at: datetime | None) -> Message:
    """A relayed input as of when it entered the log (``logged_at``) when that is later than
    its own time: what the fold computes from its time (a restart's launch deadline, an
    expiry's stop deadline) counts from when it could be decided, not from before an outage."""
    if logged_at is None or not isinstance(message, RELAYED) or message.occurred_at >= logged_at:
        return message
    return message.model_copy(update={"occurred_at": logged_at})


def entered(message: Message, record: Record) -> Message:
    """``as_of`` the broker's append time, when the topic records it. Time still enters
    through the log: the append time is the record's, so a replay decides the same. Only a
    relayed input's clock is read (converting every record's cost a microsecond each)."""
    if not isinstance(message, RELAYED) or record.timestamp_type != LOG_APPEND_TIME:
        return message
    return as_of(message, record_time(record))


def parse(
    record: Record,
    commands_topic: str,
    partitions: int,
    placed: dict[str, int] | None = None,
    max_bytes: int = MAX_INPUT_BYTES,
) -> Item:
    """Decode and check one record; ``placed`` memoizes each key's partition. A value above
    ``max_bytes`` is refused undecoded: what is decided from it might not fit in a record."""
    value = record.value
    if value is not None and len(value) > max_bytes:
        return Rejected(record, too_large(len(value), max_bytes))
    adapter: Any = COMMANDS if record.topic == commands_topic else OBSERVATIONS
    try:
        message: Message = decode(adapter, record.value)
        check_key(record.key, message.key)
    except DecodeError as exc:
        return Rejected(record, exc.reason)
    # Per-sandbox order rests on every record of a sandbox being in one partition; a producer
    # with another partitioner would split it (and its updates would race).
    placed = {} if placed is None else placed
    expected = placed.get(message.key)
    if expected is None:
        expected = placed[message.key] = partition_for(message.key.encode(), partitions)
    if record.partition != expected:
        return Rejected(
            record,
            f"record is on partition {record.partition} but key {message.key!r} belongs on "
            f"partition {expected} of {partitions} (Kafka's default partitioner: "
            "murmur2(key) & 0x7fffffff % partitions; see docs/architecture.md)",
        )
    command_id = message.command_id if isinstance(message, CommandBase) else None
    cause = _cause(record.topic, record.partition, record.offset, message.type, command_id)
    return _parsed(record, cause, entered(message, record))


def too_large(size: int, max_bytes: int) -> str:
    return (
        f"record value is {size} bytes, above the {max_bytes} the processor decides "
        "(SANDSTREAM_PROCESSOR_MAX_INPUT_BYTES): what it decides from a record must fit in one "
        "Kafka record (see docs/operations.md)"
    )


# A record's coordinates and its message's type and command id (validated with the message),
# as Cause(...) would build them.
_cause = builder(Cause, "topic", "partition", "offset", "message_type", "command_id")


def history_key(item: Item) -> str | None:
    """The key an item's history entry is recorded under."""
    if isinstance(item, Parsed):
        return item.message.key
    key = key_text(item.record.key)
    return None if key is None else storable(key)  # as a dead letter's history entry stores it


def merge_topics(per_topic: Iterable[Sequence[Record]]) -> list[Record]:
    """Interleave the topics of one partition by record time, keeping each topic's order."""
    return list(heapq.merge(*per_topic, key=lambda r: r.timestamp))


def by_partition_of(batch: Mapping[TopicPartition, Sequence[Record]]) -> dict[int, list[Record]]:
    """A poll's records by partition, each partition's two topics merged by record time."""
    per_topic: dict[int, list[Sequence[Record]]] = defaultdict(list)
    for tp, records in batch.items():
        if records:  # getmany can report a partition with nothing new
            per_topic[tp.partition].append(records)
    return {p: merge_topics(rs) for p, rs in per_topic.items()}


@dataclass(frozen=True, slots=True)
class Inputs:
    """A batch's records parsed, with what its read needs."""

    records: list[Record]
    items: list[Item]
    where: dict[str, int]  # key -> partition
    idents: set[tuple[str, str]]
    chains: set[ChainId]
    partitions: set[tuple[str, int]]


def inputs_of(records: list[Record], items: list[Item], topics: list[str]) -> Inputs:
    """What the read of ``items`` needs, in one pass over them (a poll's thousands)."""
    where: dict[str, int] = {}
    idents: set[tuple[str, str]] = set()
    chains: set[ChainId] = set()
    for i in items:
        if isinstance(i, Parsed):
            key = i.message.key
            where[key] = i.record.partition
            if command_id := i.cause.command_id:
                idents.add((key, command_id))
            chains.add((key, None))  # chain_of(history_key(i), ...): a parsed input's key
        else:
            chains.add(chain_of(history_key(i), i.record.partition))
    partitions = {(t, p) for p in {r.partition for r in records} for t in topics}
    return Inputs(records, items, where, idents, chains, partitions)


@dataclass
class Intake:
    """Parses records for one processor, remembering each key's partition across batches."""

    settings: Settings
    _placed: dict[str, int] = field(default_factory=dict)  # key -> its partition (parse's memo)

    @property
    def topics(self) -> list[str]:
        return input_topics(self.settings)

    def parsed(self, records: Sequence[Record]) -> list[Item]:
        s, placed = self.settings, self._placed
        if len(placed) > PLACED_KEYS:
            placed.clear()
        n, commands, most = s.kafka_partitions, s.topic_commands, s.processor_max_input_bytes
        return [parse(r, commands, n, placed, most) for r in records]

    def inputs(self, records: Sequence[Record], dead_letter: str | None = None) -> Inputs:
        """``records`` parsed, or all refused for ``dead_letter`` (the reason) when given."""
        items: list[Item] = (
            self.parsed(records)
            if dead_letter is None
            else [Rejected(r, dead_letter) for r in records]
        )
        return inputs_of(list(records), items, self.topics)


@dataclass
class Owned:
    """The partitions whose records this processor takes in (``ownership`` keeps it)."""

    # Assigned and resumed; None when driven directly (a processor without a consumer), which
    # owns whatever it is given.
    partitions: set[int] | None = None
    # Stopped at a record PostgreSQL refused even as a dead letter: partition -> (topic,
    # offset). Paused until an operator skips or retries the record.
    stopped: dict[int, tuple[str, int]] = field(default_factory=dict)
    # The owner epoch this processor's assignment raised, per (topic, partition): its batches
    # move the offsets only while it is still the stored one (projections/offsets.py). Empty
    # when driven directly: the offsets alone fence its writes.
    epochs: dict[tuple[str, int], int] = field(default_factory=dict)

    def applies(self, partition: int) -> bool:
        """Whether records of ``partition`` are applied: it is owned and not stopped."""
        return (self.partitions is None or partition in self.partitions) and (
            partition not in self.stopped
        )

    def applicable(self, by_partition: Mapping[int, Sequence[Record]]) -> list[Record]:
        """The records to apply, partition by partition: those of partitions owned and not
        stopped."""
        return [r for p in sorted(by_partition) if self.applies(p) for r in by_partition[p]]


class PartitionCountChanged(RuntimeError):
    """An input topic's partition count is not the one the log was partitioned with."""


def check_partition_count(settings: Settings, topic: str, found: int) -> None:
    expected = settings.kafka_partitions
    if found != expected:
        raise PartitionCountChanged(
            f"input topic {topic} has {found} partitions but the log is partitioned into "
            f"{expected} (SANDSTREAM_KAFKA_PARTITIONS): every sandbox lives in partition "
            f"murmur2(key) % {expected}, and another count would move sandboxes between "
            "partitions and break their order. Refusing to run; restore the partition "
            "count (see docs/operations.md)"
        )


async def check_stored_partitioning(settings: Settings, conn: Any) -> None:
    """The stored rows were written from the partitions the configured count implies."""
    rows = await conn.fetch("SELECT key, partition FROM sandboxes LIMIT 100")
    n = settings.kafka_partitions
    for r in rows:
        if r["partition"] != partition_for(r["key"].encode(), n):
            raise PartitionCountChanged(
                f"sandbox {r['key']!r} was written from partition {r['partition']}, but "
                f"with {n} partitions (SANDSTREAM_KAFKA_PARTITIONS) it belongs on "
                f"{partition_for(r['key'].encode(), n)}: the input topics' partition count "
                "changed since the rows were written. Refusing to run (see "
                "docs/operations.md)"
            )
