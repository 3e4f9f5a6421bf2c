"""The view a batch is decided on: as read, or as of another batch committed (pure).

The processor decides poll N+1 while poll N's write is in flight. What N+1 reads then may be
from before or after N's commit; ``View.after`` makes it the state after N either way: N's new
offsets (N+1's write compares and sets those, so it can only land after N committed), N's
outcomes and history chain heads. A partition of N at an offset neither N read nor N writes
means another writer moved it: no view (N's own write will find that out too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from events.outcomes import CommandOutcome
from projections.chain import ChainId, chain_of
from projections.store import BatchRead, BatchWrite

TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class View:
    offsets: Mapping[TopicPartition, int]  # the batch is decided at these, and its write CASes them
    cache_offsets: Mapping[TopicPartition, int]  # what kept rows are checked against
    outcomes: Mapping[tuple[str, str], CommandOutcome]
    heads: Mapping[ChainId, bytes | None]

    @classmethod
    def of(cls, read: BatchRead) -> View:
        return cls(read.offsets, read.offsets, read.outcomes, read.chain_heads)

    @classmethod
    def after(cls, read: BatchRead, inflight: BatchWrite) -> View | None:
        """The state once ``inflight`` commits, from a read made while it was being written.

        Kept rows were checked against the offsets ``inflight`` was read at (it has not been
        remembered yet): they are checked against those again.
        """
        offsets, cache_offsets = dict(read.offsets), dict(read.offsets)
        for tp, (at, new) in inflight.offsets.items():
            got = read.offsets.get(tp)
            if got is None:
                continue
            if got not in (at, new):
                return None
            offsets[tp], cache_offsets[tp] = new, at
        outcomes = {**read.outcomes, **{(o.key, o.command_id): o for o in inflight.outcomes}}
        heads = dict(read.chain_heads)
        for row in inflight.history:  # in write order: the last entry of a chain is its head
            heads[chain_of(row.key, row.partition)] = row.entry_hash
        return cls(offsets, cache_offsets, outcomes, heads)
