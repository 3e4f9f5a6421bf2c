"""Properties of the lifecycle core under random interleavings (hypothesis, stateful).

A state machine sends random commands and observations about a few sandbox names through
``projections.fold.fold`` one message at a time: retries with the same command id, reused ids,
stale and unknown generations, observations after deletion, failed driver results with random
observed states. After every step it checks the invariants of the state model; it also folds
the same inputs in random batch splits, replays them from scratch (decoded from their JSON) and
rebuilds the rows from the decided events alone, and all of these must agree exactly.

A decided stop or delete is never undone: Stopping leaves only to Stopped (never back to
Ready or Error while the runtime may run), a restart or Deleting, and a failed stop that saw
the runtime running stays Stopping with its retry deadline; Deleting leaves only to Deleted.

Time arrives as the scheduler's DeadlineDue messages: for the row's deadline or expiry, for
deadlines it no longer holds, for other generations, and always twice (a restarted scheduler
catching up): the repeat must change nothing. Holds must keep start, restart, expiry and the
completion policy away, and defer a scheduled restart without dropping it.

Credentials: rotations of attached and unattached providers (with and without a restart), and
launch reports naming the revisions the launch read (or none: unknown). A rotation restarts
exactly where ROTATION_TABLE says; one it defers while the generation may yet run on older
values (a pending launch, Error) is awaited in the row, and only then; the row never
becomes Ready on values older than awaited (or with a provider detached meanwhile), whether
through a launch report or a generation seen running again, unless a hold defers the restart;
a running snapshot never makes a row that awaits a launch's report Ready. Runtime snapshots
include ``stopping`` (a runtime on its way out), which changes nothing anywhere.

Claims (docs/adr/0009): any name may be created as a pool member, and claims adopt members
under any name (a live one included). The commands a decision sends (bind, abandon, unbind) are
delivered later, in order per (sending key, receiving key) as the processor's outbox publishes
them, between any other inputs, and delivered again (at least once). A member is adopted at
most once and only Ready, unheld and unclaimed; a name is bound only for an adoption with the
same claim and claimant, never while a sandbox lives under it, and a create of a bound name is
refused; once every sent command is delivered, each adopted member is either bound under its
claimant's name or being deleted (abandoned), and each bound name points at its live member.
"""

from __future__ import annotations

import os
from collections import defaultdict
from datetime import timedelta
from typing import Any, get_args
from uuid import UUID

import factories as f
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from events.codec import COMMANDS, OBSERVATIONS, decode, encode
from events.commands import (
    AbandonAdoption,
    AdoptSandbox,
    BindSandboxName,
    Command,
    CreateSandbox,
    DeleteSandbox,
    DetachProvider,
    ReleaseSandbox,
    RestartSandbox,
    ResumeSandbox,
    RotateCredentials,
    StartSandbox,
    SuspendSandbox,
)
from events.common import Cause, Phase, RestartPolicy, SandboxSpec
from events.decided import (
    AgentRestarted,
    AgentRestartSkipped,
    DecidedEvent,
    ProviderDetached,
    SandboxAdopted,
    SandboxAdoptionAbandoned,
    SandboxCompleted,
    SandboxCreated,
    SandboxDeleting,
    SandboxNameBound,
    SandboxReady,
    SandboxRestartScheduled,
    SandboxRestartsExhausted,
    SandboxStarting,
    SandboxStopping,
    SandboxSuspending,
)
from events.observations import (
    DeadlineDue,
    DriverOperationResult,
    ObservedState,
    Operation,
    OperationOutcome,
    RuntimeRemoved,
    RuntimeSnapshot,
)
from events.outcomes import CommandOutcome
from projections.fold import fold
from projections.lifecycle import (
    CLAIM_ROTATED,
    COMMAND_TABLE,
    EXIT_EVENTS,
    OWED_PHASES,
    PHASE_DEADLINES,
    REFUSED_WHILE_HELD,
    RESTART,
    ROTATION_TABLE,
    Admission,
    Decision,
    Message,
    Sandbox,
    admission,
    awaits_stop_retry,
    detach_action,
    evolve,
    is_held,
    rotation_action,
)
from projections.lifecycle.observations import STOPPED_STATES

P = Phase
KEYS = ("a", "b", "c")
PROVIDERS = ("gh", "gl", "aws")
POLICIES: tuple[RestartPolicy, ...] = ("Never", "OnFailure", "Always")
# Specs a create picks from: no restart policy, and the policies with and without a limit.
SPECS = (
    f.spec(),
    f.spec(),
    SandboxSpec(image=f.IMAGE, restart_policy="OnFailure"),
    SandboxSpec(image=f.IMAGE, restart_policy="Always", max_restarts=1),
    SandboxSpec(image=f.IMAGE, restart_policy="OnFailure", max_restarts=0),
    SandboxSpec(image=f.IMAGE, restart_policy="Always"),
    SandboxSpec(image=f.IMAGE, idle_suspend_seconds=60),
    SandboxSpec(image=f.IMAGE, idle_suspend_seconds=1),
    SandboxSpec(image=f.IMAGE, restart_policy="OnFailure", idle_suspend_seconds=1),
)
OBSERVATION_TYPES = (RuntimeSnapshot, RuntimeRemoved, DriverOperationResult, DeadlineDue)

keys = st.sampled_from(KEYS)
# Mostly the current generation; sometimes stale (older) or unknown (newer than issued).
generation_deltas = st.sampled_from([0, 0, 0, 0, 0, 0, -1, -2, 1, 2])
exit_codes = st.sampled_from([0, 0, 1, 137, None])
observed_states = st.sampled_from((None, *get_args(ObservedState)))
revisions = st.integers(1, 4)
# What a launch read: unknown (None), or some providers' revisions (0: not read).
reads = st.one_of(
    st.none(), st.dictionaries(st.sampled_from(PROVIDERS), st.integers(0, 4), max_size=3)
)
LAUNCHING = (P.PROVISIONING, P.STARTING)
CLAIMS = ("k1", "k2", "k3")


def newest_read(state: Sandbox, ahead: int = 0) -> dict[str, int]:
    """What a launch that ran after every rotation the row awaits read: each attached
    provider at (or ``ahead`` past) the awaited revision; none detached."""
    return {p: state.awaited.get(p, 1) + ahead for p in state.providers}


def read_stale(awaited: dict[str, int], providers: list[str], read: dict[str, int] | None) -> bool:
    """Whether a launch that read ``read`` missed what the row awaited (the model, written
    apart from the rules): an attached provider's rotation newer than what it read, or a
    provider detached while it was pending that it read (unknown: both may be)."""
    for provider, revision in awaited.items():
        seen = None if read is None else read.get(provider, 0)
        if provider in providers and (seen is None or seen < revision):
            return True
        if provider not in providers and (seen is None or seen > 0):
            return True
    return False


def dumps(events: list[DecidedEvent]) -> list[dict[str, Any]]:
    return [e.model_dump() for e in events]


def live(states: dict[str, Sandbox | None]) -> dict[str, Sandbox]:
    return {k: v for k, v in states.items() if v is not None}


def is_observation(message: Message) -> bool:
    return isinstance(message, OBSERVATION_TYPES)


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.causes = f.Causes()
        self.inputs: list[tuple[Cause, Message]] = []
        # The live fold, one message at a time.
        self.states: dict[str, Sandbox | None] = {}
        self.outcomes: dict[str, CommandOutcome] = {}
        self.events: list[DecidedEvent] = []
        # The same inputs folded in batches whose boundaries hypothesis chooses (``flush``).
        self.pending: list[tuple[Cause, Message]] = []
        self.b_states: dict[str, Sandbox | None] = {}
        self.b_outcomes: dict[str, CommandOutcome] = {}
        self.b_events: list[DecidedEvent] = []
        # Bookkeeping for the invariants.
        self.commands: dict[str, list[Command]] = defaultdict(list)  # by key
        self.first_outcome: dict[str, CommandOutcome] = {}
        self.incarnations: dict[str, set[UUID]] = defaultdict(set)
        self.serial = 0
        # Commands the decisions sent, not delivered yet, by (sending key, receiving key): the
        # outbox publishes them in commit order; and those delivered once (to deliver again).
        self.sent: dict[tuple[str, str], list[Command]] = defaultdict(list)
        self.delivered: list[Command] = []

    # -- helpers ------------------------------------------------------------------------------

    def command_id(self, key: str) -> str:
        self.serial += 1
        return f"{key}-c{self.serial}"

    def generation(self, key: str, delta: int) -> int:
        state = self.states.get(key)
        return max(1, (state.generation if state else 1) + delta)

    def send(self, message: Message) -> Decision:
        cause = self.causes(message)
        prev = self.states.get(message.key)
        batch = fold(self.states, self.outcomes, [(cause, message)])
        (step,) = batch.steps
        decision = step.decision
        self.states = batch.states
        self.outcomes.update(batch.outcomes)
        self.events.extend(decision.events)
        self.inputs.append((cause, message))
        self.pending.append((cause, message))
        if not is_observation(message):
            self.commands[message.key].append(message)  # type: ignore[arg-type]
        for command in decision.commands:
            self.sent[(message.key, command.key)].append(command)
        self.check_step(prev, message, decision)
        self.check_claim(prev, message, decision)
        return decision

    # -- the per-step invariants --------------------------------------------------------------

    def check_step(self, prev: Sandbox | None, message: Message, d: Decision) -> None:
        new = d.state
        events = d.events
        # The events and outcome, built without validation, are exactly what validation builds.
        f.assert_decided_as_validated(d)
        # One event per input, except an expiry or a process end followed by its policy's
        # (an exit that reaches the restart limit: the exit, the limit, the completion policy),
        # a launch report followed by the restart it calls for, and a detach that restarts.
        limit = len(events) > 1 and isinstance(events[1], SandboxRestartsExhausted)
        assert len(events) <= (3 if limit else 2)
        if isinstance(message, AbandonAdoption) and events:  # then deleted, unless it was
            assert isinstance(events[0], SandboxAdoptionAbandoned)
            assert (len(events) == 2) == (prev is not None and prev.phase is not P.DELETING)
            assert new is not None and new.phase is P.DELETING and new.adopted_as is None
        elif len(events) == 2 and not is_observation(message):
            assert isinstance(message, DetachProvider), message
            assert isinstance(events[0], ProviderDetached) and isinstance(events[1], AgentRestarted)
        if isinstance(message, DetachProvider) and prev is not None and events:
            # The detach rule: the provider leaves the row; a restart exactly where DETACH_TABLE
            # says so, without the provider.
            assert new is not None and message.provider not in new.providers
            restarts = detach_action(prev, message.restart, message.provider) == RESTART
            assert (len(events) == 2) == restarts
            if restarts:
                assert events[1].detached == [message.provider]  # type: ignore[union-attr]
                assert new.generation == prev.generation + 1 and new.phase is P.STARTING
        assert all(e.key == message.key for e in events)

        # Version bumps by exactly the number of events, and nothing changes without one.
        before = prev.version if prev else 0
        assert (new.version if new else 0) == before + len(events)
        assert [e.version for e in events] == list(range(before + 1, before + 1 + len(events)))
        if not events:
            assert new is prev
        else:
            assert d.disposition == "applied"
            folded = prev
            for event in events:
                folded = evolve(folded, event)
            assert new == folded

        # Generation never decreases; identity changes only with a new generation.
        if prev is not None:
            assert new is not None
            assert new.generation >= prev.generation
            if new.identity != prev.identity:
                assert new.generation > prev.generation

        # Outcomes: commands always have one, observations never; duplicates repeat the first.
        command_id = getattr(message, "command_id", None)
        if command_id is None:
            assert d.outcome is None
            assert d.disposition in ("applied", "ignored")
            assert d.reason
        elif d.disposition == "duplicate":
            assert d.outcome == self.first_outcome[command_id]
            assert not events
        else:
            assert command_id not in self.first_outcome
            assert d.outcome is not None and d.outcome.command_id == command_id
            self.first_outcome[command_id] = d.outcome
            assert d.outcome.accepted == (d.disposition in ("applied", "idempotent"))
            assert (len(events) >= 1) == (d.disposition == "applied")
            # A hold refuses start and restart, whatever the phase.
            if prev is not None and is_held(prev) and message.type in REFUSED_WHILE_HELD:
                assert not d.outcome.accepted
                if d.outcome.code.value == "FAILED_PRECONDITION":
                    hold = prev.hold
                    assert hold is not None
                    phase_refuses = admission(message.type, prev.phase) is Admission.REJECT
                    assert phase_refuses or hold.by in d.outcome.message
            if new is not None and d.outcome.accepted:
                assert d.outcome.version == new.version
                assert d.outcome.identity == new.identity

        # A new incarnation only through an accepted create, with a never-seen sandbox_id, at a
        # higher generation than the tombstone: no resurrection.
        if new is not None and new.bound_to is not None and events:
            # A bound name's row: a tombstone naming its member's incarnation.
            assert isinstance(message, BindSandboxName) and new.tombstoned
            assert new.sandbox_id == message.sandbox_id
        elif new is not None and (prev is None or new.sandbox_id != prev.sandbox_id):
            assert isinstance(message, CreateSandbox) and d.disposition == "applied"
            assert isinstance(events[0], SandboxCreated)
            assert new.sandbox_id not in self.incarnations[message.key]
            self.incarnations[message.key].add(new.sandbox_id)
        if prev is not None and prev.tombstoned and new is not None and not new.tombstoned:
            assert isinstance(message, CreateSandbox) and d.disposition == "applied"
            assert new.generation > prev.generation
            assert new.sandbox_id != prev.sandbox_id
            assert new.phase is P.PROVISIONING

        if prev is None or new is None:
            return
        # The deadline of the row is always the one of its phase (all limits are on here).
        if not new.tombstoned:
            kind = PHASE_DEADLINES.get(new.phase)
            # (A stop that was escalated to a kill has no further deadline.)
            allowed = {kind, None} if new.phase in (P.STOPPING, P.SUSPENDING) else {kind}
            # (A restart the restart policy scheduled waits in Error or Completed.)
            if new.phase in (P.ERROR, P.COMPLETED) and new.spec.restart_policy is not None:
                allowed = {None, "restart"}
            assert (new.deadline.kind if new.deadline else None) in allowed, new
        # Time acts only on the deadline the row holds; a repeat changes nothing.
        # (An idle one names none: check_suspend holds it to the idle rule.)
        if isinstance(message, DeadlineDue) and events and message.deadline != "idle":
            if message.deadline == "ttl":
                assert prev.expires_at == message.due_at and not is_held(prev)
            else:
                assert prev.deadline is not None
                assert (prev.deadline.kind, prev.deadline.due_at) == (
                    message.deadline,
                    message.due_at,
                )
        # A held sandbox is never deleted or stopped by a policy.
        if is_held(prev) and is_observation(message):
            assert not any(isinstance(e, SandboxDeleting | SandboxStopping) for e in events)
        # The completion policy deletes once the end is recorded, never otherwise: right after
        # an exit event (the end itself, or the exit that reached the restart limit).
        deleting = [i for i, e in enumerate(events) if isinstance(e, SandboxDeleting)]
        if deleting and is_observation(message):
            assert isinstance(message, DeadlineDue) or (
                prev.on_exit == "delete"
                and deleting[0] > 0
                and isinstance(events[deleting[0] - 1], EXIT_EVENTS)
            )
        # The tombstone is only reached from Deleting.
        if new.tombstoned and not prev.tombstoned:
            assert prev.phase is P.DELETING, (prev.phase, message)
        # Stopped only leaves through an accepted start, restart, suspend or delete (an
        # abandoned adoption's included).
        expired = isinstance(message, DeadlineDue) and message.deadline == "ttl"
        if prev.phase is P.STOPPED and new.phase is not P.STOPPED:
            assert expired or isinstance(
                message,
                StartSandbox | RestartSandbox | SuspendSandbox | DeleteSandbox | AbandonAdoption,
            )
            assert d.disposition == "applied"
        self.check_suspend(prev, message, events, new, expired)
        # A decided delete is never undone: Deleting only leaves to Deleted, and only on the
        # delete's own report that nothing is left (not on a runtime's removal, not on a failure).
        if prev.phase is P.DELETING and new.phase is not P.DELETING:
            assert new.phase is P.DELETED, message
            assert (
                isinstance(message, DriverOperationResult)
                and message.operation == "delete"
                and message.outcome in ("succeeded", "already_absent")
            ), message
        # A decided stop is never undone: Stopping leaves only to Stopped (the runtime seen
        # ended, the stop's success, or a failed stop that saw it not running), to a restart's
        # new generation or to Deleting, never back to Ready or Error while the runtime may run;
        # a failed stop that saw it running (or nothing) stays Stopping with a retry deadline.
        if prev.phase is P.STOPPING and new.phase is not P.STOPPING:
            assert new.phase in (P.STOPPED, P.STARTING, P.DELETING), (new.phase, message)
            if new.phase is P.STOPPED and isinstance(message, DriverOperationResult):
                assert message.operation == "stop", message
                assert message.outcome != "failed" or message.observed in STOPPED_STATES
        if (
            prev.phase is P.STOPPING
            and isinstance(message, DriverOperationResult)
            and message.operation == "stop"
            and message.outcome == "failed"
            and message.generation == prev.generation
            and message.observed not in STOPPED_STATES
        ):
            assert new.phase is P.STOPPING and awaits_stop_retry(new), new
        # Observations never touch another generation than the row's; the ones that move it on
        # are a restart policy's deadline falling due, which starts the next generation, and a
        # launch report whose launch read a provider detached (or a value rotated) while it was
        # pending, which restarts it at once.
        if events and is_observation(message):
            assert message.generation == prev.generation  # type: ignore[union-attr]
            restart_due = isinstance(message, DeadlineDue) and message.deadline == "restart"
            restarted = isinstance(events[-1], AgentRestarted)
            if restarted:  # a launch report, or a generation seen running again, that owed
                assert prev.awaited  # the newest values
            assert new.generation == prev.generation + (1 if restart_due or restarted else 0), (
                message
            )

        self.check_restart_policy(prev, message, events, new)
        self.check_credentials(prev, message, d, new)
        # A runtime on its way out (stopping) changes nothing anywhere.
        if isinstance(message, RuntimeSnapshot) and message.state == "stopping":
            assert not events, events

    def check_claim(self, prev: Sandbox | None, message: Message, d: Decision) -> None:
        """Adopted only Ready, unheld and unclaimed, once; a name bound only where no sandbox
        lives; a bound name refuses creates; a claim, once on a row, stays until its end."""
        new, events = d.state, d.events
        for event in events:
            if isinstance(event, SandboxAdopted):
                assert isinstance(message, AdoptSandbox) and prev is not None
                assert prev.phase is P.READY and prev.pool is not None
                assert prev.claim_id is None and prev.hold is None
                # The claim's TTL counts from the adoption; its env and providers join the
                # row's without a new generation (the running process keeps its own).
                ttl = message.ttl_seconds
                at = message.occurred_at + timedelta(seconds=ttl) if ttl else prev.expires_at
                assert new is not None and new.expires_at == at
                assert new.spec.env == {**prev.spec.env, **message.env}
                assert set(new.providers) == set(prev.providers) | set(message.providers)
                assert set(new.claim_providers) == set(message.providers) - set(prev.providers)
                assert new.generation == prev.generation
            if isinstance(event, SandboxNameBound):
                assert isinstance(message, BindSandboxName)
                assert prev is None or (prev.tombstoned and prev.bound_to is None)
        bound = prev is not None and prev.bound_to is not None
        if isinstance(message, CreateSandbox) and bound and d.disposition != "duplicate":
            assert d.outcome is not None and not d.outcome.accepted
        if (
            prev is not None
            and new is not None
            and prev.claim_id is not None
            and (not prev.tombstoned or prev.bound_to is not None)
        ):
            # A claim stays on its member until the member's end, and a name's binding until
            # it is released (the release keeps the claim id as history).
            assert new.claim_id == prev.claim_id or new.sandbox_id != prev.sandbox_id
            assert new.pool == prev.pool or new.sandbox_id != prev.sandbox_id
        if prev is not None and new is not None and prev.adopted_as is not None:
            same = new.sandbox_id == prev.sandbox_id
            # The name leaves an adopted member only when its adoption is abandoned.
            assert not same or new.adopted_as in (prev.adopted_as, None)
            if same and new.adopted_as is None:
                assert isinstance(message, AbandonAdoption)

    @invariant()
    def adopted_at_most_once(self) -> None:
        """Per member incarnation, at most one adoption; every binding follows its adoption."""
        adopted: dict[UUID, SandboxAdopted] = {}
        for event in self.events:
            if isinstance(event, SandboxAdopted):
                assert event.sandbox_id not in adopted, event
                adopted[event.sandbox_id] = event
        for event in self.events:
            if isinstance(event, SandboxNameBound):
                first = adopted[event.sandbox_id]
                assert (first.key, first.claimant) == (event.target, event.key)
                assert first.claim_id == event.claim_id

    def deliver_all(self) -> None:
        """Every sent command delivered (and what that sends in turn), in outbox order."""
        while any(self.sent.values()):
            for route in sorted(k for k, v in self.sent.items() if v):
                while self.sent[route]:
                    command = self.sent[route].pop(0)
                    self.delivered.append(command)
                    self.send(command)

    def check_quiescent_claims(self) -> None:
        """Nothing in flight: each adopted member is bound under its claimant's name, and
        each bound name points at the live member its claim adopted (none lost, none twice)."""
        rows = live(self.states)
        for key, row in rows.items():
            if row.adopted_as is not None and not row.tombstoned:
                name = rows.get(row.adopted_as)
                assert name is not None and (name.bound_to, name.claim_id) == (
                    key,
                    row.claim_id,
                ), (row, name)
            if row.claim_id is not None and row.adopted_as is None and row.bound_to is None:
                assert row.phase in (P.DELETING, P.DELETED), row  # abandoned
            if row.bound_to is not None:
                member = rows[row.bound_to]
                assert not member.tombstoned and member.adopted_as == key
                assert member.claim_id == row.claim_id

    def check_credentials(self, prev: Sandbox, message: Message, d: Decision, new: Sandbox) -> None:
        """Rotations restart exactly where ROTATION_TABLE says; what a pending launch must
        have read is awaited only while a launch is pending; the row is never Ready on values
        older than awaited (nor with a detached provider's), unless a hold defers the restart
        (AgentRestartSkipped)."""
        events = d.events
        if new.awaited:
            assert new.phase in OWED_PHASES, new
        if isinstance(message, RotateCredentials) and d.disposition != "duplicate":
            named = {r.provider for r in message.rotations}
            attached = sorted(named & set(prev.providers))
            if prev.tombstoned or not attached:
                assert not events
                return
            action = rotation_action(prev, message.restart, attached)
            if action == CLAIM_ROTATED:  # only values the running process never read
                assert prev.phase is P.READY and prev.adopted_generation == prev.generation
                assert set(attached) <= set(prev.claim_providers)
            (event,) = events
            if action == RESTART:
                assert isinstance(event, AgentRestarted) and event.providers == attached
                assert (new.phase, new.generation) == (P.STARTING, prev.generation + 1)
                assert new.awaited == {}
            else:
                assert isinstance(event, AgentRestartSkipped) and event.reason == action
                assert (new.phase, new.generation) == (prev.phase, prev.generation)
            if prev.phase in OWED_PHASES and action == ROTATION_TABLE[prev.phase]:
                for r in message.rotations:
                    if r.provider in attached:
                        assert new.awaited[r.provider] >= r.revision
        if not (prev.awaited and is_observation(message)):
            return
        running = isinstance(message, RuntimeSnapshot) and message.state == "running"
        if running and prev.phase in LAUNCHING:
            assert not events  # Ready waits for the launch's report of what it read
        # Never Ready on values older than owed: the same generation reaching Ready without a
        # launch report restarts at once (or skips, saying so, while held).
        if new.phase is P.READY and new.generation == prev.generation and prev.phase is not P.READY:
            fresh = (
                isinstance(message, DriverOperationResult)
                and message.operation == "launch"
                and not read_stale(prev.awaited, prev.providers, message.credentials)
            )
            assert fresh or (is_held(prev) and isinstance(events[-1], AgentRestartSkipped)), (
                prev,
                message,
                events,
            )
        launched = (
            isinstance(message, DriverOperationResult)
            and message.operation == "launch"
            and message.outcome == "succeeded"
            and message.generation == prev.generation
            and prev.phase in LAUNCHING
        )
        if not launched:
            return
        assert isinstance(message, DriverOperationResult)
        assert isinstance(events[0], SandboxReady)
        if read_stale(prev.awaited, prev.providers, message.credentials):
            assert len(events) == 2, events
            if is_held(prev):  # the newest values wait for the release and the next start
                assert isinstance(events[1], AgentRestartSkipped)
            else:
                assert isinstance(events[1], AgentRestarted)
                assert (new.phase, new.generation) == (P.STARTING, prev.generation + 1)
        else:
            assert len(events) == 1 and new.phase is P.READY, events

    def check_suspend(
        self,
        prev: Sandbox,
        message: Message,
        events: tuple[DecidedEvent, ...],
        new: Sandbox,
        expired: bool,
    ) -> None:
        """Suspend keeps everything the sandbox is; nothing of the suspended generation revives
        or regresses it; its removal is no exit; a resume starts a new generation of the same
        incarnation."""
        if isinstance(message, SuspendSandbox) and events:
            assert new.phase is P.SUSPENDING and new.generation == prev.generation
        # Idle suspend: only a Ready, unheld sandbox with a timeout, idle for all of it (neither
        # its row nor the recorded use younger), and only into Suspending of that generation.
        if isinstance(message, DeadlineDue) and message.deadline == "idle" and events:
            idle = prev.spec.idle_suspend_seconds
            assert prev.phase is P.READY and prev.hold is None and idle is not None
            since = max(prev.updated_at, message.last_used_at or prev.updated_at)
            assert message.occurred_at >= since + timedelta(seconds=idle)
            assert [type(e) for e in events] == [SandboxSuspending]
            assert new.phase is P.SUSPENDING and new.generation == prev.generation
        # Suspended only leaves through an accepted resume, start, restart or delete (an
        # abandoned adoption's included), or an expiry whose policy deletes it; no observation
        # of any generation changes it else.
        if prev.phase is P.SUSPENDED:
            if is_observation(message) and events:
                assert expired, message
            if new.phase is not P.SUSPENDED:
                assert expired or isinstance(
                    message,
                    ResumeSandbox | StartSandbox | RestartSandbox | DeleteSandbox | AbandonAdoption,
                ), message
        # The suspend's stop and removal are no exit: no restart, no completion policy.
        if prev.phase in (P.SUSPENDING, P.SUSPENDED) and is_observation(message):
            assert not any(isinstance(e, (*EXIT_EVENTS, SandboxRestartScheduled)) for e in events)
        # A resume: the next generation of the same incarnation, with everything it was.
        if isinstance(message, ResumeSandbox) and events:
            assert prev.phase is P.SUSPENDED and new.phase is P.STARTING
            assert new.generation == prev.generation + 1
            assert (new.sandbox_id, new.providers, new.spec, new.hold, new.expires_at) == (
                prev.sandbox_id,
                prev.providers,
                prev.spec,
                prev.hold,
                prev.expires_at,
            )

    def check_restart_policy(
        self, prev: Sandbox, message: Message, events: tuple[DecidedEvent, ...], new: Sandbox
    ) -> None:
        """A restart is scheduled only after an exit the row's policy restarts (held or not),
        and given up exactly at max_restarts; a restart's falling due starts the next
        generation under the policy, counting it, unless held: then it changes nothing, and a
        release keeps the restart scheduled."""
        policy = prev.spec.restart_policy
        made = prev.restarts.attempt if prev.restarts else 0
        if isinstance(message, DeadlineDue) and message.deadline == "restart" and is_held(prev):
            assert not events, events
        if isinstance(message, ReleaseSandbox) and events:
            assert new.deadline == prev.deadline
        for i, event in enumerate(events):
            if isinstance(event, SandboxRestartScheduled | SandboxRestartsExhausted):
                assert i == 1 and policy is not None, (policy, events)
                assert is_observation(message)
                assert policy == "Always" or not isinstance(events[0], SandboxCompleted)
            if isinstance(event, SandboxRestartsExhausted):
                limit = prev.spec.max_restarts
                assert limit is not None and event.restarts == limit <= made, (limit, made)
            if isinstance(event, SandboxRestartScheduled):
                limit = prev.spec.max_restarts
                assert limit is None or event.deadline.attempt <= limit
        if isinstance(message, DeadlineDue) and message.deadline == "restart" and events:
            (started,) = events
            assert isinstance(started, SandboxStarting) and prev.deadline is not None
            assert (started.policy, started.attempt) == (policy, prev.deadline.attempt)
            assert prev.restarts is not None and new.restarts is not None
            assert new.restarts.count == prev.restarts.count + 1

    @invariant()
    def rebuild_from_the_log(self) -> None:
        rows: dict[str, Sandbox] = {}
        for event in self.events:
            state = rows.get(event.key)
            assert event.version == (state.version if state else 0) + 1
            rows[event.key] = evolve(state, event)
        assert rows == live(self.states)

    # -- commands -----------------------------------------------------------------------------

    @rule(
        key=keys,
        providers=st.lists(st.sampled_from(PROVIDERS), max_size=3),
        ttl=st.sampled_from([None, None, 1, 60]),
        on_expiry=st.sampled_from(["stop", "delete"]),
        on_exit=st.sampled_from(["keep", "delete"]),
        spec=st.sampled_from(SPECS),
        pool=st.sampled_from([None, "p", "p"]),
    )
    def create(
        self,
        key: str,
        providers: list[str],
        ttl: int | None,
        on_expiry: str,
        on_exit: str,
        spec: SandboxSpec,
        pool: str | None,
    ) -> None:
        self.send(
            f.create(
                key,
                command_id=self.command_id(key),
                sandbox_spec=spec,
                providers=providers,
                ttl_seconds=ttl,
                on_expiry=on_expiry,
                on_exit=on_exit,
                pool=pool,
            )
        )

    # -- claims -------------------------------------------------------------------------------

    @rule(
        member=keys,
        claimant=st.sampled_from([*KEYS, "n"]),
        claim=st.sampled_from(CLAIMS),
        ttl=st.none() | st.integers(1, 600),
        env=st.dictionaries(st.sampled_from(["A", "B"]), st.sampled_from(["1", "2"]), max_size=2),
        providers=st.lists(st.sampled_from(PROVIDERS), max_size=2, unique=True),
    )
    def adopt(
        self,
        member: str,
        claimant: str,
        claim: str,
        ttl: int | None = None,
        env: dict[str, str] | None = None,
        providers: list[str] | None = None,
    ) -> None:
        """A claim's adoption of ``member`` for ``claimant`` (a free or a taken name), with a
        time to live, env and providers or not."""
        d = self.send(
            f.adopt(
                member, claimant, claim, ttl_seconds=ttl, env=env, providers=providers or (),
                command_id=self.command_id(member),
            )
        )  # fmt: skip
        state = self.states.get(member)
        if d.outcome is not None and d.outcome.accepted:
            assert state is not None and state.claim_id == claim

    @rule(member=keys, claimant=st.sampled_from([*KEYS, "n"]), claim=st.sampled_from(CLAIMS))
    def adopt_when_ready(self, member: str, claimant: str, claim: str) -> None:
        """A member made Ready first (launched), then adopted: drives the binding's paths."""
        state = self.states.get(member)
        if state is not None and state.phase in LAUNCHING:
            self.send(f.launched(member, state.generation, credentials=newest_read(state)))
        self.adopt(member, claimant, claim)

    @rule(key=keys)
    def delete_to_the_end(self, key: str) -> None:
        """A delete of ``key`` carried through (an adopted member's end frees its name)."""
        state = self.states.get(key)
        if state is None or state.tombstoned:
            return
        self.send(f.delete(key, command_id=self.command_id(key)))
        self.send(f.deleted(key, self.generation(key, 0)))

    @precondition(lambda self: any(self.sent.values()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """The next command one key sent another arrives (routes interleave freely)."""
        route = data.draw(st.sampled_from(sorted(k for k, v in self.sent.items() if v)))
        command = self.sent[route].pop(0)
        self.delivered.append(command)
        self.send(command)

    @precondition(lambda self: bool(self.delivered))
    @rule(data=st.data())
    def deliver_again(self, data: st.DataObject) -> None:
        """A sent command published again (a processor's crash before its publish cursor
        moved): the first outcome stands."""
        d = self.send(data.draw(st.sampled_from(self.delivered)))
        assert d.disposition == "duplicate" and not d.commands

    @rule(
        command_type=st.sampled_from(list(COMMAND_TABLE)),
        key=keys,
        provider=st.sampled_from(PROVIDERS),
        version=st.sampled_from(["none", "none", "none", "exact", "off"]),
        off=st.sampled_from([-2, -1, 1, 2]),
        restart=st.booleans(),
    )
    def command(
        self, command_type: str, key: str, provider: str, version: str, off: int, restart: bool
    ) -> None:
        state = self.states.get(key)
        current = state.version if state else 0
        expected = {"none": None, "exact": current, "off": max(0, current + off)}[version]
        kw: dict[str, Any] = {"command_id": self.command_id(key), "expected_version": expected}
        if command_type in ("AttachProvider", "DetachProvider"):
            kw["provider"] = provider
        if command_type == "SetRestartPolicy":  # from the values drawn already
            kw["restart_policy"] = POLICIES[PROVIDERS.index(provider)]
            kw["max_restarts"] = {-2: None, -1: None, 1: 0, 2: 1}[off]
        if command_type == "DetachProvider":
            kw["restart"] = restart
        d = self.send(f.VERSIONED_COMMANDS[command_type](key, **kw))
        if version == "off" and expected != current and d.outcome is not None:
            assert d.outcome.code.value in ("ABORTED", "NOT_FOUND")

    @rule(key=keys, choice=st.integers(0, 5), version=st.booleans())
    def act(self, key: str, choice: int, version: bool) -> None:
        """A command the row admits (or a create when the name is free): drives deep paths."""
        state = self.states.get(key)
        if state is None or state.tombstoned:
            spec = SPECS[choice % len(SPECS)]
            self.send(f.create(key, command_id=self.command_id(key), sandbox_spec=spec))
            return
        admitted = [
            c
            for c in COMMAND_TABLE
            if admission(c, state.phase) is Admission.ADMIT
            and not (is_held(state) and c in REFUSED_WHILE_HELD)
        ]
        if not admitted:  # Deleting
            self.progress(key)
            return
        command_type = admitted[choice % len(admitted)]
        kw: dict[str, Any] = {"command_id": self.command_id(key)}
        if version:
            kw["expected_version"] = state.version
        if command_type == "AttachProvider":
            kw["provider"] = PROVIDERS[choice % len(PROVIDERS)]
        if command_type == "DetachProvider":
            kw["provider"] = (state.providers or PROVIDERS)[0]
        if command_type == "SetRestartPolicy":
            kw["restart_policy"] = POLICIES[choice % len(POLICIES)]
            kw["max_restarts"] = (None, 1)[choice % 2]
        d = self.send(f.VERSIONED_COMMANDS[command_type](key, **kw))
        assert d.outcome is not None and d.outcome.accepted

    @precondition(lambda self: any(self.commands.values()))
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """The exact same command again (a producer retry or a redelivery)."""
        key = data.draw(st.sampled_from(sorted(k for k, v in self.commands.items() if v)))
        command = data.draw(st.sampled_from(self.commands[key]))
        d = self.send(command)
        assert d.disposition == "duplicate"

    @precondition(lambda self: any(self.commands.values()))
    @rule(data=st.data(), command_type=st.sampled_from(["CreateSandbox", *COMMAND_TABLE]))
    def reuse_id(self, data: st.DataObject, command_type: str) -> None:
        """A different command that reuses an id: the first outcome stands, nothing happens."""
        key = data.draw(st.sampled_from(sorted(k for k, v in self.commands.items() if v)))
        old = data.draw(st.sampled_from(self.commands[key]))
        d = self.send(f.COMMAND_BUILDERS[command_type](key, command_id=old.command_id))
        assert d.disposition == "duplicate"

    # -- observations -------------------------------------------------------------------------

    @rule(
        key=keys,
        delta=generation_deltas,
        state=st.sampled_from(["created", "running", "stopping", "exited"]),
        exit_code=exit_codes,
    )
    def snapshot(self, key: str, delta: int, state: Any, exit_code: int | None) -> None:
        gen = self.generation(key, delta)
        self.send(f.snapshot(key, gen, state, exit_code=exit_code if state == "exited" else None))

    @rule(key=keys, delta=generation_deltas)
    def removed(self, key: str, delta: int) -> None:
        self.send(f.removed(key, self.generation(key, delta)))

    @rule(
        key=keys,
        rotated=st.dictionaries(st.sampled_from(PROVIDERS), revisions, min_size=1, max_size=3),
        restart=st.sampled_from([True, True, True, False]),
    )
    def rotate(self, key: str, rotated: dict[str, int], restart: bool) -> None:
        """Providers' values rotated (some perhaps not attached here), as provider-sync and
        the provider routes send it."""
        self.send(f.rotate(key, rotated, restart=restart, command_id=self.command_id(key)))

    @rule(key=keys, read=reads, delta=generation_deltas)
    def launch_reported(self, key: str, read: dict[str, int] | None, delta: int) -> None:
        """A launch's success, naming the revisions of the providers it read."""
        gen = self.generation(key, delta)
        self.send(f.result(key, gen, "launch", "succeeded", credentials=read))

    @rule(key=keys, ahead=st.integers(0, 1))
    def launch_read_the_newest(self, key: str, ahead: int) -> None:
        """The row's launch succeeded having read every attached provider at (or past) the
        revision awaited, and no provider detached meanwhile: it must be Ready, no restart."""
        state = self.states.get(key)
        if state is None:
            return
        read = newest_read(state, ahead)
        self.send(f.result(key, state.generation, "launch", "succeeded", credentials=read))

    @rule(key=keys, revision=revisions, lag=st.integers(0, 1))
    def rotate_during_a_launch(self, key: str, revision: int, lag: int) -> None:
        """A rotation while a launch is pending, then that launch's report: it read the new
        value (``lag`` 0: Ready) or the one before (a restart at once)."""
        state = self.states.get(key)
        if state is None or state.phase not in LAUNCHING or not state.providers:
            return
        provider = state.providers[0]
        self.send(f.rotate(key, {provider: revision}, command_id=self.command_id(key)))
        state = self.states[key]
        assert state is not None
        read = newest_read(state)
        read[provider] -= lag
        self.send(f.result(key, state.generation, "launch", "succeeded", credentials=read))

    @rule(key=keys)
    def hold_through_a_scheduled_restart(self, key: str) -> None:
        """A hold, the scheduled restart falling due while held, the release, and the
        scheduler's DeadlineDue again: the restart waits for the release, then happens."""
        state = self.states.get(key)
        if state is None or state.deadline is None or state.deadline.kind != "restart":
            return
        due = f.due(key, "restart", state.deadline.due_at, generation=state.generation)
        if not is_held(state):
            self.send(f.hold(key, command_id=self.command_id(key)))
        assert not self.send(due).events
        self.send(f.release(key, command_id=self.command_id(key)))
        assert isinstance(self.send(due).events[0], SandboxStarting)

    @rule(
        key=keys,
        delta=generation_deltas,
        operation=st.sampled_from(get_args(Operation)),
        outcome=st.sampled_from(get_args(OperationOutcome)),
        observed=observed_states,
        exit_code=exit_codes,
    )
    def driver_result(
        self,
        key: str,
        delta: int,
        operation: Operation,
        outcome: OperationOutcome,
        observed: ObservedState | None,
        exit_code: int | None,
    ) -> None:
        gen = self.generation(key, delta)
        reason = "driver error" if outcome == "failed" else None
        self.send(
            f.result(
                key, gen, operation, outcome, observed=observed, reason=reason, exit_code=exit_code
            )
        )

    @rule(key=keys, ok=st.booleans(), observed=observed_states, fresh=st.booleans())
    def progress(
        self,
        key: str,
        ok: bool = True,
        observed: ObservedState | None = None,
        fresh: bool = False,
    ) -> None:
        """What the executor and watcher report for the row's current intent, good or bad (a
        launch read the newest values, or it is unknown what it read)."""
        state = self.states.get(key)
        if state is None:
            return
        gen = state.generation
        operations: dict[Phase, Operation] = {
            P.PROVISIONING: "launch",
            P.STARTING: "launch",
            P.STOPPING: "stop",
            P.SUSPENDING: "suspend",
            P.DELETING: "delete",
        }
        operation = operations.get(state.phase)
        if operation is None:
            self.send(f.exited(key, gen, 0) if ok else f.running(key, gen))
        elif ok:
            read = newest_read(state) if fresh and operation == "launch" else None
            self.send(f.result(key, gen, operation, "succeeded", credentials=read))
        else:
            self.send(f.failed(key, gen, operation, observed=observed))

    @rule(
        key=keys,
        delta=generation_deltas,
        which=st.sampled_from(["phase", "phase", "ttl", "ttl", "other"]),
        late=st.sampled_from([0.0, 1.0, 3600.0]),
    )
    def deadline_due(self, key: str, delta: int, which: str, late: float) -> None:
        """The scheduler says a deadline fell due, then says it again (a restarted scheduler)."""
        state = self.states.get(key)
        gen = self.generation(key, delta)
        kind: str = "launch"
        due_at = f.at(12345)  # "other": a deadline the row never held
        if state is not None and which == "phase" and state.deadline is not None:
            kind, due_at = state.deadline.kind, state.deadline.due_at
        if state is not None and which == "ttl" and state.expires_at is not None:
            kind, due_at = "ttl", state.expires_at
        message = f.due(
            key, kind, due_at, generation=gen, occurred_at=due_at + timedelta(seconds=late)
        )
        self.send(message)
        again = self.send(message)
        assert again.disposition == "ignored" and not again.events

    @rule(
        key=keys,
        delta=generation_deltas,
        after=st.sampled_from([0.0, 0.5, 1.0, 59.0, 60.0, 3600.0]),
        used=st.sampled_from([None, -10.0, 0.0, 30.0]),
        timeout=st.sampled_from([None, 1, 60]),
    )
    def idle_due(
        self, key: str, delta: int, after: float, used: float | None, timeout: int | None
    ) -> None:
        """The scheduler says a sandbox looks idle (``after`` seconds past its row's last
        change, its last recorded use ``used`` seconds past it), then says it again; with
        ``timeout``, a SetIdleSuspend first."""
        if timeout is not None:
            self.send(f.set_idle_suspend(key, timeout, command_id=self.command_id(key)))
        state = self.states.get(key)
        base = state.updated_at if state is not None else f.at(0)
        last_used = None if used is None else base + timedelta(seconds=used)
        message = f.idle_due(
            key,
            occurred_at=base + timedelta(seconds=after),
            last_used_at=last_used,
            generation=self.generation(key, delta),
        )
        self.send(message)
        again = self.send(message)
        assert again.disposition == "ignored" and not again.events

    # -- batches and replay -------------------------------------------------------------------

    @rule()
    def flush(self) -> None:
        """Fold the inputs since the last flush as one batch; it must agree with the live fold."""
        batch = fold(self.b_states, self.b_outcomes, self.pending)
        self.pending = []
        self.b_states = batch.states
        self.b_outcomes.update(batch.outcomes)
        self.b_events.extend(e for s in batch.steps for e in s.decision.events)
        assert live(self.b_states) == live(self.states)
        assert self.b_outcomes == self.outcomes
        assert dumps(self.b_events) == dumps(self.events)

    def teardown(self) -> None:
        self.deliver_all()
        self.check_quiescent_claims()
        self.flush()
        # Replay everything from scratch, decoded from the wire form: identical results.
        replayed = []
        for cause, message in self.inputs:
            adapter: Any = OBSERVATIONS if is_observation(message) else COMMANDS
            replayed.append((cause, decode(adapter, encode(message))))
        again = fold({}, {}, replayed)
        assert dumps([e for s in again.steps for e in s.decision.events]) == dumps(self.events)
        assert live(again.states) == live(self.states)
        assert again.outcomes == self.outcomes
        assert [s.decision.disposition for s in again.steps] == [
            s.decision.disposition for s in fold({}, {}, self.inputs).steps
        ]


MODERATE = settings(
    max_examples=int(os.environ.get("SANDSTREAM_HYPOTHESIS_EXAMPLES", "300")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLifecycleMachine = LifecycleMachine.TestCase
TestLifecycleMachine.settings = MODERATE


@pytest.mark.soak
def test_lifecycle_machine_soak() -> None:
    """Many more and longer runs: ``make soak`` (soak tests are deselected by default)."""
    run_state_machine_as_test(
        LifecycleMachine,
        settings=settings(
            max_examples=3000,
            stateful_step_count=120,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_the_machine_expects_no_restart_for_a_detached_provider_only_a_claim_attached() -> None:
    """The steps Hypothesis found (2026-12-05): the machine's detach rule left the provider
    out, so it expected a claim's provider, which the adopted process never read, to restart
    the member on detach; the product (rightly) restarts nothing."""
    machine = LifecycleMachine()
    spec = SandboxSpec(image="registry.example/agent:1")
    machine.create(
        key="a", providers=[], ttl=None, on_expiry="stop", on_exit="keep", spec=spec, pool="p"
    )
    machine.launch_reported(key="a", read=None, delta=0)
    machine.adopt(member="a", claimant="a", claim="k1", providers=["gh"])
    machine.act(key="a", choice=5, version=False)  # DetachProvider gh, restart requested
    assert machine.events[-1].type == "ProviderDetached"
    assert "gh" not in machine.states["a"].providers  # type: ignore[union-attr]
    machine.teardown()
