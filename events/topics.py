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

# PostgreSQL NOTIFY channel the processor signals after each committed batch.
CHANGES_CHANNEL = "sandstream_changes"


def record_key(sandbox_name: str) -> bytes:
    return sandbox_name.encode()


def partition_for(key: bytes, partitions: int) -> int:
    """The partition every record keyed ``key`` belongs on: Kafka's default partitioner
    (murmur2 of the key bytes, sign bit cleared, modulo the partition count), which the Java
    client and aiokafka use. Per-sandbox order rests on it, so the processor checks it."""
    hashed: int = murmur2(key)
    return (hashed & 0x7FFFFFFF) % partitions
