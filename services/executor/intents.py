"""What each decided event or progressing row asks of the driver (an ``Intent``), and the pure
rules the executor applies to it: whether the row still wants it, whether it is slow, whether
a later intent makes it pointless.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final
from uuid import UUID

from drivers.protocol import LaunchSpec
from events.common import Phase
from events.decided import (
    AgentRestarted,
    DecidedEvent,
    SandboxCreated,
    SandboxDeleteRetried,
    SandboxDeleting,
    SandboxFailed,
    SandboxStarting,
    SandboxStopping,
    SandboxStopRetried,
    SandboxSuspending,
    SandboxTimedOut,
)
from events.observations import Operation
from projections.lifecycle import Sandbox, awaits_delete_retry, awaits_stop_retry
from projections.lifecycle.providers import DETACH_RESTART, ROTATION_RESTART


@dataclass(frozen=True, slots=True)
class Intent:
    """One driver operation for one sandbox: from a decided event, or from a row the reconcile
    loop found still waiting for it (``pickup``)."""

    operation: Operation
    key: str
    sandbox_id: UUID
    generation: int
    result_id: str  # the observation id of its result
    actor: str  # whose command it serves: the lane it runs in when slow
    launch: LaunchSpec | None = None
    previous_generation: int | None = None  # a start's or restart's older generation
    cleanup: bool = False  # a stop after a failed or timed-out launch: wanted while Error
    # A stop of a runtime of an older generation than its row's (the reconcile loop's
    # ``stop_stale``): wanted while the row is at a newer generation and not launching.
    stale: bool = False
    # A stop of the current generation's runtime running under a Stopped row (the reconcile
    # loop's ``stop_stray``): wanted while the row is Stopped at that generation; a suspend of
    # one left under a Suspended row (``remove_suspended``): wanted while it is Suspended.
    stray: bool = False
    # The launch of a rotation or detach restart (AgentRestarted): it takes no lane, so one
    # provider change's restarts never wait behind one another (``takes_lane``).
    for_providers: bool = False
    # A delete of a tombstoned incarnation's leftovers (the reconcile loop's ``collect``):
    # wanted while that incarnation is not live (its tombstone, or a name re-created since).
    leftover: bool = False


def intent_of(event: DecidedEvent) -> Intent | None:
    """The driver operation a decided event asks for, if any."""
    base = Intent(
        "launch", event.key, event.sandbox_id, event.generation, f"result:{event.event_id}",
        event.actor,
    )  # fmt: skip
    match event:
        case SandboxCreated():
            return replace(base, launch=LaunchSpec.from_event(event))
        case SandboxStarting() | AgentRestarted():
            return replace(
                base,
                launch=LaunchSpec.from_event(event),
                previous_generation=event.previous_generation,
                for_providers=isinstance(event, AgentRestarted),
            )
        case SandboxStopping() | SandboxStopRetried():
            return replace(base, operation="stop")
        case SandboxSuspending():
            return replace(base, operation="suspend")
        case SandboxTimedOut():  # a timed-out launch: clean up its runtime if it came up
            return replace(base, operation="stop", cleanup=True)
        case SandboxFailed(launch_failed=True):
            # A launch that reported its failure may leave a runtime that never ran: a
            # Kubernetes Pod whose image cannot be pulled stays Pending, holding its node's
            # resources and its Secret, and would lift the row to Ready by itself if a later
            # pull succeeded. Stopped once the failure is decided (never racing it). Not after
            # any other failure: a launch still under way (a restore that fell back to a fresh
            # container) must not lose the runtime it is starting.
            return replace(base, operation="stop", cleanup=True)
        case SandboxDeleting() | SandboxDeleteRetried():
            return replace(base, operation="delete")
    return None


def intent_of_row(row: Sandbox, actor: str = "reconciler") -> Intent | None:
    """What a row in a progressing phase still wants done (the reconcile loop's pick-up)."""
    base = Intent(
        "launch", row.key, row.sandbox_id, row.generation,
        f"result:row:{row.sandbox_id}:{row.version}", actor,
    )  # fmt: skip
    match row.phase:
        case Phase.PROVISIONING | Phase.STARTING:
            spec = LaunchSpec(row.key, row.sandbox_id, row.generation, row.identity, row.spec)
            if row.phase is Phase.PROVISIONING:
                return replace(base, launch=spec)
            # A start or restart: generations of one incarnation count up one at a time. The
            # row's reason tells a rotation or detach restart (restart_reason) from the others.
            return replace(
                base,
                launch=spec,
                previous_generation=row.generation - 1,
                for_providers=(row.reason or "").startswith((ROTATION_RESTART, DETACH_RESTART)),
            )
        case Phase.STOPPING:
            # A failed stop waits for its retry deadline, as a failed delete does.
            return None if awaits_stop_retry(row) else replace(base, operation="stop")
        case Phase.SUSPENDING:
            return replace(base, operation="suspend")
        case Phase.DELETING:
            # A failed delete waits for its deadline's retry: picking it up every other pass
            # would undo the back-off (and add a failure to the history each time).
            return None if awaits_delete_retry(row) else replace(base, operation="delete")
    return None


# What the row must look like for each operation to still be wanted.
WANTED_PHASES: Final[dict[Operation, tuple[Phase, ...]]] = {
    "launch": (Phase.PROVISIONING, Phase.STARTING),
    "stop": (Phase.STOPPING,),
    "suspend": (Phase.SUSPENDING,),
    "delete": (Phase.DELETING,),
}
# The cleanup stop of a timed-out launch (the row went to Error; a runtime that came up late
# moves it to Ready): wanted at that generation until the row moves on.
CLEANUP_PHASES: Final = (Phase.ERROR, Phase.READY, Phase.STOPPING)
# The stop of a runtime found running under a Stopped row of its generation, the suspend of
# one left under a Suspended row.
STRAY_PHASES: Final[dict[Operation, tuple[Phase, ...]]] = {
    "stop": (Phase.STOPPED,),
    "suspend": (Phase.SUSPENDED,),
}


def unwanted(intent: Intent, row: Sandbox | None) -> str | None:
    """Why the row no longer wants ``intent`` (None: it does). The row is the truth, the
    intent only a hint: a redelivered or replayed intent the row has moved past is dropped."""
    if intent.leftover:
        if row is not None and row.sandbox_id == intent.sandbox_id and not row.tombstoned:
            return f"incarnation {intent.sandbox_id} is live ({row.phase})"
        return None
    if row is None:
        return "no row"
    if row.sandbox_id != intent.sandbox_id:
        return f"the name now belongs to incarnation {row.sandbox_id} ({row.phase})"
    if intent.stale:
        if row.generation <= intent.generation:
            return f"the row is at generation {row.generation}"
        if row.phase in WANTED_PHASES["launch"]:
            return f"the row is {row.phase}: its launch removes the older generations"
        return None
    if intent.operation != "delete" and row.generation != intent.generation:
        return f"the row is at generation {row.generation}"
    wanted = (
        CLEANUP_PHASES
        if intent.cleanup
        else STRAY_PHASES[intent.operation]
        if intent.stray
        else WANTED_PHASES[intent.operation]
    )
    if row.phase not in wanted:
        return f"the row is {row.phase} (version {row.version})"
    return None


# A suspend is a stop followed by the runtime's removal: its deadline counts from its decision
# as a stop's does, so it takes no lane either.
STOPS: Final = ("stop", "suspend")


def is_slow(intent: Intent) -> bool:
    """Operations that may wait out a grace period (stop, delete, a launch replacing an older
    generation): they run in their caller's lane, never in the shared slots."""
    return intent.operation != "launch" or intent.previous_generation is not None


def takes_lane(intent: Intent) -> bool:
    """Whether a slow call waits for its caller's lane: a delete, and the launch of a start or
    restart an operator asked for. Two slow calls do not, because a deadline counts from their
    decision and leaves no room for a wait of k / width grace periods behind the caller's
    others (docs/drivers.md): a stop (grace period + margin, then a kill, which came before
    the SIGTERM of a stop still waiting) and a rotation or detach restart (grace period + retry
    window + launch timeout: one provider change restarts every attached sandbox under one
    caller). They are bounded by the driver alone."""
    return is_slow(intent) and intent.operation not in STOPS and not intent.for_providers


def supersedes(later: Intent, earlier: Intent) -> bool:
    """Whether ``later`` (of the same key, later in its partition) makes ``earlier`` pointless.

    A delete removes every runtime of its incarnation, and a launch removes every older
    generation's runtime (stopping it first): a launch or stop before them in the same
    incarnation would only produce a result the processor ignores as stale.
    """
    if later.key != earlier.key or later.sandbox_id != earlier.sandbox_id:
        return False
    if earlier.operation not in ("launch", *STOPS):
        return False
    if later.operation == "delete":
        return True
    return later.operation == "launch" and later.generation > earlier.generation


@dataclass(frozen=True, slots=True)
class Dropped:
    """An intent the row no longer wants: finished without a driver call or a result."""

    reason: str
