"""Which Kafka log the offsets in PostgreSQL belong to: the cluster id and the input topics' ids.

PostgreSQL stores the next input offset per topic partition. Those numbers mean something only
for the log they were read from: after the broker's data is wiped, or a topic is deleted and
created again, the same names start again at offset 0, and every new input would be dropped
as "already applied". So the processor records the cluster id and the topic ids (Kafka's
Metadata API, version 12, which aiokafka does not expose: its request is declared here with
aiokafka's own protocol types) next to the offsets on first use, compares them at every start
and rebalance, and refuses to run on another log until an operator adopts it
(``sandstream log adopt``), which is recorded in ``log_adoptions``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import asyncpg
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.protocol.abstract import AbstractType
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    Boolean,
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

UNKNOWN_TOPIC = 3  # UNKNOWN_TOPIC_OR_PARTITION


class _Uuid(AbstractType[uuid.UUID]):  # type: ignore[misc]
    @classmethod
    def encode(cls, value: uuid.UUID) -> bytes:
        return value.bytes

    @classmethod
    def decode(cls, data: BytesIO) -> uuid.UUID:
        raw = data.read(16)
        if len(raw) != 16:
            raise ValueError("Buffer underrun decoding a UUID")
        return uuid.UUID(bytes=raw)


class _MetadataResponseV12(Response):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 12
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("brokers", CompactArray(
            ("node_id", Int32), ("host", CompactString("utf-8")), ("port", Int32),
            ("rack", CompactString("utf-8")), ("tags", TaggedFields),
        )),
        ("cluster_id", CompactString("utf-8")),
        ("controller_id", Int32),
        ("topics", CompactArray(
            ("error_code", Int16), ("name", CompactString("utf-8")), ("topic_id", _Uuid),
            ("is_internal", Boolean),
            ("partitions", CompactArray(
                ("error_code", Int16), ("partition_index", Int32), ("leader_id", Int32),
                ("leader_epoch", Int32), ("replica_nodes", CompactArray(Int32)),
                ("isr_nodes", CompactArray(Int32)), ("offline_replicas", CompactArray(Int32)),
                ("tags", TaggedFields),
            )),
            ("topic_authorized_operations", Int32), ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )  # fmt: skip


class _MetadataRequestV12(RequestStruct):  # type: ignore[misc]
    FLEXIBLE_VERSION = True
    API_KEY = 3
    API_VERSION = 12
    RESPONSE_TYPE = _MetadataResponseV12
    SCHEMA = Schema(
        ("topics", CompactArray(
            ("topic_id", _Uuid), ("name", CompactString("utf-8")), ("tags", TaggedFields),
        )),
        ("allow_auto_topic_creation", Boolean),
        ("include_topic_authorized_operations", Boolean),
        ("tags", TaggedFields),
    )  # fmt: skip


class _TopicIdsRequest(Request[_MetadataRequestV12]):  # type: ignore[misc]
    API_KEY = 3

    def __init__(self, topics: list[str]) -> None:
        self._topics = topics

    def build(self, request_struct_class: type[_MetadataRequestV12]) -> _MetadataRequestV12:
        topics: list[Any] = [(uuid.UUID(int=0), name, {}) for name in self._topics]
        return request_struct_class(topics, False, False, {})


@dataclass(frozen=True, slots=True)
class LogIdentity:
    cluster_id: str
    topic_ids: dict[str, uuid.UUID]  # input topic name -> topic id


class LogMismatch(RuntimeError):
    """The Kafka log is not the one the offsets stored in PostgreSQL were read from."""


async def read_log_identity(connection: Mapping[str, Any], topics: list[str]) -> LogIdentity:
    """The cluster id and the ids of ``topics`` (a missing topic is an error); ``connection``:
    the client's keyword arguments (bootstrap servers, security)."""
    client = AIOKafkaClient(**{**connection, "client_id": "sandstream-log-identity"})
    try:
        await client.bootstrap()
        return await log_identity_of(client, topics)
    finally:
        await client.close()


async def log_identity_of(client: Any, topics: list[str]) -> LogIdentity:
    """Like ``read_log_identity``, through a started aiokafka client. The brokers are asked in
    turn until one answers: one that is down (a restart, a crash) is still in the metadata for
    a while: asking one at random failed a processor's start a third of the time while one
    broker of three was down."""
    nodes = sorted(broker.nodeId for broker in client.cluster.brokers())
    failure: KafkaError = KafkaConnectionError("Kafka named no broker")
    for node in nodes:
        try:
            response = await client.send(node, _TopicIdsRequest(topics))
        except KafkaError as exc:  # that broker is away or does not answer: ask the next
            failure = exc
            continue
        return _identity_from(response)
    raise failure


def _identity_from(response: Any) -> LogIdentity:
    found: dict[str, uuid.UUID] = {}
    for error_code, name, topic_id, *_ in response.topics:
        if error_code == UNKNOWN_TOPIC:
            raise LogMismatch(f"Kafka has no topic {name}")
        if error_code != 0:
            raise RuntimeError(f"Kafka metadata of {name}: error {error_code}")
        found[name] = topic_id
    return LogIdentity(cluster_id=response.cluster_id, topic_ids=found)


def differences(recorded: dict[str, tuple[str, uuid.UUID]], current: LogIdentity) -> list[str]:
    """What differs between the recorded (cluster id, topic id) per topic and ``current``."""
    out = []
    for topic, (cluster_id, topic_id) in sorted(recorded.items()):
        if cluster_id != current.cluster_id:
            out.append(f"{topic}: cluster {current.cluster_id}, recorded {cluster_id}")
        elif current.topic_ids.get(topic) != topic_id:
            out.append(f"{topic}: topic id {current.topic_ids.get(topic)}, recorded {topic_id}")
    return out


async def recorded_identity(conn: Any, topics: list[str]) -> dict[str, tuple[str, uuid.UUID]]:
    rows = await conn.fetch(
        "SELECT topic, cluster_id, topic_id FROM log_identity WHERE topic = ANY($1::text[])",
        topics,
    )
    return {r["topic"]: (r["cluster_id"], r["topic_id"]) for r in rows}


ADOPT_HINT = (
    "If the log was replaced on purpose (its old records are gone), `sandstream log adopt "
    "--reason TEXT` makes PostgreSQL follow the new log from its start."
)


async def check_log_identity(pool: asyncpg.Pool[asyncpg.Record], current: LogIdentity) -> None:
    """Record ``current`` for topics seen for the first time; raise LogMismatch if a recorded
    topic now has another id or lives in another cluster."""
    topics = sorted(current.topic_ids)
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO log_identity (topic, cluster_id, topic_id) "
            "SELECT t, $1, i FROM unnest($2::text[], $3::uuid[]) AS u(t, i) "
            "ON CONFLICT (topic) DO NOTHING",
            current.cluster_id,
            topics,
            [current.topic_ids[t] for t in topics],
        )
        problems = differences(await recorded_identity(conn, topics), current)
    if problems:
        raise LogMismatch(
            "the Kafka log is not the one the offsets stored in PostgreSQL were read from ("
            + "; ".join(problems)
            + "): the processor would drop every new input as already applied, so it does "
            "not start. " + ADOPT_HINT
        )


@dataclass(frozen=True, slots=True)
class Adoption:
    id: int
    topics: list[str]
    given_up: dict[str, int]  # input records the old log had per topic, by stored offsets


async def adopt_log(
    pool: asyncpg.Pool[asyncpg.Record], current: LogIdentity, *, actor: str, reason: str
) -> Adoption:
    """Follow ``current`` from its start: record the adoption, the new ids and what is given
    up; the stored offsets of its topics start again at 0, and their history rows (offsets of
    the old log) are kept under the name ``topic@old-topic-id``."""
    topics = sorted(current.topic_ids)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("LOCK TABLE input_offsets IN EXCLUSIVE MODE")  # no batch commits now
        recorded = await recorded_identity(conn, topics)
        offsets = await conn.fetch(
            "SELECT topic, partition, next_offset FROM input_offsets WHERE topic = ANY($1::text[])",
            topics,
        )
        stored = {f"{r['topic']}/{r['partition']}": r["next_offset"] for r in offsets}
        adoption_id = await conn.fetchval(
            "INSERT INTO log_adoptions (actor, reason, old_identity, new_identity, old_offsets) "
            "VALUES ($1, $2, $3, $4, $5) RETURNING id",
            actor,
            reason,
            json.dumps(
                {t: {"cluster_id": c, "topic_id": str(i)} for t, (c, i) in recorded.items()}
            ),
            json.dumps(
                {
                    t: {"cluster_id": current.cluster_id, "topic_id": str(current.topic_ids[t])}
                    for t in topics
                }
            ),
            json.dumps(stored),
        )
        for topic, (_, old_id) in recorded.items():
            await conn.execute(
                "UPDATE history SET topic = $2 WHERE topic = $1", topic, f"{topic}@{old_id}"
            )
        await conn.execute("DELETE FROM input_offsets WHERE topic = ANY($1::text[])", topics)
        await conn.execute(
            "INSERT INTO log_identity (topic, cluster_id, topic_id) "
            "SELECT t, $1, i FROM unnest($2::text[], $3::uuid[]) AS u(t, i) "
            "ON CONFLICT (topic) DO UPDATE SET cluster_id = EXCLUDED.cluster_id, "
            "topic_id = EXCLUDED.topic_id, recorded_at = now()",
            current.cluster_id,
            topics,
            [current.topic_ids[t] for t in topics],
        )
    given_up: dict[str, int] = {}
    for r in offsets:
        given_up[r["topic"]] = given_up.get(r["topic"], 0) + r["next_offset"]
    return Adoption(adoption_id, topics, given_up)
