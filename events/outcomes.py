"""Command outcomes: every command ends accepted or rejected with a code and a message."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal
from uuid import UUID

from events.common import CommandId, Phase, SandboxName, Strict


class Code(StrEnum):
    OK = "OK"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"  # client expected_version mismatch
    INVALID_ARGUMENT = "INVALID_ARGUMENT"


class CommandOutcome(Strict):
    command_id: CommandId
    key: SandboxName
    command_type: str
    status: Literal["accepted", "rejected"]
    code: Code
    message: str
    sandbox_id: UUID | None = None
    phase: Phase | None = None
    generation: int | None = None
    version: int | None = None
    identity: str | None = None

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"
