"""``sandstream_kafka_requests_total`` counts every request a client built from
``kafka_client_args`` sends to the real broker, under the client's id (``sandstream-<role>``
unless given) and the request's type."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from harness import eventually, isolated_env
from prometheus_client import REGISTRY

from services.common.kafka_clients import kafka_client_args
from services.common.kafka_requests import request_type
from services.common.settings import load_settings


def sent(client: str, request: str) -> float:
    labels = {"client": client, "request": request}
    return REGISTRY.get_sample_value("sandstream_kafka_requests_total", labels) or 0.0


def test_a_request_type_is_named_without_its_version() -> None:
    class FetchRequest_v4:
        pass

    class HeartbeatRequest:
        pass

    assert request_type(FetchRequest_v4()) == "Fetch"
    assert request_type(HeartbeatRequest()) == "Heartbeat"


def test_a_clients_id_is_sandstream_and_its_role_unless_given() -> None:
    settings = load_settings()
    assert kafka_client_args(settings, "api")["client_id"] == "sandstream-api"
    assert kafka_client_args(settings, "api", "reader")["client_id"] == "reader"


async def test_each_produce_and_fetch_is_counted_under_the_clients_id() -> None:
    async with isolated_env(partitions=1) as env:
        s = env.settings
        # Ids of their own: other tests in this process count under the roles' ids.
        producer = AIOKafkaProducer(
            **kafka_client_args(s, "api", "sandstream-test-writer"), acks="all"
        )
        consumer = AIOKafkaConsumer(
            s.topic_commands,
            **kafka_client_args(s, "audit", "sandstream-test-reader"),
            auto_offset_reset="earliest",
        )
        await producer.start()
        await consumer.start()
        try:
            produced, fetched = (
                sent("sandstream-test-writer", "Produce"),
                sent("sandstream-test-reader", "Fetch"),
            )
            for _ in range(3):
                await producer.send_and_wait(s.topic_commands, b"x", key=b"k")
            assert sent("sandstream-test-writer", "Produce") == produced + 3
            got = await consumer.getmany(timeout_ms=10_000)
            assert sum(len(r) for r in got.values()) >= 1
            await eventually(
                lambda: sent("sandstream-test-reader", "Fetch") - fetched,
                lambda n: n >= 1,
                what="the reader's fetches counted",
            )
            assert sent("sandstream-test-writer", "Fetch") == 0.0  # the producer fetches nothing
        finally:
            await consumer.stop()
            await producer.stop()
