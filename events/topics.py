"""Conventions shared by every producer and consumer of the log."""

from __future__ import annotations

from aiokafka.partitioner import murmur2

# Every message about a sandbox is keyed by its name, so all of them land in one partition.
COMMANDS = "sandbox.commands"
OBSERVATIONS = "sandbox.observations"
EVENTS = "sandbox.events"
DEADLETTER = "sandbox.deadletter"
# The processor's chain checkpoints: the newest hash of each history chain a batch wrote, so
# that the record in PostgreSQL can be checked against the log (docs/audit.md).
CHECKPOINTS = "sandbox.checkpoints"

# The largest record the project's producers send (key and value): Kafka's default
# message.max.bytes, 1,048,588 bytes a record batch, with room for the batch's own bytes.
MAX_RECORD_BYTES = 1_000_000
# The largest input record the processor decides: what it decides from one (an event carrying
# the spec it holds, and the fields the event adds) then fits in MAX_RECORD_BYTES.
MAX_INPUT_BYTES = 900_000

# PostgreSQL NOTIFY channel the processor signals after each committed batch. Both channels
# are named per schema (the migrations' notify_channel; services/common/notify_channels.py):
# these are the base names, the public schema's own.
CHANGES_CHANNEL = "sandstream_changes"
# The channel that wakes the pool controller: every pool or template write, and every batch of
# the processor that wrote a pool member's row (other rows are no news to it).
POOLS_CHANNEL = "sandstream_pools"


def record_key(sandbox_name: str) -> bytes:
    return sandbox_name.encode()


def partition_for(key: bytes, partitions: int) -> int:
    """The partition every record keyed ``key`` belongs on: Kafka's default partitioner
    (murmur2 of the key bytes, sign bit cleared, modulo the partition count), which the Java
    client and aiokafka use. Per-sandbox order rests on it, so the processor checks it."""
    hashed: int = murmur2(key)
    return (hashed & 0x7FFFFFFF) % partitions
