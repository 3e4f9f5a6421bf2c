"""The driver protocol: what the executor and the watchers need from a container backend.

A driver runs one runtime (a container, a pod) per generation of a sandbox and keeps the
sandbox's workspace across generations of one incarnation. It stamps the key, the incarnation
id, the generation and the runtime identity on the runtime object itself, so everything it
reports can be matched to the generation it describes.

Failures are exceptions: every operation raises :class:`DriverError` (with ``retryable`` and,
where the driver could tell, the state the backend was left in); the result types describe
successes only.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, Protocol, TypeAlias, runtime_checkable
from uuid import UUID

from events.common import SandboxSpec
from events.decided import AgentRestarted, SandboxCreated, SandboxStarting
from events.observations import (
    DriverOperationResult,
    ObservedState,
    Operation,
    OperationOutcome,
    RuntimeRemoved,
    RuntimeSnapshot,
    RuntimeState,
)

IDENTITY_ENV = "SANDSTREAM_IDENTITY"
WORKSPACE_PATH = "/workspace"

# Labels stamped on every runtime (and, except identity and generation, on every workspace).
LABEL_MANAGED_BY = "io.sandstream.managed-by"
MANAGED_BY = "sandstream"
LABEL_KEY = "io.sandstream.key"
LABEL_SANDBOX_ID = "io.sandstream.sandbox-id"
LABEL_GENERATION = "io.sandstream.generation"
LABEL_IDENTITY = "io.sandstream.identity"
# Only when the sandbox's spec sets stop_timeout_seconds: the grace period (whole seconds)
# that stop and delete use for this runtime when the caller passes no explicit timeout.
LABEL_STOP_TIMEOUT = "io.sandstream.stop-timeout"

# What watch() yields: snapshots and removals of runtimes (never DriverOperationResult, which
# the executor derives from the results of its own calls).
WatchObservation: TypeAlias = RuntimeSnapshot | RuntimeRemoved

StopOutcome = Literal["succeeded", "already_absent"]


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything needed to launch one generation of one sandbox."""

    key: str
    sandbox_id: UUID
    generation: int
    identity: str  # passed to the runtime as SANDSTREAM_IDENTITY and the identity label
    spec: SandboxSpec
    # The attached providers' values (environment name -> value), read from PostgreSQL for
    # this launch. A driver hands them over without putting them on the runtime object (no
    # label, no plain env) and removes them with the runtime. Never in a repr.
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)
    # A restart (an operator's, a policy's, a rotation's): the agent starts again, so a driver
    # that keeps a suspend's memory does not restore it (a start or a resume does).
    afresh: bool = False

    @classmethod
    def from_event(
        cls,
        event: SandboxCreated | SandboxStarting | AgentRestarted,
        secrets: Mapping[str, str] | None = None,
    ) -> LaunchSpec:
        """The launch intent of a decided event (create, start, restart, rotation restart)."""
        return cls(
            key=event.key,
            sandbox_id=event.sandbox_id,
            generation=event.generation,
            identity=event.identity,
            spec=event.spec,
            secrets=dict(secrets or {}),
            afresh=isinstance(event, AgentRestarted)
            or (isinstance(event, SandboxStarting) and event.reason == "restart"),
        )


@dataclass(frozen=True, slots=True)
class LaunchResult:
    """The generation's runtime runs (or has been started) with ``identity``."""

    runtime_id: str
    generation: int
    identity: str
    started: bool  # False when it was already running (an idempotent repeat)
    # The runtime existed before this call (made by an earlier, interrupted launch): it holds
    # the provider values that launch read, not this one's.
    adopted: bool = False
    # The revision of each attached provider whose values this launch handed over (set by the
    # executor, which read them; None when unknown, i.e. an adopted runtime).
    credentials: Mapping[str, int] | None = None
    # What the driver wants the history to say about how it launched (Podman: a suspend's
    # memory checkpoint restored, or why a fresh start instead); the result's reason.
    note: str | None = None


@dataclass(frozen=True, slots=True)
class OpResult:
    """The result of a stop: ``already_absent`` when no runtime of that generation exists."""

    outcome: StopOutcome
    runtime_id: str | None = None
    exit_code: int | None = None  # of the stopped runtime, when known
    # A suspend's word for the history (Podman: whether the memory was kept): the reason.
    note: str | None = None


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """One runtime of a sandbox, as read from the backend (labels and state)."""

    key: str
    sandbox_id: UUID
    generation: int
    state: RuntimeState  # created / running / stopping (its removal under way) / exited
    exit_code: int | None  # set when exited
    runtime_id: str
    identity: str | None
    # When it entered its state, if the backend says (an exit's time for an exited runtime).
    since: datetime | None = None


class DriverError(Exception):
    """An operation failed. ``observed`` is the backend state afterwards, when the driver knows it.

    ``retryable`` is True for transient trouble (backend unreachable, timeouts, conflicts) and
    False for failures a retry cannot fix (missing image, a superseded generation, bad spec).
    """

    def __init__(
        self,
        reason: str,
        *,
        retryable: bool,
        observed: ObservedState | None = None,
        exit_code: int | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.observed = observed
        self.exit_code = exit_code

    def __repr__(self) -> str:
        return (
            f"DriverError({self.reason!r}, retryable={self.retryable}, "
            f"observed={self.observed!r}, exit_code={self.exit_code!r})"
        )


class BackendRefused(DriverError):
    """The backend refused sandstream's own credentials the operation (a Kubernetes 403: the
    deployment's RBAC lacks it): the deployment's problem, not the caller's, and no retry
    cures it until an operator grants the permission."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, retryable=False)


@runtime_checkable
class Driver(Protocol):
    """One container backend. Implementations: PodmanDriver, KubernetesDriver, FakeDriver."""

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        """Create and start the runtime of (key, sandbox_id, generation); idempotent.

        Removes the runtimes of older generations of the key first (stopping them). If this
        generation's runtime runs, returns at once (``started=False``); if it was created but
        never started, starts it; if it ran and exited, the launch fails (not retryable): a
        generation never runs twice. A newer generation's runtime makes the launch fail (not
        retryable)."""
        ...

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        """Stop this generation's runtime, keeping it and the workspace.

        Already stopped: ``succeeded``; no such runtime: ``already_absent``. ``timeout`` is the
        grace period between SIGTERM and SIGKILL (default: the sandbox's own
        ``stop_timeout_seconds`` when its spec set one, else the driver's stop timeout).
        """
        ...

    async def suspend(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        """Stop this generation's runtime and remove it (Podman: older ones left too), keeping
        the workspace, so that a later launch of a newer generation finds it as it was.

        Nothing of those generations left: ``already_absent``. ``timeout`` as for stop. A
        driver whose workspace does not outlive its runtime refuses (not retryable).
        """
        ...

    async def kill(self, key: str, generation: int) -> OpResult:
        """Kill this generation's runtime at once (SIGKILL), keeping it and the workspace.

        Not queued behind the key's other calls: it is how a stop that outlived its grace
        period is forced (a stop under way then returns too). Not running any more:
        ``succeeded``; no such runtime: ``already_absent``.
        """
        ...

    async def delete(self, key: str, sandbox_id: UUID | None = None) -> bool:
        """Remove every runtime of the key and its workspace; True if anything existed.

        Each running runtime is stopped first with its own grace period (the sandbox's
        ``stop_timeout_seconds``, else the driver's stop timeout).

        With ``sandbox_id``, only that incarnation's runtimes and workspace: a slow delete of
        an old incarnation can then never touch a re-created sandbox of the same name.
        """
        ...

    async def get(self, key: str) -> builtins.list[RuntimeInfo]:
        """The runtimes of one key, oldest generation first."""
        ...

    async def list(self) -> builtins.list[RuntimeInfo]:
        """Every runtime this driver manages, by key then generation."""
        ...

    def watch(self) -> AsyncIterator[WatchObservation]:
        """Observations of runtimes, forever: a full listing (source="list"), then changes.

        After a broken stream the watcher reconnects and lists again, so a restarted or
        reconnected watcher re-syncs. Duplicates are possible; they share an observation_id.
        """
        ...

    async def close(self) -> None:
        """Release connections; watchers end."""
        ...


# One incarnation of a sandbox: (key, sandbox_id).
Incarnation: TypeAlias = tuple[str, UUID]


@runtime_checkable
class HoldingsDriver(Protocol):
    """A driver that can list what it holds beyond runtimes (an optional capability): the
    reconcile loop compares it with the rows to collect a deleted incarnation's leftovers."""

    async def incarnations(self) -> builtins.set[Incarnation]:
        """Every incarnation of which the backend holds anything this driver made for it:
        runtimes, workspaces, and the secrets it labels with the incarnation."""
        ...


@dataclass(frozen=True, slots=True)
class ExecOutput:
    """A chunk of a command's output, as the runtime delivered it."""

    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True, slots=True)
class ExecExit:
    """The command ended: always the last event of an exec stream."""

    exit_code: int


ExecEvent: TypeAlias = ExecOutput | ExecExit


@runtime_checkable
class ExecDriver(Protocol):
    """A driver that can run a command in a running runtime (an optional capability)."""

    def exec_stream(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        stdin: bytes | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """Run ``command`` in the generation's runtime, inside the runtime (never on the host):
        output chunks as they come, then one :class:`ExecExit`. ``stdin``: the command's
        input, closed after it (None: no input, the command reads its end at once).

        Raises DriverError when the runtime does not exist or is not running. Leaving the
        iteration before the exit ends the command (SIGTERM, then SIGKILL after a grace) where
        the driver can signal it, and returns once it has (drivers/podman_exec_end.py).
        """
        ...


def exec_env_refusal(driver: object | None) -> str | None:
    """Why ``driver``'s exec cannot carry environment values privately, so that what a claim
    hands a sandbox through exec alone (its env, its providers' values) must wait for a cold
    start instead; None: it can (the Podman driver: the values travel in the exec session's
    body over the Podman socket). A driver says so by its ``exec_env_refusal`` attribute; one
    that says nothing is taken as unable."""
    if driver is None:
        return "this API cannot exec (a claim's env and providers reach a sandbox through exec)"
    default = f"the {type(driver).__name__} driver's exec does not pass environment values"
    refusal: str | None = getattr(driver, "exec_env_refusal", default)
    return refusal


def observed_state(state: RuntimeState) -> ObservedState:
    """What a failure reports as the backend's state: a runtime still stopping counts as
    running (the operation that failed did not end it)."""
    return "running" if state == "stopping" else state


def grace_period(requested: float | None, sandbox: float | None, driver_default: float) -> float:
    """The grace period between SIGTERM and SIGKILL: the caller's, else the sandbox's own
    (``spec.stop_timeout_seconds``), else the driver's default."""
    if requested is not None:
        return requested
    return driver_default if sandbox is None else float(sandbox)


def operation_result(
    *,
    operation: Operation,
    key: str,
    generation: int,
    observation_id: str,
    occurred_at: datetime,
    actor: str,
    result: LaunchResult | OpResult | bool | DriverError,
) -> DriverOperationResult:
    """The observation the executor appends for one driver call (a result or a DriverError).

    ``bool`` is the result of delete: False (nothing existed) is ``already_absent``.
    """
    outcome: OperationOutcome = "succeeded"
    retryable, reason, observed, identity, exit_code = False, None, None, None, None
    credentials: dict[str, int] | None = None
    match result:
        case DriverError():
            outcome, retryable, reason = "failed", result.retryable, result.reason
            observed, exit_code = result.observed, result.exit_code
        case LaunchResult():
            identity, reason = result.identity, result.note
            credentials = dict(result.credentials) if result.credentials is not None else None
        case OpResult():
            outcome, exit_code, reason = result.outcome, result.exit_code, result.note
        case bool():
            outcome = "succeeded" if result else "already_absent"
    return DriverOperationResult(
        type="DriverOperationResult",
        observation_id=observation_id,
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
