"""The processor's batch planning, pure: history linked while planning is exactly what
``chain_rows`` links afterwards (the audit tools and the processor share this path)."""

from __future__ import annotations

import dataclasses

import factories as f
from aiokafka import ConsumerRecord

from events.codec import encode
from events.topics import partition_for
from projections.chain import CONTENT_FIELDS, ChainId, chain_of, chain_rows
from projections.fold import fold
from projections.store import HistoryRow
from services.common.settings import Settings
from services.processor.checkpoints import parse_checkpoint
from services.processor.intake import Parsed, parse
from services.processor.plan import plan_batch

PARTITIONS = 4
SETTINGS = Settings().model_copy(
    update={
        "kafka_partitions": PARTITIONS,
        "topic_commands": f.COMMANDS_TOPIC,
        "topic_observations": f.OBSERVATIONS_TOPIC,
    }
)


def record(topic: str, key: bytes | None, value: bytes, offset: int, partition: int | None = None
           ) -> ConsumerRecord[bytes, bytes]:  # fmt: skip
    if partition is None:
        partition = partition_for(key or b"", PARTITIONS)
    at = 1_767_225_600_000 + offset
    return ConsumerRecord(topic, partition, offset, at, 0, key, value, None, 0, 0, ())


def batch() -> list[ConsumerRecord[bytes, bytes]]:
    """Applied, rejected and duplicate inputs of two sandboxes, and dead letters: keyed,
    unkeyed, on the wrong partition."""
    cmds = SETTINGS.topic_commands
    messages = [
        f.create("plan-a", command_id="c1"), f.create("plan-b", command_id="c2"),
        f.running("plan-a", 1), f.stop("plan-a", command_id="c3"),
        f.stop("plan-a", command_id="c3"), f.start("plan-b", command_id="c4"),
        f.exited("plan-a", 1, exit_code=143),
    ]  # fmt: skip
    out = [record(f.topic_for(m), m.key.encode(), encode(m), i) for i, m in enumerate(messages)]
    wrong = (partition_for(b"plan-a", PARTITIONS) + 1) % PARTITIONS
    out += [
        record(cmds, b"plan-a", b"{not json", 100),
        record(cmds, None, b"{}", 101, partition=1),
        record(cmds, None, b"\xff", 102, partition=1),
        record(cmds, b"plan-a", encode(f.stop("plan-a", command_id="c5")), 103, partition=wrong),
    ]
    return out


def test_history_rows_begin_with_the_content_fields_in_order() -> None:
    names = tuple(field.name for field in dataclasses.fields(HistoryRow))
    assert names == (*CONTENT_FIELDS, "prev_hash", "entry_hash")


def test_history_linked_while_planning_is_what_chain_rows_links() -> None:
    items = [parse(r, SETTINGS.topic_commands, PARTITIONS) for r in batch()]
    parsed = [i for i in items if isinstance(i, Parsed)]
    result = fold({}, {}, ((p.cause, p.message) for p in parsed))
    read = {(r.topic, r.partition): 0 for r in batch()}
    heads = {chain_of("plan-a", 0): b"a" * 32, chain_of(None, 1): b"u" * 32}
    unlinked = plan_batch(items, result, read, SETTINGS)
    linked = plan_batch(items, result, read, SETTINGS, chain_heads=heads)
    assert linked.history == chain_rows(unlinked.history, heads)
    # Linked, a batch also checkpoints its chains' heads (tested below); nothing else differs.
    events = [o for o in linked.outbox if o.topic != SETTINGS.topic_checkpoints]
    assert dataclasses.replace(linked, history=[], outbox=events) == dataclasses.replace(
        unlinked, history=[]
    )
    dispositions = {h.disposition for h in linked.history}
    assert {"applied", "duplicate", "dead-lettered"} <= dispositions
    assert [h.key for h in linked.history].count(None) == 2  # the unkeyed dead letters
    assert all(h.entry_hash is not None for h in linked.history)


def test_a_linked_batch_checkpoints_each_partitions_chain_heads_in_one_record() -> None:
    """One checkpoint per input partition the batch wrote (not one per input), naming the
    newest hash of every chain it wrote there, and that partition's offsets after it."""
    items = [parse(r, SETTINGS.topic_commands, PARTITIONS) for r in batch()]
    parsed = [i for i in items if isinstance(i, Parsed)]
    result = fold({}, {}, ((p.cause, p.message) for p in parsed))
    read = {(r.topic, r.partition): 0 for r in batch()}
    plan = plan_batch(items, result, read, SETTINGS, chain_heads={})
    records = [o for o in plan.outbox if o.topic == SETTINGS.topic_checkpoints]
    newest: dict[int, dict[ChainId, bytes | None]] = {}
    for h in plan.history:
        label = (h.key, None) if h.key is not None else (None, h.partition)
        newest.setdefault(h.partition, {})[label] = h.entry_hash
    assert sorted(r.partition for r in records) == sorted(newest)
    for r in records:
        checkpoint = parse_checkpoint(r.value)
        assert r.key == str(r.partition).encode() and checkpoint.partition == r.partition
        assert checkpoint.heads == newest[r.partition]
        after = sum(new for (_, p), (_, new) in plan.offsets.items() if p == r.partition)
        assert checkpoint.order == after
    assert len(plan.history) > len(records)
    unlinked = plan_batch(items, result, read, SETTINGS)  # nothing linked: nothing to anchor
    assert not [o for o in unlinked.outbox if o.topic == SETTINGS.topic_checkpoints]
