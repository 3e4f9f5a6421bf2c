"""Read: what a batch is decided on, in one snapshot (stored offsets, rows, outcomes, chain
heads; rows this processor wrote come from the row cache), its records already applied dropped
(fencing), and the batch decided from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from projections.fold import Rules
from projections.lifecycle import decide
from projections.store import BATCH_SESSION, read_batch
from services.common import metrics
from services.common.settings import Settings
from services.processor.intake import Inputs, Item
from services.processor.plan import Decided, View, decide_batch, decide_batch_yielding
from services.processor.row_cache import RowCache


class InputGap(RuntimeError):
    """A poll's records of a partition are not the ones right after the offset the processor
    has applied it up to, in order, once each: some never reached this batch (writing it would
    move the offset past them for good: an accepted command lost), or some came twice. Nothing
    of it is written; the processor reads its partitions again from the stored offsets."""


def gaps(items: Sequence[Item], offsets: Mapping[tuple[str, int], int]) -> list[str]:
    """The partitions whose records in ``items`` at or above their stored offset are not the
    offsets that follow it, in order (pure). The input topics' offsets are contiguous (no
    transactions, no compaction), and a poll's records of a partition come in offset order."""
    unapplied: dict[tuple[str, int], list[int]] = {}
    for item in items:
        tp, offset = (item.record.topic, item.record.partition), item.record.offset
        if offset >= offsets[tp]:
            unapplied.setdefault(tp, []).append(offset)
    found = []
    for (topic, partition), got in sorted(unapplied.items()):
        applied = offsets[(topic, partition)]
        if got[0] > applied:
            found.append(f"{topic}[{partition}] from offset {got[0]}, applied up to {applied}")
        elif got != list(range(applied, applied + len(got))):
            found.append(f"{topic}[{partition}] out of sequence after offset {applied}")
    return found


def unapplied(items: Sequence[Item], offsets: Mapping[tuple[str, int], int]) -> list[Item]:
    """The items at or above the stored offsets: those below were applied already (a
    redelivery, or a batch a zombie still holds)."""
    return [i for i in items if i.record.offset >= offsets[(i.record.topic, i.record.partition)]]


async def batch_connection(pool: asyncpg.Pool[asyncpg.Record]) -> Any:
    """A connection of a batch path's own (no pool round trips per batch), set up for it."""
    conn = await pool.acquire()
    await conn.execute(BATCH_SESSION)
    return conn


@dataclass
class Reader:
    """Reads what batches need and decides them, keeping the rows they leave in ``rows``."""

    settings: Settings
    rows: RowCache
    rules: Rules = decide

    async def decide(
        self, conn: Any, inputs: Inputs, after: Decided | None = None
    ) -> Decided | None:
        """Read what ``inputs`` need and decide them (None: nothing of them is left to write).

        With ``after``, as of that batch committed (it is being written meanwhile): its rows,
        outcomes and history heads replace those read, and its new offsets those it read. Then
        None also means that view cannot be had (someone else moved its partitions, or kept
        rows went stale); the inputs are decided again once it committed.
        """
        where = inputs.where
        while True:
            overlaid = {} if after is None else after.states_for(where)
            cached = self.rows.lookup((p, key) for key, p in where.items() if key not in overlaid)
            wanted = where.keys() - cached.keys() - overlaid.keys()
            read = await read_batch(conn, inputs.partitions, wanted, inputs.idents, inputs.chains)
            view = View.of(read) if after is None else View.after(read, after.plan)
            if view is None:
                return None
            if self.rows.check(view.cache_offsets) & {where[key] for key in cached}:
                if after is not None:
                    return None
                continue  # cached rows of a partition someone else wrote: read them instead
            if found := gaps(inputs.items, view.offsets):
                raise InputGap(f"a poll not following the applied offsets: {'; '.join(found)}")
            items = unapplied(inputs.items, view.offsets)
            if after is None and len(items) < len(inputs.items):
                metrics.FENCED.inc(len(inputs.items) - len(items))
            if not items:
                return None
            states = {**read.sandboxes, **cached, **overlaid}
            if after is None:
                return decide_batch(items, states, view, self.settings, self.rules)
            # In slices, so the event loop keeps driving the write in flight (a statement and
            # two COPYs: a round trip each) instead of waiting for the whole decision.
            return await decide_batch_yielding(items, states, view, self.settings, self.rules)
