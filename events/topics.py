"""Conventions shared by every producer and consumer of the log."""

from __future__ import annotations

# Every message about a sandbox is keyed by its name, so all of them land in one partition.
COMMANDS = "sandbox.commands"
OBSERVATIONS = "sandbox.observations"
EVENTS = "sandbox.events"
DEADLETTER = "sandbox.deadletter"

# PostgreSQL NOTIFY channel the processor signals after each committed batch.
CHANGES_CHANNEL = "sandstream_changes"


def record_key(sandbox_name: str) -> bytes:
    return sandbox_name.encode()
