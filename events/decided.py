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
    ClaimEnv,
    ClaimId,
    ClaimLabels,
    Deadline,
    ExitPolicy,
    ExpiryPolicy,
    Generation,
    Hold,
    IdleSeconds,
    MaxRestarts,
    Phase,
    PoolName,
    ProviderName,
    RestartBackoff,
    RestartPolicy,
    SandboxName,
    SandboxSpec,
    Strict,
    TemplateRef,
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
    deadline: Deadline | None = None
    expires_at: Timestamp | None = None
    on_expiry: ExpiryPolicy = "stop"
    on_exit: ExitPolicy = "keep"
    # The create's template revision (left out while unset: events without one read as before).
    template: TemplateRef | None = Field(default=None, exclude_if=lambda v: v is None)
    # A warm pool's member; left out while unset, so other creates serialize as before.
    pool: PoolName | None = Field(default=None, exclude_if=lambda v: v is None)


class SandboxStarting(EventBase):
    """Start or restart accepted: new generation and its runtime identity, minted together.

    Intent: remove the runtimes of older generations (stopping them first), then launch this one.
    """

    type: Literal["SandboxStarting"]
    reason: Literal["start", "restart", "resume"]
    previous_generation: Generation
    spec: SandboxSpec
    identity: str
    deadline: Deadline | None = None
    # A restart the restart policy scheduled (SandboxRestartScheduled) falling due: the policy
    # and the restarts in a row. Left out otherwise, so other starts serialize as before.
    policy: RestartPolicy | None = Field(default=None, exclude_if=lambda v: v is None)
    attempt: Annotated[int, Field(ge=1)] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )


class SandboxReady(EventBase):
    type: Literal["SandboxReady"]


class SandboxStopping(EventBase):
    """Stop accepted. Intent: stop this generation's runtime, keeping the workspace."""

    type: Literal["SandboxStopping"]
    deadline: Deadline | None = None


class SandboxStopped(EventBase):
    type: Literal["SandboxStopped"]


class SandboxSuspending(EventBase):
    """Suspend accepted. Intent: stop this generation's runtime and remove it, keeping the
    workspace."""

    type: Literal["SandboxSuspending"]
    deadline: Deadline | None = None
    # Why, when no operator asked (an idle suspend: ``IdleSuspend: ...``); left out while unset,
    # so a SuspendSandbox's event serializes as before.
    reason: str | None = Field(default=None, exclude_if=lambda v: v is None)


class SandboxSuspended(EventBase):
    """The runtime is gone, the workspace kept: nothing of the sandbox runs until a resume."""

    type: Literal["SandboxSuspended"]


class SandboxCompleted(EventBase):
    type: Literal["SandboxCompleted"]
    exit_code: int


class SandboxFailed(EventBase):
    type: Literal["SandboxFailed"]
    reason: str
    exit_code: int | None = None
    # Decided on its launch's own failed report (nothing of the generation ran): the executor
    # then removes what the launch left (a Kubernetes Pod whose image cannot be pulled stays
    # Pending). Left out when unset, so failures recorded before it read as they did.
    launch_failed: bool = Field(default=False, exclude_if=lambda v: not v)


class SandboxOperationFailed(EventBase):
    """A driver stop or delete failed. A delete stays Deleting (``phase``), its deadline kept
    for the retry; a stop stays Stopping with the retry's ``deadline`` unless the backend was
    seen not running (``phase`` Stopped). Decided by older rules, a stop or delete followed the
    phase the backend was observed in."""

    type: Literal["SandboxOperationFailed"]
    operation: Operation
    phase: Phase
    reason: str
    exit_code: int | None = None
    deadline: Deadline | None = None  # a failed stop's retry (None: kept, or none)


class SandboxDeleting(EventBase):
    """Delete accepted. Intent: remove every runtime of the sandbox and its workspace."""

    type: Literal["SandboxDeleting"]
    deadline: Deadline | None = None


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
    """Credentials of attached providers rotated (``providers``), or providers were detached
    (``detached``), while the agent ran with their old values: a new generation.

    Intent: like SandboxStarting, remove the older generations' runtimes and launch this one
    (which reads the current values, of the providers attached now, at launch).
    """

    type: Literal["AgentRestarted"]
    providers: list[ProviderName]
    detached: list[ProviderName] = Field(default_factory=list)
    previous_generation: Generation
    spec: SandboxSpec
    identity: str
    deadline: Deadline | None = None  # the launch deadline, as SandboxStarting's


class AgentRestartSkipped(EventBase):
    """A rotation did not restart the sandbox, and why (the row changes only its version)."""

    type: Literal["AgentRestartSkipped"]
    providers: list[ProviderName]
    reason: str
    # Restart already pending (Provisioning/Starting): the revisions its launch must have read.
    # Recorded in the row until the launch reports what it read (``Sandbox.awaited``).
    awaits: dict[ProviderName, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)


class AgentRestartFailed(EventBase):
    """The launch of a rotation restart failed (after the executor's retries): Error."""

    type: Literal["AgentRestartFailed"]
    reason: str
    exit_code: int | None = None


# -- Operator lifecycle: deadlines, time to live, holds. Each follows a DeadlineDue observation
# or an operator's command; the ones with an intent say so.


class SandboxTimedOut(EventBase):
    """Provisioning or Starting outlived its deadline: Error (``reason`` ProvisioningTimeout).

    Intent: clean up, i.e. stop this generation's runtime if it came up after all.
    """

    type: Literal["SandboxTimedOut"]
    reason: str


class SandboxStopEscalated(EventBase):
    """Stopping outlived the grace period plus a margin. Intent: kill this generation's runtime
    at once (the stop under way is not waited for)."""

    type: Literal["SandboxStopEscalated"]
    # The kill of a suspend whose row's reason says why it suspends or that its time to live
    # ended: the row keeps that reason (a wake must not resume an expired sandbox). Decided,
    # not derived when folded, so an escalation recorded before the field folds as it did.
    keeps_reason: bool = Field(default=False, exclude_if=lambda v: not v)


class SandboxDeleteRetried(EventBase):
    """Deleting outlived its deadline: the delete is asked for again (``deadline.attempt``), and
    the next deadline is further out (back-off). Intent: delete, as SandboxDeleting."""

    type: Literal["SandboxDeleteRetried"]
    deadline: Deadline


class SandboxStopRetried(EventBase):
    """A failed stop's retry deadline fell due: the stop is asked for again
    (``deadline.attempt``), and the next deadline is further out (the delete's back-off).
    Intent: stop, as SandboxStopping."""

    type: Literal["SandboxStopRetried"]
    deadline: Deadline


class SandboxExpired(EventBase):
    """The time to live ended. What it does follows as its own event in the same decision
    (SandboxStopping or SandboxDeleting) when the phase admits it."""

    type: Literal["SandboxExpired"]
    policy: ExpiryPolicy


class SandboxExtended(EventBase):
    type: Literal["SandboxExtended"]
    expires_at: Timestamp


class SandboxHeld(EventBase):
    type: Literal["SandboxHeld"]
    hold: Hold


class SandboxReleased(EventBase):
    type: Literal["SandboxReleased"]


# -- The restart policy (spec.restart_policy): an exit it restarts after schedules the restart
# (time on the log, as a deadline of kind ``restart``); the scheduler's DeadlineDue then starts
# the next generation (SandboxStarting with ``policy``).


class SandboxRestartScheduled(EventBase):
    """The current generation ended (``reason``, ``exit_code``) and ``policy`` restarts it at
    ``deadline.due_at``, the ``deadline.attempt``-th restart in a row. The phase stays (Error or
    Completed) until then; a stop, hold, delete, start or restart cancels it."""

    type: Literal["SandboxRestartScheduled"]
    policy: RestartPolicy
    reason: str
    exit_code: int | None = None
    deadline: Deadline
    backoff_reset: bool = False  # the generation was Ready long enough: attempts count anew


class SandboxRestartsExhausted(EventBase):
    """The current generation ended and ``policy`` would restart it, but ``restarts`` restarts
    in a row reached ``max_restarts``: the sandbox stays in Error with ``reason``."""

    type: Literal["SandboxRestartsExhausted"]
    policy: RestartPolicy
    restarts: int
    reason: str
    exit_reason: str  # how the generation ended
    exit_code: int | None = None


class RestartPolicyChanged(EventBase):
    """SetRestartPolicy accepted: the spec's restart fields are these now."""

    type: Literal["RestartPolicyChanged"]
    restart_policy: RestartPolicy
    restart_backoff: RestartBackoff | None = None
    max_restarts: MaxRestarts | None = None


class IdleSuspendChanged(EventBase):
    """SetIdleSuspend accepted: the spec's idle timeout is this now (None: never)."""

    type: Literal["IdleSuspendChanged"]
    idle_suspend_seconds: IdleSeconds | None = None


# -- Claims (docs/adr/0009): adoption on the member's key, the name on the claimant's key.


class SandboxAdopted(EventBase):
    """A Ready pool member adopted by ``claim_id`` for the name ``claimant``: it leaves its pool
    (the row keeps ``pool`` as provenance) and takes the claim's ``labels``, ``env`` and
    ``providers`` and its expiry, without a restart.
    The processor then sends BindSandboxName on the claimant's key."""

    type: Literal["SandboxAdopted"]
    claimant: SandboxName
    claim_id: ClaimId
    labels: ClaimLabels = Field(default_factory=dict)
    # The claim's time to live, counted from the adoption (None: the member's expiry stands),
    # its env (merged into the spec: added or replaced) and the providers it attaches (names);
    # left out while unset, so adoptions without them serialize as before.
    expires_at: Timestamp | None = Field(default=None, exclude_if=lambda v: v is None)
    env: ClaimEnv = Field(default_factory=dict, exclude_if=lambda v: not v)
    providers: list[ProviderName] = Field(default_factory=list, exclude_if=lambda v: not v)


class SandboxAdoptionAbandoned(EventBase):
    """The claimant's name was refused to this adoption: the member is deleted (a
    SandboxDeleting follows in the same decision)."""

    type: Literal["SandboxAdoptionAbandoned"]
    claimant: SandboxName
    claim_id: ClaimId
    reason: str


class SandboxNameBound(EventBase):
    """The name ``key`` now stands for the adopted member ``target`` (``sandbox_id`` is the
    member's). The name's row is a tombstone of its own (no sandbox runs under this key) that
    points at the member; a create of the name is refused while it does."""

    type: Literal["SandboxNameBound"]
    target: SandboxName
    claim_id: ClaimId
    spec: SandboxSpec


class SandboxNameReleased(EventBase):
    """The member ``target`` the name stood for is deleted: the name is free again."""

    type: Literal["SandboxNameReleased"]
    target: SandboxName
    claim_id: ClaimId


DecidedEvent = Annotated[
    SandboxCreated
    | SandboxStarting
    | SandboxReady
    | SandboxStopping
    | SandboxSuspending
    | SandboxSuspended
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
    | AgentRestartFailed
    | SandboxTimedOut
    | SandboxStopEscalated
    | SandboxDeleteRetried
    | SandboxStopRetried
    | SandboxExpired
    | SandboxExtended
    | SandboxHeld
    | SandboxReleased
    | SandboxRestartScheduled
    | SandboxRestartsExhausted
    | RestartPolicyChanged
    | IdleSuspendChanged
    | SandboxAdopted
    | SandboxAdoptionAbandoned
    | SandboxNameBound
    | SandboxNameReleased,
    Field(discriminator="type"),
]
