"""``replaced`` gives what ``dataclasses.replace`` gives for the hot path's row types."""

from __future__ import annotations

import dataclasses

import factories as f
import pytest

from events.common import Phase
from projections.records import maker, replaced
from projections.store import HistoryRow


def test_replaced_equals_dataclasses_replace_for_rows_and_history_entries() -> None:
    row = f.harness_in(Phase.READY).row()
    changes = {"phase": Phase.STOPPING, "version": row.version + 1, "reason": "why"}
    assert replaced(row, **changes) == dataclasses.replace(row, **changes)
    assert replaced(row) == row and replaced(row) is not row
    entry = HistoryRow("k", "t", 0, 1, "CreateSandbox", "c", "applied", "r", "Ready", 1, 1,
                       ["SandboxCreated"], "{}", None)  # fmt: skip
    linked = replaced(entry, prev_hash=b"a", entry_hash=b"b")
    assert linked == dataclasses.replace(entry, prev_hash=b"a", entry_hash=b"b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        linked.key = "other"  # type: ignore[misc]


def test_replaced_refuses_a_field_the_type_does_not_have() -> None:
    with pytest.raises(TypeError, match="no fields"):
        replaced(f.harness_in(Phase.READY).row(), colour="red")


def test_a_maker_builds_what_the_constructor_builds() -> None:
    row = f.harness_in(Phase.READY).row()
    values = {field.name: getattr(row, field.name) for field in dataclasses.fields(row)}
    made = maker(type(row))(*values.values())  # positionally, keyword-only fields too
    assert made == type(row)(**values) and made is not row
    entry = ("k", "t", 0, 1, "CreateSandbox", "c", "applied", "r", "Ready", 1, 1,
             ["SandboxCreated"], "{}", None, None, b"a", b"b")  # fmt: skip
    assert maker(HistoryRow)(*entry) == HistoryRow(*entry)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.key = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        maker(HistoryRow)(*entry[:-1])  # every field is given: no defaults
