"""Prometheus metrics of the processor and executor (exposed by the API's /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

INPUTS = Counter(
    "sandstream_inputs_total", "Input records recorded by the processor", ["disposition"]
)
FENCED = Counter(
    "sandstream_fenced_records_total",
    "Records skipped because PostgreSQL already holds a later offset (redelivery or zombie)",
)
PUBLISHED = Counter("sandstream_outbox_published_total", "Outbox records sent to Kafka")
BATCH_SECONDS = Histogram(
    "sandstream_batch_seconds",
    "Time to decide and commit one partition batch",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
DRIVER_CALLS = Counter(
    "sandstream_driver_calls_total",
    "Driver operations run by the executor",
    ["operation", "outcome"],
)
