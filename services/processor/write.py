"""Write: a batch decided and written exactly once, in one statement that lands only if the
offsets are still those it was decided at (else decided again), and a write PostgreSQL refuses
for what a record holds split down to that record, which is dead-lettered.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import asyncpg

from projections.offsets import owner_epochs
from projections.store import (
    ChainMoved,
    OffsetsMoved,
    OutboxRecord,
    RowVersionMoved,
    write_batch,
)
from services.common import metrics
from services.processor.ahead import PollAhead, Polls
from services.processor.failures import (
    WriteRefused,
    database_gone,
    refused_for_content,
    release,
    terminate,
)
from services.processor.intake import Inputs, Intake, Record
from services.processor.ownership import Ownership
from services.processor.plan import Decided
from services.processor.read import Reader, batch_connection
from services.processor.row_cache import RowCache

log = logging.getLogger("sandstream.processor")

_disposition = attrgetter("disposition")
Applied = tuple[int, list[tuple[int, OutboxRecord]]]  # inputs applied, (outbox id, record)s


@dataclass
class Writer:
    """Applies batches of records on a connection of its own, remembering the rows written."""

    pool: asyncpg.Pool[asyncpg.Record]
    name: str
    intake: Intake
    reader: Reader
    rows: RowCache
    polls: Polls
    ownership: Ownership
    conn: Any = None  # the batches' connection

    async def apply(self, records: Sequence[Record], ahead: PollAhead = PollAhead.NONE) -> Applied:
        """Apply ``records`` (partition by partition, each in order) exactly once.

        A write PostgreSQL refuses for what a record holds is split in two, each half applied
        in order, until the record(s) causing it are found: each is dead-lettered with the
        database's message. A record whose dead letter is refused too stops its partition.
        """
        records = [r for r in records if r.partition not in self.ownership.owned.stopped]
        if not records:
            return 0, []
        try:
            return await self._apply_once(records, poll=ahead)
        except WriteRefused as exc:
            if len(records) > 1:
                half = len(records) // 2
                first = await self.apply(records[:half])
                second = await self.apply(records[half:])
                return first[0] + second[0], first[1] + second[1]
            refusal = str(exc)
        reason = f"PostgreSQL refused to store it: {refusal}"
        log.warning("%s: dead-lettering %s[%d]@%d: %s", self.name, records[0].topic,
                    records[0].partition, records[0].offset, reason)  # fmt: skip
        try:
            return await self._apply_once(records, dead_letter=reason)
        except WriteRefused as exc:
            await self.ownership.stop_partition(records[0], f"{reason}; its dead letter too: {exc}")
            return 0, []

    async def _apply_once(
        self,
        records: Sequence[Record],
        dead_letter: str | None = None,
        poll: PollAhead = PollAhead.NONE,
    ) -> Applied:
        started = asyncio.get_running_loop().time()
        if self.conn is None:  # a connection of its own: no pool round trips per batch
            self.conn = await batch_connection(self.pool)
        ahead = self.polls.take_ahead(records) if poll is not PollAhead.NONE else None
        inputs = ahead.inputs if ahead is not None else self.intake.inputs(records, dead_letter)
        decided = ahead.decided if ahead is not None else None
        # Optimistic: read, decide, then write only if no other writer moved these partitions'
        # offsets in between (two round trips in all). Whoever loses the race reads again; its
        # records below the winner's offsets are then skipped.
        while True:
            if decided is None:
                decided = await self.reader.decide(self.conn, inputs)
                if decided is None:
                    return 0, []
            try:
                ids = await self._write(decided, poll)
            except OffsetsMoved as exc:
                metrics.WRITE_CONFLICTS.inc()
                if moved := await self._taken_over(inputs):
                    records = [r for r in records if r.partition not in moved]
                    if not records:
                        return 0, []
                    inputs = self.intake.inputs(records, dead_letter)
                else:
                    log.info("%s: another writer moved the offsets, deciding again: %s",
                             self.name, exc)  # fmt: skip
                self.rows.clear()
                decided = None
                continue
            except ChainMoved as exc:
                # Another partition's writer linked onto a head this batch read (a dead letter
                # of a key that is not on its partition joins that key's chain): the database
                # refused the fork; decided again on the new head.
                metrics.CHAIN_CONFLICTS.inc()
                log.warning("%s: a history chain moved, deciding again: %s", self.name, exc)
                decided = None
                continue
            except RowVersionMoved as exc:
                # Only a sandbox written from two partitions gets here: loud, and decided
                # again from the stored row, so no update is lost.
                metrics.ROW_VERSION_CONFLICTS.inc()
                log.error("%s: %s; deciding the batch again from the stored rows", self.name, exc)
                self.rows.clear()
                decided = None
                continue
            except Exception as exc:
                if database_gone(exc) or not refused_for_content(exc):
                    raise
                raise WriteRefused(str(exc)) from exc
            break
        plan, where = decided.plan, inputs.where
        committed = {tp: new for tp, (_, new) in plan.offsets.items()}
        self.rows.remember(
            ((where[key], key, row) for key, row in decided.result.states.items() if key in where),
            committed,
        )
        for disposition, count in Counter(map(_disposition, plan.history)).items():
            metrics.INPUTS.labels(disposition).inc(count)
        metrics.BATCH_SECONDS.observe(asyncio.get_running_loop().time() - started)
        return len(decided.items), list(zip(ids, plan.outbox, strict=True))

    async def _taken_over(self, inputs: Inputs) -> set[int]:
        """After a refused write: the partitions of ``inputs`` another assignment took (their
        owner epoch moved), let go (``Ownership.taken_over``)."""
        mine = self.ownership.owned.epochs
        if not mine:
            return set()
        stored = await owner_epochs(self.conn, [tp for tp in inputs.partitions if tp in mine])
        return self.ownership.taken_over(stored)

    async def _write(self, decided: Decided, poll: PollAhead) -> list[int]:
        """Write a decided batch; meanwhile take the next poll (FETCH) and decide it (DECIDE).

        The next poll (only what the consumer has already fetched) is decided as of this batch
        committed, and kept only if it did: any failure here, and any rebalance, seek, pause
        or lost connection before the next batch is applied, discards it (``take_ahead``), and
        its records are decided again from what PostgreSQL then holds. Its write also compares
        and sets the offsets this one moves them to, so it never lands on another state.
        """
        epochs = self.ownership.owned.epochs
        write = asyncio.ensure_future(write_batch(self.conn, decided.plan, epochs=epochs))
        try:
            ahead = await self.polls.during(write, decided, poll)
            ids = await write
        except BaseException:
            if not write.done():
                write.cancel()
                await asyncio.wait([write])
            self.polls.discard_ahead()
            raise
        self.polls.ahead = ahead
        return ids

    def forget(self) -> None:
        """After a lost backend: the connection may be broken."""
        terminate(self.conn)
        self.conn = None

    async def stop(self) -> None:
        await release(self.pool, self.conn)
        self.conn = None
