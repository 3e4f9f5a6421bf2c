"""Decided events: what the lifecycle processor concluded, on the events topic.

Each event is one accepted state change of one sandbox and bumps its version by one, so folding
the events of a key in version order rebuilds its row exactly. Events that carry an intent
(launch, stop, delete) are what the executor acts on.
"""

from __future__ import annotations

from typing import Annotated, Literal
from uuid import UUID

from pydantic import Field

from events.common import (
    SCHEMA_VERSION,
    Actor,
    Cause,
    Generation,
    Phase,
    ProviderName,
    SandboxName,
    SandboxSpec,
    Strict,
    Timestamp,
)
from events.observations import Operation


class EventBase(Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    event_id: UUID
    key: SandboxName
    sandbox_id: UUID
    version: Annotated[int, Field(ge=1)]  # the row's version after this event
    generation: Generation  # the row's generation after this event
    occurred_at: Timestamp
    actor: Actor
    cause: Cause


class SandboxCreated(EventBase):
    """A new incarnation in Provisioning; intent: launch this generation."""

    type: Literal["SandboxCreated"]
    spec: SandboxSpec
    providers: list[ProviderName]
    identity: str


class SandboxStarting(EventBase):
    """Start or restart accepted: new generation and its runtime identity, minted together.

    Intent: remove the runtimes of older generations (stopping them first), then launch this one.
    """

    type: Literal["SandboxStarting"]
    reason: Literal["start", "restart"]
    previous_generation: Generation
    spec: SandboxSpec
    identity: str


class SandboxReady(EventBase):
    type: Literal["SandboxReady"]


class SandboxStopping(EventBase):
    """Stop accepted. Intent: stop this generation's runtime, keeping the workspace."""

    type: Literal["SandboxStopping"]


class SandboxStopped(EventBase):
    type: Literal["SandboxStopped"]


class SandboxCompleted(EventBase):
    type: Literal["SandboxCompleted"]
    exit_code: int


class SandboxFailed(EventBase):
    type: Literal["SandboxFailed"]
    reason: str
    exit_code: int | None = None


class SandboxOperationFailed(EventBase):
    """A driver stop or delete failed; the row follows the phase the backend was observed in."""

    type: Literal["SandboxOperationFailed"]
    operation: Operation
    phase: Phase
    reason: str
    exit_code: int | None = None


class SandboxDeleting(EventBase):
    """Delete accepted. Intent: remove every runtime of the sandbox and its workspace."""

    type: Literal["SandboxDeleting"]


class SandboxDeleted(EventBase):
    """The tombstone: (key, last generation, deleted). Nothing of this incarnation comes back."""

    type: Literal["SandboxDeleted"]


class ProviderAttached(EventBase):
    type: Literal["ProviderAttached"]
    provider: ProviderName


class ProviderDetached(EventBase):
    type: Literal["ProviderDetached"]
    provider: ProviderName


class AgentRestarted(EventBase):
    """Credentials of attached providers rotated and the sandbox was running: a new generation.

    Intent: like SandboxStarting, remove the older generations' runtimes and launch this one
    (which reads the current values at launch).
    """

    type: Literal["AgentRestarted"]
    providers: list[ProviderName]
    previous_generation: Generation
    spec: SandboxSpec
    identity: str


class AgentRestartSkipped(EventBase):
    """A rotation did not restart the sandbox, and why (the row changes only its version)."""

    type: Literal["AgentRestartSkipped"]
    providers: list[ProviderName]
    reason: str


class AgentRestartFailed(EventBase):
    """The launch of a rotation restart failed (after the executor's retries): Error."""

    type: Literal["AgentRestartFailed"]
    reason: str
    exit_code: int | None = None


DecidedEvent = Annotated[
    SandboxCreated
    | SandboxStarting
    | SandboxReady
    | SandboxStopping
    | SandboxStopped
    | SandboxCompleted
    | SandboxFailed
    | SandboxOperationFailed
    | SandboxDeleting
    | SandboxDeleted
    | ProviderAttached
    | ProviderDetached
    | AgentRestarted
    | AgentRestartSkipped
    | AgentRestartFailed,
    Field(discriminator="type"),
]
