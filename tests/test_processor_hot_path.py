"""The processor's per-poll helpers give what their plain definitions give: what a poll's read
needs (``inputs_of``), a batch's chain checkpoints, the history rows as COPY takes them, and a
row's spec JSON (kept while the spec lives)."""

from __future__ import annotations

import hashlib
from typing import Any

import factories as f
import orjson
from aiokafka import ConsumerRecord

from projections import store
from projections.chain import chain_label, chain_of
from projections.store import HISTORY_COLUMNS, HistoryRow
from services.processor.checkpoints import checkpoint_records, parse_checkpoint
from services.processor.intake import Parsed, Rejected, history_key, inputs_of

TOPICS = ["sandbox.commands", "sandbox.observations"]


def _record(topic: str, partition: int, offset: int, key: bytes | None) -> Any:
    return ConsumerRecord(topic, partition, offset, 0, 0, key, b"{}", None, 0, 0, ())


def test_inputs_of_names_the_keys_commands_chains_and_partitions_a_poll_reads() -> None:
    create, running, stop = f.create("a"), f.running("b"), f.stop("a")
    items: list[Any] = [
        Parsed(_record(TOPICS[0], 1, 5, b"a"), f.cause(create), create),
        Parsed(_record(TOPICS[1], 2, 7, b"b"), f.cause(running), running),
        Parsed(_record(TOPICS[0], 1, 6, b"a"), f.cause(stop), stop),
        Rejected(_record(TOPICS[0], 3, 9, b"c"), "bad"),  # keyed: its key's chain
        Rejected(_record(TOPICS[1], 4, 2, None), "bad"),  # unkeyed: its partition's chain
    ]
    records = [i.record for i in items]
    inputs = inputs_of(records, items, TOPICS)
    assert inputs.where == {"a": 1, "b": 2}
    assert inputs.idents == {("a", create.command_id), ("a", stop.command_id)}
    assert inputs.chains == {chain_of(history_key(i), i.record.partition) for i in items}
    assert inputs.chains == {("a", None), ("b", None), ("c", None), (None, 4)}
    assert inputs.partitions == {(t, p) for t in TOPICS for p in (1, 2, 3, 4)}
    assert inputs.records is records and inputs.items is items


def _entry(key: str | None, partition: int, entry_hash: bytes | None) -> HistoryRow:
    return HistoryRow(key, "t", partition, 0, None, None, "applied", "r", None, None, None, [],
                      None, None, None, None, entry_hash)  # fmt: skip


def test_a_checkpoint_holds_each_chains_newest_head_labelled_as_the_audit_reads_it() -> None:
    long_key = "k" * 300  # labelled by its sha256
    history = [
        _entry("a", 0, b"\x01"),
        _entry("a", 0, b"\x02"),  # a's head: its last entry
        _entry(None, 0, b"\x03"),  # the partition's unkeyed chain
        _entry(long_key, 0, b"\x04"),
        _entry("b", 1, b"\x05"),
        _entry("c", 1, None),  # not linked: no head
    ]
    offsets = {("in", 0): (0, 4), ("in", 1): (0, 2), ("other", 0): (3, 3)}
    records = checkpoint_records(history, offsets, "checkpoints")
    assert [(r.partition, r.key) for r in records] == [(0, b"0"), (1, b"1")]
    first = orjson.loads(records[0].value)
    label = "sha256:" + hashlib.sha256(long_key.encode()).hexdigest()
    assert chain_label((long_key, None)) == (label, None)
    assert first["heads"] == [["a", "02"], [None, "03"], [label, "04"]]
    assert first["offsets"] == {"in": 4, "other": 3}
    assert orjson.loads(records[1].value)["heads"] == [["b", "05"]]
    assert parse_checkpoint(records[0].value).heads[("a", None)] == b"\x02"


def test_history_rows_go_to_copy_in_its_column_order() -> None:
    row = _entry("a", 3, b"\x09")
    assert store._history_tuples([row]) == [tuple(getattr(row, c) for c in HISTORY_COLUMNS)]
