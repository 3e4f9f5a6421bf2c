"""Observations: what drivers and the executor saw, on the observations topic.

Every observation carries the generation read from the runtime object itself (a container or
pod label), so the processor can tell stale and unknown runtimes from the current one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from events.common import (
    SCHEMA_VERSION,
    Actor,
    DeadlineKind,
    Generation,
    SandboxName,
    Strict,
    Timestamp,
)

RuntimeState = Literal["created", "running", "exited"]
ObservedState = Literal["created", "running", "exited", "absent"]
Source = Literal["watch", "list", "reconcile"]
Operation = Literal["launch", "stop", "delete"]
OperationOutcome = Literal["succeeded", "failed", "already_absent"]


class ObservationBase(Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    observation_id: Annotated[str, Field(min_length=1, max_length=200)]
    key: SandboxName
    generation: Generation
    occurred_at: Timestamp
    actor: Actor  # the driver or component that observed it, e.g. "podman-watcher"


class RuntimeSnapshot(ObservationBase):
    type: Literal["RuntimeSnapshot"]
    state: RuntimeState
    exit_code: int | None = None
    runtime_id: str | None = None
    source: Source = "watch"


class RuntimeRemoved(ObservationBase):
    type: Literal["RuntimeRemoved"]
    runtime_id: str | None = None
    source: Source = "watch"


class DriverOperationResult(ObservationBase):
    type: Literal["DriverOperationResult"]
    operation: Operation
    outcome: OperationOutcome
    retryable: bool = False
    reason: str | None = None
    identity: str | None = None
    # What the backend looked like after a failed operation, so the row can follow it.
    observed: ObservedState | None = None
    exit_code: int | None = None


class DeadlineDue(ObservationBase):
    """The scheduler's word that a deadline recorded in the row has passed: time on the log.

    ``deadline`` and ``due_at`` name the deadline exactly as the row held it when the scheduler
    read it, so a repeat (a restarted scheduler catching up) or a deadline the row no longer
    holds changes nothing. ``generation`` is the row's: an older one is stale.
    """

    type: Literal["DeadlineDue"]
    deadline: DeadlineKind
    due_at: Timestamp


Observation = Annotated[
    RuntimeSnapshot | RuntimeRemoved | DriverOperationResult | DeadlineDue,
    Field(discriminator="type"),
]
