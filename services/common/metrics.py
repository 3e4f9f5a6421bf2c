"""Prometheus metrics of the roles (exposed by the API's /metrics under `sandstream up`, and by
each role process's health endpoint when the roles run as separate processes)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

INPUTS = Counter(
    "sandstream_inputs_total", "Input records recorded by the processor", ["disposition"]
)
FENCED = Counter(
    "sandstream_fenced_records_total",
    "Records skipped because PostgreSQL already holds a later offset (redelivery or zombie)",
)
WRITE_CONFLICTS = Counter(
    "sandstream_write_conflicts_total",
    "Batches decided again because another writer moved their offsets after they were read",
)
ROW_VERSION_CONFLICTS = Counter(
    "sandstream_row_version_conflicts_total",
    "Batches decided again because a sandbox row was not at the version they were decided "
    "from (a sandbox written from two partitions: should stay 0)",
)
CHAIN_CONFLICTS = Counter(
    "sandstream_chain_conflicts_total",
    "Batches decided again because another writer linked an entry onto a history chain head "
    "they linked onto (a record dead-lettered on a partition its key is not on)",
)
DECIDED_AHEAD = Counter(
    "sandstream_decided_ahead_total",
    "Polls the processor decided while the previous poll's write was in flight (decided), "
    "and those then written as decided (written); the rest were discarded (that write "
    "failed, or partitions moved) and decided again",
    ["outcome"],
)
STOPPED_PARTITIONS = Gauge(
    "sandstream_processor_stopped_partition_offset",
    "Input partitions this processor stopped at a record PostgreSQL refuses to store even as "
    "a dead letter: the record's offset (absent when none is stopped)",
    ["topic", "partition"],
)
INPUT_GAPS = Counter(
    "sandstream_processor_input_gaps_total",
    "Polls whose records of a partition started above the offset applied (never written: "
    "the partitions were read again from the stored offsets)",
)
PUBLISHED = Counter("sandstream_outbox_published_total", "Outbox records sent to Kafka")
OUTBOX_GAPS = Counter(
    "sandstream_outbox_gaps_total",
    "Publish cursors stopped below an outbox record committed by another owner and not sent",
)
OUTBOX_SET_ASIDE = Counter(
    "sandstream_outbox_set_aside_total",
    "Outbox records set aside, not sent: larger than the largest record the processor sends",
    ["topic"],
)
TASK_RESTARTS = Counter(
    "sandstream_task_restarts_total",
    "Long-running tasks of `sandstream up` restarted after they crashed",
    ["task"],
)
TASK_UP = Gauge(
    "sandstream_task_up", "Whether a supervised long-running task is running (1) or not", ["task"]
)
# Roles run as separate processes (services/common/health.py serves these with the rest)
ASSIGNED_PARTITIONS = Gauge(
    "sandstream_assigned_partitions",
    "Partitions of its consumer group this process owns now, by role (processor, executor)",
    ["role"],
)
LEASE_HELD = Gauge(
    "sandstream_lease_held",
    "Whether this process holds a single-active role's lease (1: active) or waits (0)",
    ["lease"],
)
BATCH_SECONDS = Histogram(
    "sandstream_batch_seconds",
    "Time to read, decide and commit one poll's batch",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
DRIVER_CALLS = Counter(
    "sandstream_driver_calls_total",
    "Driver operations run by the executor",
    ["operation", "outcome"],
)

HANDED = Counter(
    "sandstream_executor_handed_total",
    "Decided events the processor handed to the executor in its process (sandstream up), by "
    "what became of them (queued: run a Kafka hop before the log delivers them; not_owned: "
    "another executor's partition, the log delivers them there)",
    ["outcome"],
)

KAFKA_REQUESTS = Counter(
    "sandstream_kafka_requests_total",
    "Kafka requests this process's clients sent, by client id (sandstream-<role>, the "
    "processor's consumer its name) and request type (Produce, Fetch, Heartbeat, ...)",
    ["client", "request"],
)

# The HTTP API (services/api.py)
API_REQUESTS = Counter(
    "sandstream_api_requests_total",
    "HTTP requests by method, route template and status",
    ["method", "route", "status"],
)
API_REQUEST_SECONDS = Histogram(
    "sandstream_api_request_seconds",
    "HTTP request time by method and route template (watch streams: their whole life)",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
PROVIDER_SYNC_UNREADABLE = Gauge(
    "sandstream_provider_sync_unreadable_values",
    "Values the provider-sync controller found but could not read at its last pass (not UTF-8, "
    "or unopenable): their stored values are kept; the log names them",
)
PROVIDER_OUTBOX = Gauge(
    "sandstream_provider_outbox_pending",
    "Commands of provider changes (rotation restarts, detaches of a forced delete) stored and "
    "not yet acknowledged by Kafka, as the last relay pass of this process counted them",
)
API_COMMANDS = Counter(
    "sandstream_api_commands_total",
    "Commands received by the API: published, retry (answered from a stored outcome), "
    "unavailable (Kafka did not acknowledge), forbidden (Kafka refused it for want of an ACL), "
    "too_large",
    ["type", "result"],
)
API_WATCHERS = Gauge("sandstream_api_watch_streams", "Open /v1/watch streams")
API_COMMAND_STEP_SECONDS = Histogram(
    "sandstream_api_command_step_seconds",
    "Where a command's time in the API goes: pool_wait (for one of the API's PostgreSQL "
    "connections), record (its idempotency record and any earlier outcome), publish (until "
    "Kafka acknowledged it), mark_published (the record marked so, the pool wait included)",
    ["step"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)

# Operator lifecycle: the scheduler, and the counts `status` shows (set when /metrics is read)
DEADLINES_FIRED = Counter(
    "sandstream_deadlines_published_total",
    "DeadlineDue messages the scheduler published, by deadline kind",
    ["deadline"],
)
SANDBOXES_ATTENTION = Gauge(
    "sandstream_sandboxes_attention",
    "Live sandboxes past a deadline (past_deadline), held, or expiring within "
    "expiring_soon_seconds (expiring_soon)",
    ["state"],
)
POOL_MEMBERS = Gauge(
    "sandstream_pool_members",
    "Unclaimed members of each warm pool by phase, as the pool controller last read them "
    "(Requested: creates asked for and not decided yet)",
    ["pool", "phase"],
)
POOL_COMMANDS = Counter(
    "sandstream_pool_commands_total",
    "Commands the pool controller published (create: a new member; delete: a failed, surplus "
    "or outdated one)",
    ["command"],
)
POOL_CLAIMS = Counter(
    "sandstream_pool_claims_total",
    "Creates from a pooled template the API served, by pool and path (warm: a member adopted; "
    "cold: the fallback create)",
    ["pool", "path"],
)
POOL_CLAIM_SECONDS = Histogram(
    "sandstream_pool_claim_seconds",
    "How long the API took to answer a claim, by path (warm or cold)",
    ["path"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
