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
    Int32,
    ProviderName,
    SandboxName,
    Strict,
    Text,
    Timestamp,
)

# "stopping": it still runs, but its removal is under way (a Kubernetes Pod with a deletion
# timestamp, a Podman container in Podman's "stopping" state): it will end in an exit or a
# removal, and no phase takes it as running.
RuntimeState = Literal["created", "running", "stopping", "exited"]
ObservedState = Literal["created", "running", "exited", "absent"]
Source = Literal["watch", "list", "reconcile"]
Operation = Literal["launch", "stop", "suspend", "delete"]
OperationOutcome = Literal["succeeded", "failed", "already_absent"]


class ObservationBase(Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    observation_id: Annotated[Text, Field(min_length=1, max_length=200)]
    key: SandboxName
    generation: Generation
    occurred_at: Timestamp
    actor: Actor  # the driver or component that observed it, e.g. "podman-watcher"


class RuntimeSnapshot(ObservationBase):
    type: Literal["RuntimeSnapshot"]
    state: RuntimeState
    exit_code: Int32 | None = None  # an `integer` column
    runtime_id: Text | None = None
    source: Source = "watch"


class RuntimeRemoved(ObservationBase):
    type: Literal["RuntimeRemoved"]
    runtime_id: Text | None = None
    source: Source = "watch"


class DriverOperationResult(ObservationBase):
    type: Literal["DriverOperationResult"]
    operation: Operation
    outcome: OperationOutcome
    retryable: bool = False
    reason: Text | None = None
    identity: Text | None = None
    # What the backend looked like after a failed operation, so the row can follow it.
    observed: ObservedState | None = None
    exit_code: Int32 | None = None  # an `integer` column
    # A launch that started its runtime: the revision of each attached provider whose values
    # it read (names and revisions only). None: not known (nothing read, or an adopted runtime).
    credentials: dict[ProviderName, Annotated[int, Field(ge=0)]] | None = None


class DeadlineDue(ObservationBase):
    """The scheduler's word that a deadline recorded in the row has passed: time on the log.

    ``deadline`` and ``due_at`` name the deadline exactly as the row held it when the scheduler
    read it, so a repeat (a restarted scheduler catching up) or a deadline the row no longer
    holds changes nothing. ``generation`` is the row's: an older one is stale. An ``idle``
    deadline is held by no row: it says that a Ready sandbox with an idle timeout was last used
    at ``last_used_at`` (as the doors recorded it), and the fold decides whether that is idle.
    """

    type: Literal["DeadlineDue"]
    deadline: DeadlineKind
    due_at: Timestamp
    # An idle deadline's evidence: the last use the doors recorded (None: none recorded). Left
    # out while unset, so other deadlines serialize as before.
    last_used_at: Timestamp | None = Field(default=None, exclude_if=lambda v: v is None)


Observation = Annotated[
    RuntimeSnapshot | RuntimeRemoved | DriverOperationResult | DeadlineDue,
    Field(discriminator="type"),
]
