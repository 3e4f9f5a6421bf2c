"""``evolve``: apply one decided event to a row, used live by ``decide`` and by the rebuild from
the log (``_CHANGES``, one entry per event type).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any, Final

from events.decided import (
    AgentRestarted,
    AgentRestartFailed,
    AgentRestartSkipped,
    DecidedEvent,
    IdleSuspendChanged,
    ProviderAttached,
    ProviderDetached,
    SandboxAdopted,
    SandboxAdoptionAbandoned,
    SandboxCompleted,
    SandboxCreated,
    SandboxDeleted,
    SandboxDeleteRetried,
    SandboxDeleting,
    SandboxExpired,
    SandboxExtended,
    SandboxFailed,
    SandboxHeld,
    SandboxNameBound,
    SandboxNameReleased,
    SandboxOperationFailed,
    SandboxReady,
    SandboxReleased,
    SandboxStarting,
    SandboxStopEscalated,
    SandboxStopped,
    SandboxStopping,
    SandboxStopRetried,
    SandboxSuspended,
    SandboxSuspending,
    SandboxTimedOut,
)
from projections.records import maker, replaced

from .model import (
    EXPIRED,
    STOP_FAILED,
    P,
    Sandbox,
    awaits_stop_retry,
    suspended_reason,
)
from .providers import OWED_PHASES, restart_reason
from .restarts import (
    RESTART_CHANGES,
    held_defers,
    released,
    restarts_on_ready,
    restarts_on_start,
    started_reason,
)

# evolve: apply one decided event to a row (used live and by the rebuild from the log)


_new_row = maker(Sandbox)  # every field, in order: Sandbox(...) through its slots


def evolve(state: Sandbox | None, event: DecidedEvent) -> Sandbox:
    if type(event) is SandboxCreated:  # the decided events are final classes
        return _new_row(
            event.key, event.sandbox_id, P.PROVISIONING, event.generation, event.version,
            event.spec, tuple(sorted(set(event.providers))), event.identity,
            None,  # exit_code
            None,  # reason
            event.occurred_at,  # created_at
            event.occurred_at,  # updated_at
            event.deadline, event.expires_at, event.on_expiry, event.on_exit,
            None,  # hold
            {},  # awaited
            None,  # restarts
            event.template,
            event.pool, None, None, None,  # pool, adopted_as, claim_id, bound_to
            (), None,  # claim_providers, adopted_generation
            None,  # exited_at
        )  # fmt: skip
    if type(event) is SandboxNameBound and state is None:  # a name never used before
        return _new_row(
            event.key, event.sandbox_id, P.DELETED, event.generation, event.version,
            event.spec, (), "", None, None, event.occurred_at, event.occurred_at,
            None, None, "stop", "keep", None, {}, None, None,
            None, None, event.claim_id, event.target, (), None, None,
        )  # fmt: skip
    if state is None:
        raise ValueError(f"{event.type} for {event.key!r} before SandboxCreated")
    new = replaced(
        state,
        version=event.version,
        generation=event.generation,
        # Never back: an input stamped by a clock behind ours (a driver's) may decide.
        updated_at=max(state.updated_at, event.occurred_at),
        **_changes(state, event),
    )
    # Awaited rotations belong to one generation that may run on older values: a new
    # generation, or a phase where it cannot (Ready: decided; Stopped, Completed, Deleting: the
    # next start reads the newest), clears them.
    if new.awaited and (new.generation != state.generation or new.phase not in OWED_PHASES):
        new = replace(new, awaited={})
    exited_at = _exited_at(state, new, event)
    return new if exited_at == new.exited_at else replace(new, exited_at=exited_at)


# The events that end a generation by its runtime's exit when they carry an exit code.
_EXITS: Final = (SandboxCompleted, SandboxFailed, AgentRestartFailed)


def _exited_at(state: Sandbox, new: Sandbox, event: DecidedEvent) -> datetime | None:
    """The exit's time, kept while the row stays in the phase that exit led to (Completed,
    Error) at that generation; None otherwise (a new generation, Ready again, a delete)."""
    if isinstance(event, _EXITS) and event.exit_code is not None:
        return event.occurred_at
    if new.generation != state.generation or new.phase not in (P.COMPLETED, P.ERROR):
        return None
    return state.exited_at


# The fields each event sets besides version, generation and updated_at, by the event's type
# (one dict lookup: a match over the classes runs an isinstance check per case). A phase change
# sets the new phase's deadline (None for phases without one).
_Changes = Callable[[Sandbox, Any], dict[str, Any]]


_CHANGES: Final[dict[type[DecidedEvent], _Changes]] = {
    SandboxStarting: lambda s, e: {"phase": P.STARTING, "spec": e.spec, "identity": e.identity,
                                   "exit_code": None, "reason": started_reason(e),
                                   "deadline": e.deadline, **restarts_on_start(s, e)},
    SandboxReady: lambda s, e: {"phase": P.READY, "exit_code": None, "reason": None,
                                "deadline": None, **restarts_on_ready(s, e)},
    SandboxStopping: lambda s, e: {"phase": P.STOPPING, "deadline": e.deadline},
    SandboxStopped: lambda s, e: {"phase": P.STOPPED, "reason": None, "deadline": None},
    # An idle suspend's reason stays until the resume (suspended_reason).
    SandboxSuspending: lambda s, e: {"phase": P.SUSPENDING, "deadline": e.deadline,
                                     **({"reason": e.reason} if e.reason else {})},
    SandboxSuspended: lambda s, e: {"phase": P.SUSPENDED, "deadline": None,
                                    "reason": suspended_reason(s)},
    SandboxCompleted: lambda s, e: {"phase": P.COMPLETED, "exit_code": e.exit_code,
                                    "reason": None, "deadline": None},
    SandboxFailed: lambda s, e: {"phase": P.ERROR, "exit_code": e.exit_code, "reason": e.reason,
                                 "deadline": None},
    # A failed delete stays Deleting and keeps its deadline (the next retry) and the exit code
    # of the agent's process; a failed stop that stays Stopping takes the retry's deadline; a
    # failed stop that ended it, and failures decided by older rules, set the phase they name.
    SandboxOperationFailed: lambda s, e: (
        {"reason": e.reason} if e.phase is P.DELETING
        else {"reason": e.reason, "deadline": e.deadline} if e.phase is P.STOPPING
        else {"phase": e.phase, "exit_code": e.exit_code, "reason": e.reason, "deadline": None}
    ),
    SandboxDeleting: lambda s, e: {"phase": P.DELETING, "deadline": e.deadline},
    SandboxDeleted: lambda s, e: {"phase": P.DELETED, "deadline": None},
    ProviderAttached: lambda s, e: {"providers": tuple(sorted({*s.providers, e.provider}))},
    ProviderDetached: lambda s, e: _detached(s, e),
    AgentRestarted: lambda s, e: {"phase": P.STARTING, "spec": e.spec, "identity": e.identity,
                                  "exit_code": None, "deadline": e.deadline,
                                  "reason": restart_reason(e.providers, e.detached)},
    AgentRestartSkipped: lambda s, e: _merge_awaited(s, e),
    AgentRestartFailed: lambda s, e: {"phase": P.ERROR, "exit_code": e.exit_code,
                                      "reason": e.reason, "deadline": None},
    SandboxTimedOut: lambda s, e: {"phase": P.ERROR, "exit_code": None, "reason": e.reason,
                                   "deadline": None},
    # A suspend's kill keeps the reason Suspended keeps (an idle suspend's, an expiry's), when
    # the decision says so: a wake must not resume a sandbox whose time to live ended.
    SandboxStopEscalated: lambda s, e: {"deadline": None, "reason": (
        s.reason if e.keeps_reason
        else "StopTimeout: the stop outlived its grace period; killing"
    )},
    SandboxStopRetried: lambda s, e: {
        "reason": f"{STOP_FAILED}: not stopped yet; retry {e.deadline.attempt} under way",
        "deadline": e.deadline,
    },
    SandboxDeleteRetried: lambda s, e: {
        "reason": f"DeleteTimeout: not deleted yet; retry {e.deadline.attempt}",
        "deadline": e.deadline,
    },
    # In Deleting the row's reason says why the delete is not done yet (DeleteFailed), and in
    # a failing stop why it is not stopped yet (StopFailed, which also marks its deadline as
    # the retry's): an expiry falling due meanwhile changes nothing of that.
    SandboxExpired: lambda s, e: {"expires_at": None, "reason": (
        s.reason if s.phase is P.DELETING or awaits_stop_retry(s)
        else f"{EXPIRED}: time to live ended ({e.policy})"
    )},
    SandboxExtended: lambda s, e: {"expires_at": e.expires_at},
    SandboxHeld: held_defers,
    SandboxAdopted: lambda s, e: _adopted(s, e),
    # The name went to another: the member is not the claimant's (its claim_id stays, so no
    # other claim adopts it while it is deleted).
    SandboxAdoptionAbandoned: lambda s, e: {
        "adopted_as": None,
        "reason": s.reason if s.phase is P.DELETING else f"AdoptionAbandoned: {e.reason}",
    },
    SandboxNameBound: lambda s, e: {
        "sandbox_id": e.sandbox_id, "spec": e.spec, "bound_to": e.target,
        "claim_id": e.claim_id,
    },
    SandboxNameReleased: lambda s, e: {"bound_to": None},
    SandboxReleased: released,
    IdleSuspendChanged: lambda s, e: {
        "spec": s.spec.model_copy(update={"idle_suspend_seconds": e.idle_suspend_seconds})
    },
    **RESTART_CHANGES,
}  # fmt: skip


def _detached(state: Sandbox, event: ProviderDetached) -> dict[str, Any]:
    """The provider leaves the row; in OWED_PHASES it is awaited (revision 0: the generation
    must not have read it, DETACH_PENDING)."""
    changes: dict[str, Any] = {
        "providers": tuple(p for p in state.providers if p != event.provider),
        "claim_providers": tuple(p for p in state.claim_providers if p != event.provider),
    }
    if state.phase in OWED_PHASES:
        changes["awaited"] = {event.provider: 0, **state.awaited}
    return changes


def _adopted(state: Sandbox, event: SandboxAdopted) -> dict[str, Any]:
    """The claim's labels and env merged into the spec (added or replaced), its providers
    attached, its expiry set (none: the member's stands)."""
    spec = state.spec
    if event.labels or event.env:
        spec = spec.model_copy(
            update={"labels": {**spec.labels, **event.labels}, "env": {**spec.env, **event.env}}
        )
    changes: dict[str, Any] = {"adopted_as": event.claimant, "claim_id": event.claim_id,
                               "spec": spec}  # fmt: skip
    if event.env or event.providers:  # what the running process lacks: execs get it
        changes["providers"] = tuple(sorted({*state.providers, *event.providers}))
        changes["claim_providers"] = tuple(sorted(event.providers))
        changes["adopted_generation"] = event.generation
    if event.expires_at is not None:
        changes["expires_at"] = event.expires_at
    return changes


def _merge_awaited(state: Sandbox, event: AgentRestartSkipped) -> dict[str, Any]:
    if not event.awaits:
        return {}
    merged = dict(state.awaited)
    for provider, revision in event.awaits.items():
        merged[provider] = max(revision, merged.get(provider, 0))
    return {"awaited": merged}


def _changes(state: Sandbox, event: DecidedEvent) -> dict[str, Any]:
    """The fields an event sets besides version, generation and updated_at."""
    changes = _CHANGES.get(type(event))
    if changes is None:
        raise ValueError(f"unexpected event {event.type}")
    return changes(state, event)
