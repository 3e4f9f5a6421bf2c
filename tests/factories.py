"""Shared builders for tests: every command and observation with sensible defaults.

Everything here is deterministic: timestamps are fixed (``T0`` plus an offset), command and
observation ids come from a counter unless given, and ``Causes`` hands out log coordinates with
an offset that grows per topic. ``Harness`` folds messages through the pure core the way the
processor does (command-id dedupe included) and keeps the rows, outcomes and decided events.

Import it as ``import factories as f`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from pydantic import BaseModel

from events.commands import (
    AdoptSandbox,
    AttachProvider,
    Command,
    CreateSandbox,
    DeleteSandbox,
    DetachProvider,
    ExtendSandbox,
    HoldSandbox,
    ProviderRotation,
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
from events.common import Cause, Phase, RestartBackoff, RestartPolicy, SandboxSpec
from events.decided import DecidedEvent
from events.observations import (
    DeadlineDue,
    DriverOperationResult,
    Observation,
    ObservedState,
    Operation,
    OperationOutcome,
    RuntimeRemoved,
    RuntimeSnapshot,
    RuntimeState,
    Source,
)
from events.outcomes import CommandOutcome
from projections.fold import Step, fold
from projections.lifecycle import Decision, Message, ObservationKind, Sandbox, evolve

# ---------------------------------------------------------------------------------------------
# Constants and ids

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
COMMANDS_TOPIC = "sandbox.commands"
OBSERVATIONS_TOPIC = "sandbox.observations"
EVENTS_TOPIC = "sandbox.events"
KEY = "sbx-1"
IMAGE = "registry.example/agent:1"
USER = "alice"
WATCHER = "podman-watcher"
EXECUTOR = "executor"

_ids = itertools.count(1)


def at(seconds: float = 0) -> datetime:
    """A fixed, timezone-aware timestamp ``seconds`` after ``T0``."""
    return T0 + timedelta(seconds=seconds)


def new_id(prefix: str = "cmd") -> str:
    """A fresh id, unique within the test session (``cmd-17``, ``obs-18``...)."""
    return f"{prefix}-{next(_ids)}"


# ---------------------------------------------------------------------------------------------
# Causes


class Causes:
    """Log coordinates for inputs: one partition, an offset that auto-increments per topic."""

    def __init__(self, partition: int = 0, start: int = 0) -> None:
        self.partition = partition
        self._start = start
        self._next: dict[str, int] = {}

    def __call__(self, message: Message, *, topic: str | None = None) -> Cause:
        topic = topic or topic_for(message)
        offset = self._next.get(topic, self._start)
        self._next[topic] = offset + 1
        return Cause(
            topic=topic,
            partition=self.partition,
            offset=offset,
            message_type=message.type,
            command_id=getattr(message, "command_id", None),
        )


def topic_for(message: Message) -> str:
    is_observation = isinstance(
        message, RuntimeSnapshot | RuntimeRemoved | DriverOperationResult | DeadlineDue
    )
    return OBSERVATIONS_TOPIC if is_observation else COMMANDS_TOPIC


_default_causes = Causes()


def cause(message: Message, *, topic: str | None = None) -> Cause:
    """A cause from a session-wide builder (offsets keep growing); use ``Causes()`` to reset."""
    return _default_causes(message, topic=topic)


# ---------------------------------------------------------------------------------------------
# Commands


def spec(
    image: str = IMAGE,
    *,
    command: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> SandboxSpec:
    return SandboxSpec(
        image=image, command=list(command), env=dict(env or {}), labels=dict(labels or {})
    )


def create(
    key: str = KEY,
    *,
    command_id: str | None = None,
    image: str = IMAGE,
    sandbox_spec: SandboxSpec | None = None,
    providers: Iterable[str] = (),
    actor: str = USER,
    occurred_at: datetime = T0,
    **lifecycle: Any,  # ttl_seconds, on_expiry, on_exit
) -> CreateSandbox:
    return CreateSandbox(
        type="CreateSandbox",
        command_id=command_id or new_id(),
        key=key,
        occurred_at=occurred_at,
        actor=actor,
        spec=sandbox_spec or spec(image),
        providers=list(providers),
        **lifecycle,
    )


def _base(key: str, command_id: str | None, actor: str, occurred_at: datetime) -> dict[str, Any]:
    return {"command_id": command_id or new_id(), "key": key, "actor": actor,
            "occurred_at": occurred_at}  # fmt: skip


M = TypeVar("M", StartSandbox, StopSandbox, RestartSandbox, DeleteSandbox, ReleaseSandbox)
P = TypeVar("P", AttachProvider, DetachProvider)


def _lifecycle(model: type[M]) -> Callable[..., M]:
    """A builder ``f(key, *, command_id, expected_version, actor, occurred_at)`` for ``model``."""

    def build(
        key: str = KEY,
        *,
        command_id: str | None = None,
        expected_version: int | None = None,
        actor: str = USER,
        occurred_at: datetime = T0,
    ) -> M:
        base = _base(key, command_id, actor, occurred_at)
        return model(type=model.__name__, expected_version=expected_version, **base)

    return build


def _provider(model: type[P]) -> Callable[..., P]:
    """A builder ``f(key, provider, *, command_id, ...)`` for attach or detach."""

    def build(
        key: str = KEY,
        provider: str = "github",
        *,
        command_id: str | None = None,
        expected_version: int | None = None,
        actor: str = USER,
        occurred_at: datetime = T0,
        **more: Any,  # DetachProvider's restart
    ) -> P:
        base = _base(key, command_id, actor, occurred_at)
        return model(
            type=model.__name__,
            provider=provider,
            expected_version=expected_version,
            **base,
            **more,
        )

    return build


start = _lifecycle(StartSandbox)
stop = _lifecycle(StopSandbox)
restart = _lifecycle(RestartSandbox)
suspend = _lifecycle(SuspendSandbox)
resume = _lifecycle(ResumeSandbox)
delete = _lifecycle(DeleteSandbox)
attach = _provider(AttachProvider)
detach = _provider(DetachProvider)
release = _lifecycle(ReleaseSandbox)


def hold(
    key: str = KEY,
    reason: str = "investigating",
    *,
    command_id: str | None = None,
    expected_version: int | None = None,
    actor: str = USER,
    occurred_at: datetime = T0,
) -> HoldSandbox:
    base = _base(key, command_id, actor, occurred_at)
    return HoldSandbox(type="HoldSandbox", reason=reason, expected_version=expected_version, **base)


def extend(
    key: str = KEY,
    ttl_seconds: int = 60,
    *,
    command_id: str | None = None,
    expected_version: int | None = None,
    actor: str = USER,
    occurred_at: datetime = T0,
) -> ExtendSandbox:
    base = _base(key, command_id, actor, occurred_at)
    return ExtendSandbox(
        type="ExtendSandbox", ttl_seconds=ttl_seconds, expected_version=expected_version, **base
    )


def set_restart_policy(
    key: str = KEY,
    restart_policy: RestartPolicy = "OnFailure",
    *,
    restart_backoff: RestartBackoff | None = None,
    max_restarts: int | None = None,
    command_id: str | None = None,
    expected_version: int | None = None,
    actor: str = USER,
    occurred_at: datetime = T0,
) -> SetRestartPolicy:
    base = _base(key, command_id, actor, occurred_at)
    return SetRestartPolicy(
        type="SetRestartPolicy",
        restart_policy=restart_policy,
        restart_backoff=restart_backoff,
        max_restarts=max_restarts,
        expected_version=expected_version,
        **base,
    )


def set_idle_suspend(
    key: str = KEY,
    idle_suspend_seconds: int | None = 600,
    *,
    command_id: str | None = None,
    expected_version: int | None = None,
    actor: str = USER,
    occurred_at: datetime = T0,
) -> SetIdleSuspend:
    base = _base(key, command_id, actor, occurred_at)
    return SetIdleSuspend(
        type="SetIdleSuspend",
        idle_suspend_seconds=idle_suspend_seconds,
        expected_version=expected_version,
        **base,
    )


def idle_due(
    key: str = KEY,
    occurred_at: datetime = T0,
    *,
    last_used_at: datetime | None = None,
    generation: int = 1,
    version: int = 0,
) -> DeadlineDue:
    """The scheduler's message that a Ready sandbox with an idle timeout looks idle: its last
    recorded use, read at ``occurred_at``."""
    return DeadlineDue(
        type="DeadlineDue",
        observation_id=f"deadline:{key}:{generation}:idle:{occurred_at.isoformat()}:v{version}",
        key=key,
        generation=generation,
        occurred_at=occurred_at,
        actor="scheduler",
        deadline="idle",
        due_at=occurred_at,
        last_used_at=last_used_at,
    )


def due(
    key: str = KEY,
    deadline: str = "launch",
    due_at: datetime = T0,
    *,
    generation: int = 1,
    occurred_at: datetime | None = None,
) -> DeadlineDue:
    """The scheduler's message that a deadline of the row fell due."""
    return DeadlineDue(
        type="DeadlineDue",
        observation_id=f"deadline:{key}:{generation}:{deadline}:{due_at.isoformat()}",
        key=key,
        generation=generation,
        occurred_at=occurred_at or due_at,
        actor="scheduler",
        deadline=deadline,  # type: ignore[arg-type]
        due_at=due_at,
    )


def rotate(
    key: str = KEY,
    rotations: dict[str, int] | None = None,
    *,
    restart: bool = True,
    command_id: str | None = None,
    actor: str = "alice",
    occurred_at: datetime | None = None,
) -> RotateCredentials:
    """Providers of ``rotations`` (name -> revision; default github@2) rotated."""
    return RotateCredentials(
        type="RotateCredentials",
        **_base(key, command_id, actor, occurred_at or at()),
        rotations=[ProviderRotation(provider=p, revision=r)
                   for p, r in sorted((rotations or {"github": 2}).items())],
        restart=restart,
    )  # fmt: skip


def adopt(
    key: str = KEY,
    claimant: str = "claimant",
    claim_id: str = "claim-1",
    *,
    labels: dict[str, str] | None = None,
    ttl_seconds: int | None = None,
    env: dict[str, str] | None = None,
    providers: Sequence[str] = (),
    command_id: str | None = None,
    actor: str = USER,
    occurred_at: datetime = T0,
) -> AdoptSandbox:
    """A claim's adoption of the pool member ``key`` under the name ``claimant``."""
    return AdoptSandbox(
        type="AdoptSandbox",
        **_base(key, command_id, actor, occurred_at),
        claimant=claimant,
        claim_id=claim_id,
        labels=labels or {},
        ttl_seconds=ttl_seconds,
        env=env or {},
        providers=list(providers),
    )


# Builders of the versioned commands by type name (table-driven tests): ``f(key, **kw)``.
VERSIONED_COMMANDS: dict[str, Callable[..., Command]] = {
    "StartSandbox": start,
    "StopSandbox": stop,
    "RestartSandbox": restart,
    "SuspendSandbox": suspend,
    "ResumeSandbox": resume,
    "DeleteSandbox": delete,
    "AttachProvider": attach,
    "DetachProvider": detach,
    "HoldSandbox": hold,
    "ReleaseSandbox": release,
    "ExtendSandbox": extend,
    "SetRestartPolicy": set_restart_policy,
    "SetIdleSuspend": set_idle_suspend,
}
COMMAND_BUILDERS: dict[str, Callable[..., Command]] = {
    "CreateSandbox": create,
    **VERSIONED_COMMANDS,
}


# ---------------------------------------------------------------------------------------------
# Observations


def snapshot(
    key: str = KEY,
    generation: int = 1,
    state: RuntimeState = "running",
    *,
    exit_code: int | None = None,
    runtime_id: str | None = None,
    source: Source = "watch",
    observation_id: str | None = None,
    actor: str = WATCHER,
    occurred_at: datetime = T0,
) -> RuntimeSnapshot:
    return RuntimeSnapshot(
        type="RuntimeSnapshot",
        observation_id=observation_id or new_id("obs"),
        key=key,
        generation=generation,
        occurred_at=occurred_at,
        actor=actor,
        state=state,
        exit_code=exit_code,
        runtime_id=runtime_id,
        source=source,
    )


def running(key: str = KEY, generation: int = 1, **kw: Any) -> RuntimeSnapshot:
    return snapshot(key, generation, "running", **kw)


def created_snapshot(key: str = KEY, generation: int = 1, **kw: Any) -> RuntimeSnapshot:
    """A runtime that exists but has not been started (or was reset): state ``created``."""
    return snapshot(key, generation, "created", **kw)


def exited(
    key: str = KEY, generation: int = 1, exit_code: int | None = 0, **kw: Any
) -> RuntimeSnapshot:
    return snapshot(key, generation, "exited", exit_code=exit_code, **kw)


def removed(
    key: str = KEY,
    generation: int = 1,
    *,
    runtime_id: str | None = None,
    source: Source = "watch",
    observation_id: str | None = None,
    actor: str = WATCHER,
    occurred_at: datetime = T0,
) -> RuntimeRemoved:
    return RuntimeRemoved(
        type="RuntimeRemoved",
        observation_id=observation_id or new_id("obs"),
        key=key,
        generation=generation,
        occurred_at=occurred_at,
        actor=actor,
        runtime_id=runtime_id,
        source=source,
    )


def result(
    key: str = KEY,
    generation: int = 1,
    operation: Operation = "launch",
    outcome: OperationOutcome = "succeeded",
    *,
    observed: ObservedState | None = None,
    reason: str | None = None,
    identity: str | None = None,
    retryable: bool = False,
    exit_code: int | None = None,
    observation_id: str | None = None,
    actor: str = EXECUTOR,
    occurred_at: datetime = T0,
    credentials: dict[str, int] | None = None,
) -> DriverOperationResult:
    return DriverOperationResult(
        type="DriverOperationResult",
        observation_id=observation_id or new_id("obs"),
        key=key,
        generation=generation,
        occurred_at=occurred_at,
        actor=actor,
        operation=operation,
        outcome=outcome,
        retryable=retryable,
        reason=reason,
        identity=identity,
        observed=observed,
        exit_code=exit_code,
        credentials=credentials,
    )


def launched(key: str = KEY, generation: int = 1, **kw: Any) -> DriverOperationResult:
    return result(key, generation, "launch", "succeeded", **kw)


def stopped(key: str = KEY, generation: int = 1, **kw: Any) -> DriverOperationResult:
    """The executor's report that the stop of ``generation`` succeeded."""
    return result(key, generation, "stop", "succeeded", **kw)


def suspended(key: str = KEY, generation: int = 1, **kw: Any) -> DriverOperationResult:
    """The executor's report that the suspend of ``generation`` succeeded."""
    return result(key, generation, "suspend", "succeeded", **kw)


def deleted(key: str = KEY, generation: int = 1, **kw: Any) -> DriverOperationResult:
    """The executor's report that the delete succeeded."""
    return result(key, generation, "delete", "succeeded", **kw)


def failed(
    key: str = KEY,
    generation: int = 1,
    operation: Operation = "launch",
    *,
    observed: ObservedState | None = None,
    reason: str | None = "boom",
    **kw: Any,
) -> DriverOperationResult:
    return result(key, generation, operation, "failed", observed=observed, reason=reason, **kw)


def observation_of_kind(
    kind: ObservationKind,
    key: str = KEY,
    generation: int = 1,
    *,
    observed: ObservedState | None = None,
    exit_code: int | None = None,
    **kw: Any,
) -> Observation:
    """An observation that ``projections.lifecycle.observation_kind`` classifies as ``kind``."""
    match kind:
        case "created":
            return created_snapshot(key, generation, **kw)
        case "running":
            return running(key, generation, **kw)
        case "stopping":
            return snapshot(key, generation, "stopping", **kw)
        case "exited_ok":
            return exited(key, generation, 0, **kw)
        case "exited_error":
            return exited(key, generation, 1 if exit_code is None else exit_code, **kw)
        case "removed":
            return removed(key, generation, **kw)
    operation, _, suffix = kind.partition("_")
    outcome = {"succeeded": "succeeded", "failed": "failed", "absent": "already_absent"}[suffix]
    return result(
        key,
        generation,
        operation,  # type: ignore[arg-type]
        outcome,  # type: ignore[arg-type]
        observed=observed,
        exit_code=exit_code,
        reason="boom" if outcome == "failed" else None,
        **kw,
    )


# ---------------------------------------------------------------------------------------------
# Folding messages like the processor does


def assert_as_validated(model: BaseModel) -> None:
    """``model`` (built by the rules without validation: ``events.trusted``) is what validating
    construction builds from its values: equal, the same fields set, in the same order, and
    byte for byte the same JSON. Its nested models are validated again too (from the dump)."""
    twin = type(model).model_validate(model.model_dump(include=model.model_fields_set))
    assert twin == model, (twin, model)
    assert twin.model_fields_set == model.model_fields_set, type(model).__name__
    assert list(twin.__dict__) == list(model.__dict__), type(model).__name__
    assert twin.model_dump_json() == model.model_dump_json()


def assert_decided_as_validated(decision: Decision) -> None:
    """Every event and the outcome of one decision are what validation builds."""
    for event in decision.events:
        assert_as_validated(event)
    if decision.outcome is not None:
        assert_as_validated(decision.outcome)


@dataclass
class Harness:
    """Folds messages one at a time through ``projections.fold.fold``, keeping everything."""

    causes: Causes = field(default_factory=Causes)
    states: dict[str, Sandbox | None] = field(default_factory=dict)
    outcomes: dict[str, CommandOutcome] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)

    def send(self, *messages: Message) -> Decision:
        """Fold the messages as one batch; return the decision of the last one."""
        inputs = [(self.causes(m), m) for m in messages]
        batch = fold(self.states, self.outcomes, inputs)
        for step in batch.steps:
            assert_decided_as_validated(step.decision)
        self.states = batch.states
        self.outcomes.update(batch.outcomes)
        self.steps.extend(batch.steps)
        return batch.steps[-1].decision

    def sent(self) -> list[Command]:
        """Every command the decisions so far sent (a claim's next steps), in order."""
        return [c for s in self.steps for c in s.decision.commands]

    def row(self, key: str = KEY) -> Sandbox:
        state = self.states.get(key)
        assert state is not None, f"no row for {key!r}"
        return state

    def events(self, key: str | None = None) -> list[DecidedEvent]:
        return [e for s in self.steps for e in s.decision.events if key is None or e.key == key]

    def rebuilt(self) -> dict[str, Sandbox]:
        """The rows rebuilt from the decided events alone (the rebuild from the log)."""
        rows: dict[str, Sandbox] = {}
        for event in self.events():
            rows[event.key] = evolve(rows.get(event.key), event)
        return rows


def path_to(phase: Phase, key: str = KEY, providers: Iterable[str] = ("github",)) -> list[Message]:
    """Messages that bring a new sandbox ``key`` into ``phase`` (Starting is at generation 2)."""
    first: list[Message] = [create(key, providers=providers)]
    rest: dict[Phase, list[Message]] = {
        Phase.PROVISIONING: [],
        Phase.STARTING: [restart(key)],
        Phase.READY: [running(key, 1)],
        Phase.STOPPING: [running(key, 1), stop(key)],
        Phase.STOPPED: [running(key, 1), stop(key), stopped(key, 1)],
        Phase.SUSPENDING: [running(key, 1), suspend(key)],
        Phase.SUSPENDED: [running(key, 1), suspend(key), suspended(key, 1)],
        Phase.COMPLETED: [exited(key, 1, 0)],
        Phase.ERROR: [exited(key, 1, 3)],
        Phase.DELETING: [running(key, 1), delete(key)],
        Phase.DELETED: [running(key, 1), delete(key), deleted(key, 1)],
    }
    return first + rest[phase]


def harness_in(phase: Phase, key: str = KEY, providers: Iterable[str] = ("github",)) -> Harness:
    """A harness whose sandbox ``key`` is in ``phase``."""
    h = Harness()
    h.send(*path_to(phase, key, providers))
    assert h.row(key).phase is phase, (phase, h.row(key))
    return h
