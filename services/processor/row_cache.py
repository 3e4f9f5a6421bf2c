"""The rows a processor last committed, kept so the next batch need not read them back.

A partition's cached rows are valid while PostgreSQL still holds the offsets they were written
at: every write of a partition's rows moves its offsets. The processor reads the offsets with
every batch (``check`` forgets the partitions whose offsets moved), and its write is a
compare-and-set of those offsets, so a row used from here is proven current at commit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from projections.lifecycle import Sandbox

TopicPartition = tuple[str, int]


@dataclass
class RowCache:
    capacity: int  # rows kept across partitions; 0 keeps none
    # Per input partition: key -> row (None: known not to exist).
    _rows: dict[int, dict[str, Sandbox | None]] = field(default_factory=dict)
    _at: dict[TopicPartition, int] = field(default_factory=dict)
    _size: int = 0

    def __len__(self) -> int:
        return self._size

    def lookup(self, wanted: Iterable[tuple[int, str]]) -> dict[str, Sandbox | None]:
        """The cached rows among ``(partition, key)`` pairs."""
        found: dict[str, Sandbox | None] = {}
        for partition, key in wanted:
            rows = self._rows.get(partition)
            if rows is not None and key in rows:
                found[key] = rows[key]
        return found

    def check(self, offsets: Mapping[TopicPartition, int]) -> set[int]:
        """Forget every partition whose stored offsets are not the ones its rows were cached
        at (another writer, or none cached yet); returns the partitions that had rows."""
        moved = {tp[1] for tp, at in offsets.items() if self._at.get(tp) != at}
        dropped = set()
        for partition in moved:
            rows = self._rows.pop(partition, None)
            if rows:
                dropped.add(partition)
                self._size -= len(rows)
        for tp in [tp for tp in self._at if tp[1] in moved]:
            del self._at[tp]
        return dropped

    def remember(
        self, rows: Iterable[tuple[int, str, Sandbox | None]], offsets: Mapping[TopicPartition, int]
    ) -> None:
        """Rows just committed with ``offsets`` (those of every partition the batch covered)."""
        if self.capacity <= 0:
            return
        for partition, key, row in rows:
            part = self._rows.setdefault(partition, {})
            if key in part:
                del part[key]  # re-inserted last: the order is from oldest to newest
            else:
                self._size += 1
            part[key] = row
        self._at.update(offsets)
        for part in self._rows.values():  # over capacity: the oldest rows go first
            while self._size > self.capacity and part:
                del part[next(iter(part))]
                self._size -= 1

    def clear(self) -> None:
        self._rows.clear()
        self._at.clear()
        self._size = 0
