"""Every Kafka request this process's clients send, counted by client and request type.

``sandstream_kafka_requests_total{client, request}`` says which part of sandstream (each
client's id: ``sandstream-<role>`` by default, see ``kafka_client_args``) loads the broker
with what (Produce, Fetch, Heartbeat, OffsetCommit, Metadata, ...). aiokafka has no hook for
it: every request of a producer, consumer or admin client passes through its connection's
``send``, which this wraps once per process.
"""

from __future__ import annotations

import re
from typing import Any

from aiokafka.conn import AIOKafkaConnection

from services.common.metrics import KAFKA_REQUESTS

_VERSION = re.compile(r"(Request)?(_v\d+)?$")


def request_type(request: Any) -> str:
    """``FetchRequest`` or ``FetchRequest_v4`` -> ``Fetch``."""
    return _VERSION.sub("", type(request).__name__) or type(request).__name__


def count_requests() -> None:
    """Wrap aiokafka's connections' ``send`` (once) to count each request sent."""
    send = AIOKafkaConnection.send
    if getattr(send, "counted", False):
        return

    def counted(self: AIOKafkaConnection, request: Any, expect_response: bool = True) -> Any:
        KAFKA_REQUESTS.labels(self._client_id, request_type(request)).inc()
        return send(self, request, expect_response)

    counted.counted = True  # type: ignore[attr-defined]
    AIOKafkaConnection.send = counted
