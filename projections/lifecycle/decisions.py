"""``decide(state, message, cause, limits)``: the one entry of the rules. It routes a command
through the admission table and its verb, an observation through the observation table, and a
``DeadlineDue`` to the deadline rules.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from events.commands import (
    AttachProvider,
    Command,
    CreateSandbox,
    DeleteSandbox,
    DetachProvider,
    ExtendSandbox,
    HoldSandbox,
    ReleaseSandbox,
    RestartSandbox,
    ResumeSandbox,
    RotateCredentials,
    SetIdleSuspend,
    SetRestartPolicy,
    StartSandbox,
    StopSandbox,
    SuspendSandbox,
)
from events.common import (
    Cause,
    Hold,
)
from events.decided import (
    AgentRestarted,
    AgentRestartFailed,
    AgentRestartSkipped,
    DecidedEvent,
    IdleSuspendChanged,
    ProviderAttached,
    ProviderDetached,
    RestartPolicyChanged,
    SandboxCompleted,
    SandboxCreated,
    SandboxDeleted,
    SandboxDeleting,
    SandboxExtended,
    SandboxFailed,
    SandboxHeld,
    SandboxOperationFailed,
    SandboxReady,
    SandboxReleased,
    SandboxStarting,
    SandboxStopped,
    SandboxStopping,
    SandboxSuspended,
    SandboxSuspending,
)
from events.observations import (
    DeadlineDue,
    DriverOperationResult,
    Observation,
    RuntimeRemoved,
    RuntimeSnapshot,
)
from events.outcomes import Code
from events.trusted import built

from .claims import CLAIM_COMMANDS, decide_claim, not_found, with_follow_ups
from .commands import Admission, admission, refusal
from .deadline_due import completion_policy, decide_deadline, owed_at_release, owed_stop
from .deadlines import (
    delete_deadline,
    delete_failure_reason,
    failure_reason,
    launch_deadline,
    retry_deadline,
    stop_deadline,
)
from .emit import (
    common_fields,
    emit_event,
    ignored,
    new_event,
    not_current_generation,
    outcome_of,
    rejected,
    then_decide,
)
from .identity import (
    event_id_for,
    identity_for,
    next_generation,
    sandbox_id_for,
)
from .model import (
    DEFAULT_LIMITS,
    STOP_FAILED,
    Decision,
    Limits,
    Message,
    P,
    Sandbox,
    awaits_stop_retry,
)
from .observations import (
    FOLLOW_OBSERVED,
    KEEP_DELETING,
    KEEP_STOPPING,
    OBSERVATION_TABLE,
    STOPPED_STATES,
    ObservationKind,
    Target,
    failed_suspend,
    observation_kind,
    ran_before_its_exit,
)
from .providers import (
    DETACH_HELD,
    DETACH_RESTART,
    HELD,
    OWED_PHASES,
    RESTART,
    ROTATION_RESTART,
    ROTATION_TABLE,
    detach_action,
    held,
    rotation_action,
    stale_detaches,
    stale_rotations,
)
from .restart_policy import (
    OBSERVED_EXIT,
    apply_restart_policy,
    policy_note,
    setting_unchanged,
)

# decide


def decide(
    state: Sandbox | None, message: Message, cause: Cause, limits: Limits = DEFAULT_LIMITS
) -> Decision:
    """The new row, the decided events, the outcome and the commands sent of one input."""
    decision: Decision
    if isinstance(message, DeadlineDue):
        decision = decide_deadline(state, message, cause, limits)
    elif isinstance(message, RuntimeSnapshot | RuntimeRemoved | DriverOperationResult):
        decision = _decide_observation(state, message, cause, limits)
    else:
        decision = _decide_command(state, message, cause, limits)
    return with_follow_ups(state, message, decision)


def _decide_command(
    state: Sandbox | None, command: Command, cause: Cause, limits: Limits
) -> Decision:
    if isinstance(command, CreateSandbox):
        return _create(state, command, cause, limits)
    if isinstance(command, CLAIM_COMMANDS):
        return decide_claim(state, command, cause, limits)
    if state is None or state.tombstoned:
        return rejected(state, command, Code.NOT_FOUND, not_found(state, command.key))
    if isinstance(command, RotateCredentials):
        return _rotate(state, command, cause, limits)
    expected = command.expected_version
    if expected is not None and expected != state.version:
        why = (
            f"expected version {expected} but sandbox {command.key!r} is at version {state.version}"
        )
        return rejected(state, command, Code.ABORTED, why)

    if (refused := refusal(state, command)) is not None:
        return rejected(state, command, Code.FAILED_PRECONDITION, refused)
    rule = admission(command.type, state.phase)
    held = state.hold is not None
    if isinstance(command, HoldSandbox | ReleaseSandbox) and held == isinstance(
        command, HoldSandbox
    ):
        rule = Admission.IDEMPOTENT
    if isinstance(command, AttachProvider | DetachProvider):
        attached = command.provider in state.providers
        if attached == isinstance(command, AttachProvider):
            rule = Admission.IDEMPOTENT
    if setting_unchanged(state.spec, command):
        rule = Admission.IDEMPOTENT
    if rule is Admission.IDEMPOTENT:
        why = f"nothing to do: sandbox {command.key!r} is {state.phase}"
        if isinstance(command, AttachProvider | DetachProvider):
            why = f"nothing to do: provider {command.provider!r} is already " + (
                "attached" if isinstance(command, AttachProvider) else "detached"
            )
        if isinstance(command, HoldSandbox | ReleaseSandbox):
            why = f"nothing to do: sandbox {command.key!r} is " + (
                f"already held by {state.hold.by}: {state.hold.reason}"
                if state.hold is not None
                else "not held"
            )
        return Decision(state, (), "idempotent", why, outcome_of(command, Code.OK, why, state))

    if isinstance(command, DetachProvider):
        return _detach(state, command, cause, limits)
    common = common_fields(state, command, cause)
    at = command.occurred_at
    event: DecidedEvent
    match command:
        case StartSandbox() | RestartSandbox() | ResumeSandbox():
            generation = next_generation(state)
            event = built(
                SandboxStarting,
                type="SandboxStarting",
                **(common | {"generation": generation}),
                reason=_START_REASON[command.type],
                previous_generation=state.generation,
                spec=state.spec,
                identity=identity_for(state.sandbox_id, generation, command.command_id),
                deadline=launch_deadline(at, limits, replacing=state.spec),
            )
        case StopSandbox():
            deadline = stop_deadline(state.spec, at, limits)
            event = new_event(SandboxStopping, common, deadline)
        case SuspendSandbox():
            deadline = stop_deadline(state.spec, at, limits)
            event = new_event(SandboxSuspending, common, deadline)
        case DeleteSandbox():
            deadline = delete_deadline(state.spec, at, limits)
            event = new_event(SandboxDeleting, common, deadline)
        case SetRestartPolicy():
            event = built(
                RestartPolicyChanged,
                type="RestartPolicyChanged",
                **common,
                restart_policy=command.restart_policy,
                restart_backoff=command.restart_backoff,
                max_restarts=command.max_restarts,
            )
        case SetIdleSuspend():
            event = built(
                IdleSuspendChanged,
                type="IdleSuspendChanged",
                **common,
                idle_suspend_seconds=command.idle_suspend_seconds,
            )
        case HoldSandbox():
            hold = built(Hold, by=command.actor, reason=command.reason, since=at)
            event = built(SandboxHeld, type="SandboxHeld", **common, hold=hold)
        case ReleaseSandbox():
            event = new_event(SandboxReleased, common)
        case ExtendSandbox():
            expires_at = at + timedelta(seconds=command.ttl_seconds)
            event = built(SandboxExtended, type="SandboxExtended", **common, expires_at=expires_at)
        case AttachProvider():
            event = built(
                ProviderAttached, type="ProviderAttached", **common, provider=command.provider
            )
        case _:
            raise AssertionError(command)
    new_state, events = emit_event(state, event)
    if isinstance(command, ReleaseSandbox):
        new_state, events = owed_at_release(new_state, events, command, cause, limits)
    why = f"{command.type} accepted: sandbox {command.key!r} is {new_state.phase}"
    return Decision(new_state, events, "applied", why, outcome_of(command, Code.OK, why, new_state))


_START_REASON: Final = {
    "StartSandbox": "start",
    "RestartSandbox": "restart",
    "ResumeSandbox": "resume",
}


def _create(
    state: Sandbox | None, command: CreateSandbox, cause: Cause, limits: Limits
) -> Decision:
    if state is not None and (not state.tombstoned or state.bound_to is not None):
        what = (
            f"phase: {state.phase}"
            if state.bound_to is None
            else f"adopted sandbox {state.bound_to!r}"
        )
        why = f"sandbox {command.key!r} already exists ({what})"
        return rejected(state, command, Code.ALREADY_EXISTS, why)
    # A re-create after delete starts above the tombstone's generation, so nothing of the old
    # incarnation can ever match the new one.
    generation = next_generation(state) if state is not None else 1
    version = state.version + 1 if state is not None else 1
    sandbox_id = sandbox_id_for(command.key, generation, command.command_id)
    event = built(
        SandboxCreated,
        type="SandboxCreated",
        event_id=event_id_for(cause),
        key=command.key,
        sandbox_id=sandbox_id,
        version=version,
        generation=generation,
        occurred_at=command.occurred_at,
        actor=command.actor,
        cause=cause,
        spec=command.spec,
        providers=sorted(set(command.providers)),
        identity=identity_for(sandbox_id, generation, command.command_id),
        deadline=launch_deadline(command.occurred_at, limits),
        expires_at=(
            command.occurred_at + timedelta(seconds=command.ttl_seconds)
            if command.ttl_seconds is not None
            else None
        ),
        on_expiry=command.on_expiry,
        on_exit=command.on_exit,
        # Only when set: an event without one is as it always was (fields set included).
        **({"template": command.template} if command.template is not None else {}),
        **({"pool": command.pool} if command.pool is not None else {}),
    )
    new_state, events = emit_event(state, event)
    why = f"sandbox {command.key!r} created at generation {generation}"
    return Decision(new_state, events, "applied", why, outcome_of(command, Code.OK, why, new_state))


def _rotate(state: Sandbox, command: RotateCredentials, cause: Cause, limits: Limits) -> Decision:
    named = sorted({r.provider for r in command.rotations})
    attached = [p for p in named if p in state.providers]
    if not attached:
        why = f"nothing to do: {', '.join(named)} not attached to sandbox {command.key!r}"
        return Decision(state, (), "idempotent", why, outcome_of(command, Code.OK, why, state))
    action = rotation_action(state, command.restart, attached)
    common = common_fields(state, command, cause)
    event: DecidedEvent
    if action == RESTART:
        event = _agent_restarted(state, common, attached, command.command_id, limits)
        why = f"restart for rotated {', '.join(attached)}: generation {event.generation}"
    else:
        awaits: dict[str, int] = {}
        if state.phase in OWED_PHASES and action == ROTATION_TABLE[state.phase]:
            for r in command.rotations:
                if r.provider in attached:
                    awaits[r.provider] = max(r.revision, awaits.get(r.provider, 0))
        event = built(
            AgentRestartSkipped,
            type="AgentRestartSkipped",
            **common,
            providers=attached,
            reason=action,
            awaits=awaits,
        )
        why = f"restart skipped for rotated {', '.join(attached)}: {action}"
    new_state, events = emit_event(state, event)
    return Decision(new_state, events, "applied", why, outcome_of(command, Code.OK, why, new_state))


def _detach(state: Sandbox, command: DetachProvider, cause: Cause, limits: Limits) -> Decision:
    """ProviderDetached, and in Ready a restart without the provider (DETACH_TABLE)."""
    provider = command.provider
    action = detach_action(state, command.restart, provider)
    new_state, events = emit_event(
        state,
        built(
            ProviderDetached,
            type="ProviderDetached",
            **common_fields(state, command, cause),
            provider=provider,
        ),
    )
    if action == RESTART:
        new_state, events = then_decide(
            new_state,
            events,
            command,
            cause,
            lambda c: _agent_restarted(
                new_state, c, [], command.command_id, limits, detached=[provider]
            ),
        )
        why = (
            f"provider {provider!r} detached: restart without it: generation {new_state.generation}"
        )
    else:
        why = f"provider {provider!r} detached: {action}"
    return Decision(new_state, events, "applied", why, outcome_of(command, Code.OK, why, new_state))


def _decide_observation(
    state: Sandbox | None, obs: Observation, cause: Cause, limits: Limits
) -> Decision:
    kind = observation_kind(obs)
    what = f"{obs.type}({kind}) of generation {obs.generation}"
    if (not_current := not_current_generation(state, obs.generation, what)) is not None:
        return not_current
    assert state is not None  # not_current_generation answered for a missing row

    target = OBSERVATION_TABLE[state.phase].get(kind)
    if target is None:
        return ignored(state, f"no effect in phase {state.phase}: {what}")
    if ran_before_its_exit(state, kind, obs):
        return ignored(state, f"late: {what} from before the exit that ended it")
    if state.awaited and kind == "running" and state.phase in (P.PROVISIONING, P.STARTING):
        return ignored(state, f"{what}: awaiting the launch's report of the values it read")
    event = _observation_event(state, obs, kind, target, common_fields(state, obs, cause), limits)
    new_state, events = emit_event(state, event)
    new_state, events = owed_stop(state, new_state, events, obs, cause, limits)
    if state.awaited and kind == "launch_succeeded":
        assert isinstance(obs, DriverOperationResult)
        new_state, events = _restart_if_stale(
            state, new_state, events, obs, obs.credentials, cause, limits
        )
    elif state.awaited and new_state.phase is P.READY:  # Error or Stopping seen running again:
        new_state, events = _restart_if_stale(  # what it read is unknown
            state, new_state, events, obs, None, cause, limits
        )
    new_state, events = apply_restart_policy(
        new_state, events, obs, OBSERVED_EXIT.get(kind), cause, limits
    )
    new_state, events = completion_policy(new_state, events, obs, cause, limits)
    why = f"{what}: {state.phase} -> {new_state.phase}" + policy_note(events)
    return Decision(new_state, events, "applied", why)


def _restart_if_stale(
    pending: Sandbox,
    state: Sandbox,
    events: tuple[DecidedEvent, ...],
    obs: Observation,
    read: dict[str, int] | None,
    cause: Cause,
    limits: Limits,
) -> tuple[Sandbox, tuple[DecidedEvent, ...]]:
    """The generation that ``pending`` owed rotations or detaches is Ready, having read
    ``read`` (None: unknown): restart once more if it missed a rotation decided meanwhile, or
    read a provider detached meanwhile (the agent must run the newest values, and none of a
    detached provider)."""
    stale = sorted(stale_rotations(pending, read))
    gone = stale_detaches(pending, read)
    if not stale and not gone:
        return state, events
    if held(state):  # a hold made meanwhile: the newest values wait for the next start
        return then_decide(
            state,
            events,
            obs,
            cause,
            lambda c: built(
                AgentRestartSkipped,
                type="AgentRestartSkipped",
                **c,
                providers=stale + gone,
                reason=HELD if stale else DETACH_HELD,
            ),
        )
    return then_decide(
        state,
        events,
        obs,
        cause,
        lambda c: _agent_restarted(state, c, stale, obs.observation_id, limits, detached=gone),
    )


def _agent_restarted(
    state: Sandbox,
    common: dict,  # type: ignore[type-arg]
    providers: list[str],
    id_source: str,
    limits: Limits,
    detached: list[str] | None = None,
) -> AgentRestarted:
    """A restart of ``state`` at the next generation, for rotated ``providers`` and detached
    ones."""
    generation = next_generation(state)
    return built(
        AgentRestarted,
        type="AgentRestarted",
        **(common | {"generation": generation}),
        providers=providers,
        detached=detached or [],
        previous_generation=state.generation,
        spec=state.spec,
        identity=identity_for(state.sandbox_id, generation, id_source),
        deadline=launch_deadline(common["occurred_at"], limits, replacing=state.spec),
    )


def _stop_failed(
    state: Sandbox,
    obs: DriverOperationResult,
    common: dict,  # type: ignore[type-arg]
    limits: Limits,
) -> SandboxOperationFailed:
    """A failed stop: Stopped when the backend was seen with the runtime not running; else
    still Stopping, with the pending retry's deadline (a failure of a retried stop) or the
    first retry's (replacing the escalation's: the stop, kill included, has failed)."""
    if obs.observed in STOPPED_STATES:
        phase, deadline, reason = P.STOPPED, None, obs.reason or "stop failed"
    else:
        phase = P.STOPPING
        deadline = (
            state.deadline
            if awaits_stop_retry(state)
            else retry_deadline("stop", state.spec, obs.occurred_at, limits, 0)
        )
        reason = failure_reason(STOP_FAILED, phase, deadline, "stop", obs.reason)
    return built(
        SandboxOperationFailed,
        type="SandboxOperationFailed",
        **common,
        operation="stop",
        phase=phase,
        reason=reason,
        exit_code=state.exit_code if phase is P.STOPPING else obs.exit_code,
        deadline=deadline,
    )


def _observation_event(
    state: Sandbox,
    obs: Observation,
    kind: ObservationKind,
    target: Target,
    common: dict,  # type: ignore[type-arg]
    limits: Limits,
) -> DecidedEvent:
    exit_code = getattr(obs, "exit_code", None)
    if target == KEEP_DELETING:
        assert isinstance(obs, DriverOperationResult)
        return built(
            SandboxOperationFailed,
            type="SandboxOperationFailed",
            **common,
            operation="delete",
            phase=P.DELETING,
            reason=delete_failure_reason(state, obs.reason),
            exit_code=exit_code,
        )
    if target == KEEP_STOPPING:
        assert isinstance(obs, DriverOperationResult)
        return _stop_failed(state, obs, common, limits)
    if target == FOLLOW_OBSERVED:
        # A failed suspend takes the phase the backend was seen in; not running: Suspended.
        assert isinstance(obs, DriverOperationResult)
        phase, reason, exit_code = failed_suspend(state, obs)
        return built(
            SandboxOperationFailed,
            type="SandboxOperationFailed",
            **common,
            operation=obs.operation,
            phase=phase,
            reason=reason,
            exit_code=exit_code,
        )
    match target:
        case P.READY:
            return new_event(SandboxReady, common)
        case P.STOPPED:
            return new_event(SandboxStopped, common)
        case P.SUSPENDED:
            return new_event(SandboxSuspended, common)
        case P.COMPLETED:
            return built(
                SandboxCompleted, type="SandboxCompleted", **common, exit_code=exit_code or 0
            )
        case P.DELETED:
            return new_event(SandboxDeleted, common)
        case P.ERROR if (
            kind == "launch_failed"
            and state.phase is P.STARTING
            and (state.reason or "").startswith((ROTATION_RESTART, DETACH_RESTART))
        ):
            reason = getattr(obs, "reason", None) or "launch failed"
            return built(
                AgentRestartFailed,
                type="AgentRestartFailed",
                **common,
                reason=reason,
                exit_code=exit_code,
            )
        case P.ERROR:
            reasons = {
                "exited_error": f"runtime exited with code {exit_code}"
                if exit_code is not None
                else "runtime exited with an unknown code",
                "removed": "runtime removed outside sandstream",
            }
            reason = getattr(obs, "reason", None) or reasons.get(kind, f"{kind.replace('_', ' ')}")
            launch = {"launch_failed": True} if kind == "launch_failed" else {}  # set when true
            return built(SandboxFailed, type="SandboxFailed", **common, reason=reason,
                         exit_code=exit_code, **launch)  # fmt: skip
    raise AssertionError(f"no event leads to {target}")
