"""The Kafka client's repeated log lines are let through once per window, with a count."""

from __future__ import annotations

import logging

from services.common.log_filter import RateLimited


def record(name: str, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, (), None)


def test_a_repeated_kafka_client_line_is_let_through_once_per_window_with_a_count() -> None:
    now = [0.0]
    limit = RateLimited(window=30.0, clock=lambda: now[0])
    passed = []
    for second in range(0, 65):
        now[0] = float(second)
        for _ in range(10):  # ten a second, as aiokafka does against a dead broker
            r = record("aiokafka.client", "Unable connect to node with id %s")
            if limit.filter(r):
                passed.append((second, r.getMessage() if r.args else str(r.msg)))
    assert [s for s, _ in passed] == [0, 30, 60]
    assert "[299 more like it in 30s not shown]" in passed[1][1]
    assert limit.filter(record("sandstream.processor", "x"))  # our own lines are not limited
    assert limit.filter(record("sandstream.processor", "x"))
