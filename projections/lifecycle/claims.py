"""Claims (docs/adr/0009): a warm pool member adopted under a user's name, in two steps each
decided on its own key and idempotent by claim id.

1. ``AdoptSandbox`` on the member's key: only a Ready, unheld pool member not adopted yet
   (``SandboxAdopted``); the same claim again is idempotent, another claim is refused. The
   member's partition arbitrates, so a member is adopted at most once.
2. ``BindSandboxName`` on the claimant's key (sent by the processor after SandboxAdopted):
   the name binds to the member unless a live sandbox or another claim holds it
   (``SandboxNameBound``); refused, the processor sends ``AbandonAdoption`` back to the
   member, which is deleted (``SandboxAdoptionAbandoned`` then ``SandboxDeleting``).

An adopted member's ``SandboxDeleted`` sends ``UnbindSandboxName``: the name is free again.
``follow_ups`` says which command a decision sends; the ids of those commands derive from the
claim id, so a replay sends the same ones (and the fold drops the repeats as duplicates).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Final
from uuid import UUID

from events.commands import (
    AbandonAdoption,
    AdoptSandbox,
    BindSandboxName,
    Command,
    UnbindSandboxName,
)
from events.common import Cause
from events.decided import (
    SandboxAdopted,
    SandboxAdoptionAbandoned,
    SandboxDeleted,
    SandboxDeleting,
    SandboxNameBound,
    SandboxNameReleased,
)
from events.outcomes import Code
from events.trusted import built
from projections.uuids import uuid5

from .deadlines import delete_deadline, moment_after
from .emit import common_fields, emit_event, new_event, outcome_of, rejected, then_decide
from .identity import event_id_for
from .model import Decision, Limits, Message, P, Sandbox

CLAIM_NS: Final = UUID("3c2b8d14-5e6f-4a71-b0c9-7d1e2f3a4b55")

ClaimCommand = AdoptSandbox | BindSandboxName | AbandonAdoption | UnbindSandboxName
CLAIM_COMMANDS: Final = (AdoptSandbox, BindSandboxName, AbandonAdoption, UnbindSandboxName)


def step_command_id(claim_id: str, member: str, sandbox_id: UUID, step: str) -> str:
    """The command id of a claim's step the processor sends: the same at every replay, and
    another for each member incarnation one claim adopted (a retried claim's second member is
    refused its name, not taken for a repeat of the first's)."""
    return str(uuid5(CLAIM_NS, f"{claim_id}/{member}/{sandbox_id}/{step}"))


def decide_claim(
    state: Sandbox | None, command: ClaimCommand, cause: Cause, limits: Limits
) -> Decision:
    match command:
        case AdoptSandbox():
            return _adopt(state, command, cause)
        case BindSandboxName():
            return _bind(state, command, cause)
        case AbandonAdoption():
            return _abandon(state, command, cause, limits)
        case UnbindSandboxName():
            return _unbind(state, command, cause)
    raise AssertionError(command)


def _ok(state: Sandbox | None, command: Command, why: str) -> Decision:
    return Decision(state, (), "idempotent", why, outcome_of(command, Code.OK, why, state))


def adoption_refusal(state: Sandbox | None, claim_id: str) -> str | None:
    """Why this row cannot be adopted by ``claim_id`` (None: it can, or already was by it)."""
    if state is None or state.tombstoned:
        return "not found"
    if state.claim_id is not None:  # adopted (or its adoption abandoned): by this claim?
        if state.claim_id == claim_id:
            return None
        if state.adopted_as is None:
            return "already adopted by a claim since abandoned (being deleted)"
        return f"already adopted (as {state.adopted_as!r})"
    if state.pool is None:
        return "not a pool member"
    if state.hold is not None:
        return f"held by {state.hold.by}: {state.hold.reason}"
    if state.phase is not P.READY:
        return f"not Ready (current phase: {state.phase})"
    return None


def _adopt(state: Sandbox | None, command: AdoptSandbox, cause: Cause) -> Decision:
    refusal = adoption_refusal(state, command.claim_id)
    if refusal is not None:
        code = Code.NOT_FOUND if refusal == "not found" else Code.FAILED_PRECONDITION
        return rejected(state, command, code, f"sandbox {command.key!r} {refusal}")
    assert state is not None
    if state.claim_id is not None:
        return _ok(state, command, f"nothing to do: adopted by claim {command.claim_id!r}")
    event = built(
        SandboxAdopted,
        type="SandboxAdopted",
        **common_fields(state, command, cause),
        claimant=command.claimant,
        claim_id=command.claim_id,
        labels=command.labels,
        **claim_delivery(state, command),
    )
    new_state, events = emit_event(state, event)
    why = f"adopted from pool {state.pool!r} as {command.claimant!r}"
    return Decision(new_state, events, "applied", why, outcome_of(command, Code.OK, why, new_state))


def claim_delivery(state: Sandbox, command: AdoptSandbox) -> dict[str, Any]:
    """What SandboxAdopted records of the claim besides its labels (each only when set): its
    expiry, its time to live counted from the adoption command's time (as a create's is from
    the create's); its env; the providers it attaches that the member had not."""
    fields: dict[str, Any] = {}
    if command.ttl_seconds is not None:
        fields["expires_at"] = moment_after(command.occurred_at, command.ttl_seconds)
    if command.env:
        fields["env"] = command.env
    if added := sorted({p for p in command.providers if p not in state.providers}):
        fields["providers"] = added
    return fields


def name_refusal(state: Sandbox | None, claim_id: str, target: str) -> str | None:
    """Why the name (this key) cannot be bound to ``target`` by ``claim_id`` (None: it can, or
    already is). A second member one claim adopted (a retried claim) is refused the name too."""
    if state is None:
        return None
    if state.bound_to is not None:
        return (
            None
            if (state.claim_id, state.bound_to) == (claim_id, target)
            else f"the name is bound to adopted sandbox {state.bound_to!r}"
        )
    if not state.tombstoned:
        return f"a sandbox of that name exists (phase: {state.phase})"
    return None


def _bind(state: Sandbox | None, command: BindSandboxName, cause: Cause) -> Decision:
    refusal = name_refusal(state, command.claim_id, command.target)
    if refusal is not None:
        return rejected(state, command, Code.ALREADY_EXISTS, f"name {command.key!r}: {refusal}")
    if state is not None and state.bound_to is not None:
        return _ok(state, command, f"nothing to do: bound to {state.bound_to!r} by this claim")
    event = built(
        SandboxNameBound,
        type="SandboxNameBound",
        event_id=event_id_for(cause),
        key=command.key,
        sandbox_id=command.sandbox_id,
        version=state.version + 1 if state is not None else 1,
        generation=state.generation if state is not None else 1,
        occurred_at=command.occurred_at,
        actor=command.actor,
        cause=cause,
        target=command.target,
        claim_id=command.claim_id,
        spec=command.spec,
    )
    new_state, events = emit_event(state, event)
    why = f"name {command.key!r} bound to adopted sandbox {command.target!r}"
    return Decision(new_state, events, "applied", why, outcome_of(command, Code.OK, why, new_state))


def _abandon(
    state: Sandbox | None, command: AbandonAdoption, cause: Cause, limits: Limits
) -> Decision:
    if (
        state is None
        or state.tombstoned
        or state.claim_id != command.claim_id
        or state.adopted_as is None
    ):
        return _ok(state, command, f"nothing to do: not adopted by claim {command.claim_id!r}")
    new_state, events = emit_event(
        state,
        built(
            SandboxAdoptionAbandoned,
            type="SandboxAdoptionAbandoned",
            **common_fields(state, command, cause),
            claimant=command.claimant,
            claim_id=command.claim_id,
            reason=command.reason,
        ),
    )
    if state.phase is not P.DELETING:  # (a delete under way already: it stays)
        deadline = delete_deadline(state.spec, command.occurred_at, limits)
        new_state, events = then_decide(
            new_state, events, command, cause, lambda c: new_event(SandboxDeleting, c, deadline)
        )
    why = f"adoption as {command.claimant!r} abandoned ({command.reason}): deleting"
    return Decision(new_state, events, "applied", why, outcome_of(command, Code.OK, why, new_state))


def _unbind(state: Sandbox | None, command: UnbindSandboxName, cause: Cause) -> Decision:
    if state is None or state.bound_to != command.target or state.claim_id != command.claim_id:
        return _ok(state, command, f"nothing to do: not bound by claim {command.claim_id!r}")
    new_state, events = emit_event(
        state,
        built(
            SandboxNameReleased,
            type="SandboxNameReleased",
            **common_fields(state, command, cause),
            target=command.target,
            claim_id=command.claim_id,
        ),
    )
    why = f"name {command.key!r} released: adopted sandbox {command.target!r} deleted"
    return Decision(new_state, events, "applied", why, outcome_of(command, Code.OK, why, new_state))


def not_found(state: Sandbox | None, key: str) -> str:
    """A command's NOT_FOUND on a free, tombstoned or bound name: the last says whose it is."""
    if state is not None and state.bound_to is not None:
        return (
            f"sandbox {key!r} not found: the name stands for adopted sandbox "
            f"{state.bound_to!r} (address that key)"
        )
    return f"sandbox {key!r} not found"


def with_follow_ups(state: Sandbox | None, message: Message, decision: Decision) -> Decision:
    """``decision`` with the claim step it sends (decided on ``message`` from ``state``)."""
    claim = message if isinstance(message, CLAIM_COMMANDS) else None
    if state is None or (claim is None and not (state.pool or state.bound_to)):
        return decision  # neither a pool member nor a name: no claim step to send
    commands = follow_ups(state, decision, claim)
    return replace(decision, commands=commands) if commands else decision


def follow_ups(
    before: Sandbox | None, decision: Decision, command: Command | None
) -> tuple[Command, ...]:
    """The claim step a decision sends onto the commands topic, keyed by the other key."""
    for event in decision.events:
        if isinstance(event, SandboxAdopted):
            assert decision.state is not None
            member = decision.state
            return (
                built(
                    BindSandboxName,
                    type="BindSandboxName",
                    command_id=step_command_id(
                        event.claim_id, member.key, member.sandbox_id, "bind"
                    ),
                    key=event.claimant,
                    occurred_at=event.occurred_at,
                    actor=event.actor,
                    target=member.key,
                    claim_id=event.claim_id,
                    sandbox_id=member.sandbox_id,
                    spec=member.spec,
                ),
            )
        if isinstance(event, SandboxDeleted) and before is not None and before.adopted_as:
            assert before.claim_id is not None
            return (
                built(
                    UnbindSandboxName,
                    type="UnbindSandboxName",
                    command_id=step_command_id(
                        before.claim_id, before.key, before.sandbox_id, "unbind"
                    ),
                    key=before.adopted_as,
                    occurred_at=event.occurred_at,
                    actor=event.actor,
                    target=before.key,
                    claim_id=before.claim_id,
                ),
            )
    if (
        isinstance(command, BindSandboxName)
        and decision.disposition == "rejected"
        and decision.outcome is not None
    ):
        return (
            built(
                AbandonAdoption,
                type="AbandonAdoption",
                command_id=step_command_id(
                    command.claim_id, command.target, command.sandbox_id, "abandon"
                ),
                key=command.target,
                occurred_at=command.occurred_at,
                actor=command.actor,
                claimant=command.key,
                claim_id=command.claim_id,
                reason=decision.outcome.message,
            ),
        )
    return ()
