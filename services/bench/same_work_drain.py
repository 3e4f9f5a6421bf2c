"""The same-work ceiling's drain (services/bench/same_work.py decides; this reads, writes and
publishes): per poll the processor's read and decisions on it, its write, its outbox published,
overlapped as the processor overlaps them, and its measurement by the observer that times the
processor (``services.bench.drained``)."""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from projections.chain import chain_of
from projections.outbox import mark_published
from projections.store import BATCH_SESSION, read_batch
from services.bench.drained import Drained, timed_drain
from services.bench.same_work import (
    _OUTCOME,
    CURSOR_EVERY,
    Batch,
    Parsed,
    Record,
    SameWork,
    Unsupported,
    _plain_row,
    write_poll,
)
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.processor.plan import SLICE


async def read(
    ceiling: SameWork,
    conn: asyncpg.Connection[asyncpg.Record],
    parsed: list[Parsed],
    partitions: set[int],
) -> dict[tuple[str, int], int]:
    """The processor's per-poll read, one statement of its own (``read_batch``): the stored
    offsets of the poll's partitions, the rows not kept in memory, the outcomes of its
    commands and the heads of its chains; decided on as the processor does. Returns the
    offsets the poll is decided at (those of the write in flight, if it covers them).

    Fencing: a stored offset that is neither what the write in flight moves it from nor
    what it moves it to (the read may be from either side of its commit) means another
    writer; the ceiling has no rebalance machinery, so
    it stops (``Unsupported``) where the processor would read again. De-duplication: a
    command is a repeat if its outcome is stored, in the write in flight or in this poll.
    Chain heads: as stored, unless the write in flight moves them.
    """
    keys = {m.key for _, m, _ in parsed}
    wanted = [k for k in keys if k not in ceiling.rows and k not in ceiling.general]
    idents = {(m.key, c.command_id) for _, m, c in parsed if c.command_id is not None}
    chains = {chain_of(m.key, r.partition) for r, m, _ in parsed}
    tps = {(t, p) for t in (ceiling.commands, ceiling.observations) for p in partitions}
    read = await read_batch(conn, tps, wanted, idents, chains)
    for tp, got in read.offsets.items():
        now = ceiling.offsets.get(tp, 0)
        before = ceiling.in_flight_from.get(tp, now)
        if got not in (before, now):
            raise Unsupported(f"{tp} is at {got}, not {before} or {now}: another writer")
    for key, sandbox in read.sandboxes.items():
        if (plain := _plain_row(sandbox)) is not None:
            ceiling.rows[key] = plain
        else:
            ceiling.general[key] = sandbox
    stored = {k: _OUTCOME.dump_json(o) for k, o in read.outcomes.items()}
    ceiling.outcomes = {**stored, **ceiling.in_flight_outcomes}
    for (chain, _), head in read.chain_heads.items():
        if chain is not None and chain not in ceiling.in_flight_chains and head is not None:
            ceiling.heads[chain] = head
    return {tp: ceiling.offsets.get(tp, 0) for tp in tps}


@dataclass
class Publisher:
    """The outbox to Kafka in commit order, one producer batch per partition per poll, as the
    processor's: the acknowledgements awaited off the poll's path (a confirmer task), the
    cursors moved over the acknowledged ids at most every CURSOR_EVERY."""

    producer: AIOKafkaProducer
    conn: asyncpg.Connection[asyncpg.Record]
    pending: list[tuple[list[asyncio.Future[Any]], dict[int, list[int]]]] = field(
        default_factory=list
    )
    written: float = 0.0
    confirmer: asyncio.Task[None] | None = None

    async def publish(
        self, ids: Sequence[int], outbox: Sequence[tuple[int, str, bytes, bytes]]
    ) -> None:
        by_tp: dict[tuple[str, int], list[tuple[int, str, bytes, bytes]]] = defaultdict(list)
        sent: dict[int, list[int]] = defaultdict(list)
        for i, rec in zip(ids, outbox, strict=True):
            by_tp[(rec[1], rec[0])].append(rec)
            sent[rec[0]].append(i)
        futures = []
        for (topic, partition), recs in by_tp.items():
            batch = self.producer.create_batch()
            for rec in recs:
                if batch.append(key=rec[2], value=rec[3], timestamp=None) is None:
                    futures.append(
                        await self.producer.send_batch(batch, topic, partition=partition)
                    )
                    batch = self.producer.create_batch()
                    batch.append(key=rec[2], value=rec[3], timestamp=None)
            futures.append(await self.producer.send_batch(batch, topic, partition=partition))
        self.pending.append((futures, sent))
        if self.confirmer is None:
            self.confirmer = asyncio.create_task(self._confirming())
        elif self.confirmer.done():
            self.confirmer.result()  # a failure surfaces here
            self.confirmer = asyncio.create_task(self._confirming())

    async def _confirming(self) -> None:
        while self.pending:
            wait = self.written + CURSOR_EVERY - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            batches, self.pending = self.pending, []
            acked: dict[int, list[int]] = defaultdict(list)
            for futures, sent in batches:
                await asyncio.gather(*futures)
                for p, ids in sent.items():
                    acked[p] += ids
            await mark_published(self.conn, acked)
            self.written = time.perf_counter()

    async def finish(self) -> None:
        """Until everything handed over is acknowledged and its cursor moved."""
        while self.confirmer is not None and not self.confirmer.done():
            await self.confirmer
        if self.confirmer is not None:
            self.confirmer.result()


@dataclass
class Written:
    """The write in flight: its task and what it publishes once committed."""

    task: asyncio.Task[list[int]]
    batch: Batch


class Drain:
    """The ceiling consuming the environment's input topics into ``settings.pg_schema`` (fresh,
    migrated), resumable: ``until(n)`` applies inputs until n in all are applied.

    Overlapped as the processor: while a poll's write is in flight the next poll is fetched,
    read (on a connection of its own) and decided; the write is then awaited, its outbox handed
    to the producer, and the next write started."""

    def __init__(self, settings: Settings, max_records: int = 5000) -> None:
        self.settings = settings
        self.max_records = max_records
        self.ceiling = SameWork(settings)
        self.applied = 0
        self.topics = [settings.topic_commands, settings.topic_observations]
        self.in_flight: Written | None = None

    async def __aenter__(self) -> Drain:
        s = self.settings
        session = {"search_path": s.pg_schema}
        self.conn = await asyncpg.connect(s.pg_dsn, server_settings=session)
        self.read_conn = await asyncpg.connect(s.pg_dsn, server_settings=session)
        self.cursor_conn = await asyncpg.connect(s.pg_dsn, server_settings=session)
        for conn in (self.conn, self.read_conn):
            await conn.execute(BATCH_SESSION)
        self.consumer = AIOKafkaConsumer(
            **kafka_client_args(s, "processor"),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=s.processor_fetch_max_wait_ms,
            # The processor's fetch sizes (services/processor/ahead.py): the default 1 MiB a
            # partition took more fetches for the same log.
            max_partition_fetch_bytes=4 * 1024 * 1024,
            fetch_max_bytes=16 * 1024 * 1024,
        )
        self.producer = AIOKafkaProducer(
            **kafka_client_args(s, "processor"),
            enable_idempotence=True,
            acks="all",
            linger_ms=2,
            max_batch_size=256 * 1024,
        )
        await self.consumer.start()
        await self.producer.start()
        self.consumer.assign(
            [TopicPartition(t, p) for t in self.topics for p in range(s.kafka_partitions)]
        )
        self.publisher = Publisher(self.producer, self.cursor_conn)
        return self

    async def __aexit__(self, *_: object) -> None:
        tasks: list[asyncio.Task[Any] | None] = [self.publisher.confirmer]
        if self.in_flight is not None:
            tasks.append(self.in_flight.task)
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task])
        await self.consumer.stop()
        await self.producer.stop()
        for conn in (self.conn, self.read_conn, self.cursor_conn):
            await conn.close()

    def backends(self) -> list[int]:
        return [c.get_server_pid() for c in (self.conn, self.read_conn, self.cursor_conn)]

    async def poll(self) -> int:
        """Fetch, read and decide one poll (as the processor: each partition's two topics
        merged by record time) while the last one's write is in flight, then hand that one's
        outbox over and start this one's write; the inputs decided."""
        polled = await self.consumer.getmany(timeout_ms=200, max_records=self.max_records)
        per_partition: dict[int, list[list[Record]]] = defaultdict(list)
        for tp, records in polled.items():
            if records:
                per_partition[tp.partition].append(records)
        if not per_partition:
            await self.settle()
            return 0
        ceiling, batch = self.ceiling, Batch()
        parsed = [
            ceiling.parse(record)
            for lists in per_partition.values()
            for record in heapq.merge(*lists, key=lambda r: r.timestamp)
        ]
        expected = await read(ceiling, self.read_conn, parsed, set(per_partition))
        moved = dict(expected)
        for i, (record, message, cause) in enumerate(parsed):
            batch.keys[message.key] = record.partition  # fenced too: the processor's read has it
            tp = (record.topic, record.partition)
            if record.offset < moved[tp]:
                continue  # applied already (a redelivery): fenced, as the processor does
            ceiling.decide(record, message, cause, batch)
            moved[tp] = record.offset + 1
            if i % SLICE == SLICE - 1:  # the write in flight goes on meanwhile
                await asyncio.sleep(0)
        batch.outbox += ceiling.checkpoint_records(batch, moved)
        ceiling.decided(batch, moved, expected)
        await self.settle(batch)
        write = write_poll(ceiling, self.conn, batch, moved, expected)
        self.in_flight = Written(asyncio.create_task(write), batch)
        self.applied += len(batch.history)
        return len(batch.history)

    async def settle(self, deciding: Batch | None = None) -> None:
        """The write in flight committed, its rows kept as the processor keeps them (those of
        ``deciding``, the poll decided meanwhile, stay), and its outbox handed to the
        producer."""
        if self.in_flight is not None:
            written, self.in_flight = self.in_flight, None
            ids = await written.task
            self.ceiling.committed(written.batch, deciding)
            await self.publisher.publish(ids, written.batch.outbox)

    async def until(self, total: int) -> None:
        """Apply inputs until ``total`` are applied, and publish their outbox."""
        while self.applied < total:
            await self.poll()
        await self.settle()
        await self.publisher.finish()


async def measured_drain(
    settings: Settings, total: int, max_records: int = 5000, broker: int | None = None
) -> Drained:
    """Apply the environment's whole input log as the processor would, timed and its CPU
    counted by the observer that times the processor (``services.bench.drained``)."""
    async with Drain(settings, max_records) as drain:
        task = asyncio.create_task(drain.until(total))
        observer = asyncio.create_task(timed_drain(settings, total, drain.backends, broker))
        done, _ = await asyncio.wait([task, observer], return_when=asyncio.FIRST_COMPLETED)
        if task in done and task.exception() is not None:
            observer.cancel()
            await asyncio.wait([observer])
            task.result()  # raises
        drained = await observer
        await task
    return drained
