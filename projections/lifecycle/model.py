"""The read model's row (``Sandbox``), the processor's ``Limits`` and a ``Decision``: the
values every other module of the rules reads or returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, Literal
from uuid import UUID

from events.commands import Command
from events.common import (
    Deadline,
    ExitPolicy,
    ExpiryPolicy,
    Hold,
    Phase,
    Restarts,
    SandboxSpec,
    TemplateRef,
)
from events.decided import DecidedEvent
from events.observations import Observation
from events.outcomes import CommandOutcome

Message = Command | Observation


Disposition = Literal["applied", "idempotent", "rejected", "ignored", "duplicate"]


SANDBOX_NS: Final = UUID("6f1c9a52-4d3b-4a8e-9a57-0d5b1e0c7a11")


IDENTITY_NS: Final = UUID("0b7d3e8c-2f41-4c55-8f0e-6a2d9c4b1e22")


EVENT_NS: Final = UUID("9e4a1f6d-7c28-4b93-a1d5-3f8e2b6c0d33")


# Phase is a StrEnum: a member formats as its value (f"{phase}" writes what phase.value is,
# without the enum property's Python call on every reason).
P = Phase


@dataclass(frozen=True, slots=True)
class Sandbox:
    """One row of the read model: a live sandbox, or the tombstone of a deleted one."""

    key: str
    sandbox_id: UUID
    phase: Phase
    generation: int
    version: int
    spec: SandboxSpec
    providers: tuple[str, ...]
    identity: str
    exit_code: int | None
    reason: str | None
    created_at: datetime
    updated_at: datetime
    # Operator lifecycle (deadlines, time to live, completion policy, hold).
    deadline: Deadline | None = field(default=None, kw_only=True)
    expires_at: datetime | None = field(default=None, kw_only=True)
    on_expiry: ExpiryPolicy = field(default="stop", kw_only=True)
    on_exit: ExitPolicy = field(default="keep", kw_only=True)
    hold: Hold | None = field(default=None, kw_only=True)
    # Rotations decided while this generation's launch was pending (provider -> revision): the
    # launch must report having read at least these, or the agent restarts once more.
    awaited: dict[str, int] = field(default_factory=dict, kw_only=True)
    # The restart policy's record (None: nothing to record yet, e.g. under Never).
    restarts: Restarts | None = field(default=None, kw_only=True)
    # The template revision the create resolved its spec from (None: a full spec was given).
    template: TemplateRef | None = field(default=None, kw_only=True)
    # Claims (docs/adr/0009). A pool member: its pool (kept after adoption, as provenance),
    # the name it was adopted as (None again once the adoption is abandoned) and the claim that
    # adopted it (kept: no other claim adopts it).
    pool: str | None = field(default=None, kw_only=True)
    adopted_as: str | None = field(default=None, kw_only=True)
    claim_id: str | None = field(default=None, kw_only=True)
    # A name bound to an adopted member: this key's row is a tombstone (nothing runs under it)
    # that points at the member (``claim_id``: the claim that bound it).
    bound_to: str | None = field(default=None, kw_only=True)
    # A claim that brought env or providers: the providers it attached (those the member had
    # not) and the generation it was adopted at (None: no such claim). Every exec through
    # sandstream's doors gets the spec's env and those providers' values (while attached), and
    # while that generation runs its process never read them (a rotation or detach of only
    # these restarts nothing: docs/pools.md).
    claim_providers: tuple[str, ...] = field(default=(), kw_only=True)
    adopted_generation: int | None = field(default=None, kw_only=True)
    # When this generation's runtime was seen to exit (the exit's time, the backend's clock;
    # None while no exit of it is known): a running of it dated no later comes late
    # (observations.ran_before_its_exit).
    exited_at: datetime | None = field(default=None, kw_only=True)

    @property
    def tombstoned(self) -> bool:
        return self.phase is P.DELETED


def is_held(sandbox: Sandbox | None) -> bool:
    """Whether an operator holds the sandbox: start, restart, expiry, the completion policy and
    credential rotation all leave a held sandbox alone."""
    return sandbox is not None and sandbox.hold is not None


# The reason of a Deleting row whose last delete failed (deadlines.delete_failure_reason).
DELETE_FAILED: Final = "DeleteFailed"


def awaits_delete_retry(sandbox: Sandbox) -> bool:
    """A Deleting row whose delete failed and whose delete deadline will ask again: nothing is
    to be done before then (the back-off, not a pick-up, times the next attempt)."""
    return (
        sandbox.phase is P.DELETING
        and sandbox.deadline is not None
        and (sandbox.reason or "").startswith(DELETE_FAILED)
    )


# The reason of a Stopping row whose last stop failed with the runtime still running (or its
# state unknown): deadlines.failure_reason, and SandboxStopRetried's.
STOP_FAILED: Final = "StopFailed"


def awaits_stop_retry(sandbox: Sandbox) -> bool:
    """A Stopping row whose stop failed and whose retry deadline will ask again: its deadline
    is the retry's (not the escalation's), and a pick-up before it would undo the back-off."""
    return (
        sandbox.phase is P.STOPPING
        and sandbox.deadline is not None
        and (sandbox.reason or "").startswith(STOP_FAILED)
    )


# The reason of a sandbox the idle rule suspended (Suspending, kept in Suspended): no one
# asked, so the row says why.
IDLE_SUSPEND: Final = "IdleSuspend"


def idle_suspended(sandbox: Sandbox) -> bool:
    return (sandbox.reason or "").startswith(IDLE_SUSPEND)


# The reason of a sandbox whose time to live ended where its policy had nothing to stop
# (Stopped, Suspending, Suspended): kept in Suspended, where a wake on access must not resume
# it (services/api/wake.py), as no call starts a sandbox stopped by its expiry.
EXPIRED: Final = "Expired"


def expired(reason: str | None, expires_at: datetime | None) -> bool:
    """Its time to live ended and was not extended since (the row's reason and expiry)."""
    return expires_at is None and (reason or "").startswith(f"{EXPIRED}:")


def suspended_reason(state: Sandbox) -> str | None:
    """Suspended keeps a reason that says why it is suspended (an idle suspend's) or that its
    time to live ended meanwhile (no wake resumes it then); an operator's suspend has none."""
    if idle_suspended(state) or expired(state.reason, state.expires_at):
        return state.reason
    return None


@dataclass(frozen=True, slots=True)
class Limits:
    """How long each guarded phase may last (seconds; None: no deadline). The processor's
    configuration: the deadlines it computes travel in the decided events, so the rebuild from
    the log reproduces them whatever the configuration is then."""

    launch_seconds: float | None = 300.0
    # How long the executor retries a transient launch failure before it reports it (its
    # executor_retry_seconds): the launch deadline lies beyond it, so that report is decided.
    launch_retry_seconds: float = 600.0
    stop_grace_seconds: float = 10.0  # the driver's grace when the spec sets none
    stop_margin_seconds: float | None = 30.0
    # The first retry of a failed delete or stop; each further one waits twice as long.
    delete_seconds: float | None = 120.0
    delete_backoff_max_seconds: float = 1800.0
    # A generation Ready at least this long before it ends resets the restart back-off.
    restart_reset_seconds: float = 600.0


DEFAULT_LIMITS: Final = Limits()


@dataclass(frozen=True, slots=True)
class Decision:
    state: Sandbox | None
    events: tuple[DecidedEvent, ...]
    disposition: Disposition
    reason: str
    outcome: CommandOutcome | None = None
    # Commands this decision sends onto the commands topic, keyed by another sandbox (a
    # claim's next step: docs/adr/0009). Their ids are deterministic: a replay sends the same.
    commands: tuple[Command, ...] = ()
