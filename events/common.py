"""Shared building blocks of every message: strict base model, names, phases, causes."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

SCHEMA_VERSION: Final = 1

# The widest values the PostgreSQL columns hold (`integer`, `bigint`): a larger one in a message
# is a schema error, not a write that fails later.
INT32_MAX: Final = 2**31 - 1
INT64_MAX: Final = 2**63 - 1


def storable_text(value: str) -> str:
    """Refuse what PostgreSQL cannot store: text and jsonb hold no NUL (U+0000), and a lone
    surrogate has no UTF-8 encoding."""
    if "\x00" in value:
        raise ValueError("must not contain the NUL character (U+0000)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must not contain a lone surrogate (not encodable as UTF-8)") from None
    return value


# Every free-text field of a message: whatever it holds ends up in a text or jsonb column.
Text = Annotated[str, AfterValidator(storable_text)]
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]

# A sandbox name is the partition key of every message about it, a container-name fragment
# and a Kubernetes object name, so it follows the DNS-label rules.
SANDBOX_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
SandboxName = Annotated[str, StringConstraints(pattern=SANDBOX_NAME_PATTERN)]
# A warm pool's name: its members' keys are ``<pool>-<8 random [a-z0-9]>``, so it follows the
# sandbox-name rules too.
PoolName = Annotated[str, StringConstraints(pattern=SANDBOX_NAME_PATTERN)]
COMMAND_ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,128}$"
PROVIDER_NAME_PATTERN: Final = r"^[A-Za-z0-9._-]{1,128}$"
CommandId = Annotated[str, StringConstraints(pattern=COMMAND_ID_PATTERN)]
# A claim's id: every step of one adoption (adopt, bind, abandon, unbind) carries it, and the
# command ids of the steps the processor sends are derived from it (replays send the same ones).
ClaimId = Annotated[str, StringConstraints(pattern=COMMAND_ID_PATTERN)]
ProviderName = Annotated[str, StringConstraints(pattern=PROVIDER_NAME_PATTERN)]
# A template's name follows the sandbox name's rules (a DNS label): it names pools and shows in
# sandbox views beside sandbox names.
TemplateName = Annotated[str, StringConstraints(pattern=SANDBOX_NAME_PATTERN)]
TemplateRevision = Annotated[int, Field(ge=1, le=INT32_MAX)]
Actor = Annotated[Text, StringConstraints(min_length=1, max_length=200)]
Generation = Annotated[int, Field(ge=1, le=INT32_MAX)]  # an `integer` column
Timestamp = AwareDatetime

_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Phase(StrEnum):
    PROVISIONING = "Provisioning"
    STARTING = "Starting"
    READY = "Ready"
    STOPPING = "Stopping"
    STOPPED = "Stopped"
    # Suspend: the runtime is removed, the workspace and everything else kept; resume starts a
    # new generation on the same workspace.
    SUSPENDING = "Suspending"
    SUSPENDED = "Suspended"
    COMPLETED = "Completed"
    ERROR = "Error"
    DELETING = "Deleting"
    DELETED = "Deleted"  # the tombstone: never listed by default, never resurrected


LIVE_PHASES = tuple(p for p in Phase if p is not Phase.DELETED)


class Strict(BaseModel):
    """Base of every wire model: unknown fields are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, str_strip_whitespace=False)


def _check_keys(mapping: dict[str, str], pattern: re.Pattern[str], what: str) -> dict[str, str]:
    for key in mapping:
        if not pattern.fullmatch(key):
            raise ValueError(f"invalid {what} name {key!r}")
    return mapping


class SandboxResources(Strict):
    """Resource limits of a sandbox's runtime; None means the driver's default
    (docs/drivers.md)."""

    memory_mib: Annotated[int, Field(ge=6, le=1_048_576)] | None = None
    cpu_millicores: Annotated[int, Field(ge=10, le=1_024_000)] | None = None
    pids: Annotated[int, Field(ge=8, le=65_536)] | None = None


# The restart policy (sandstream's, not the runtime's): what an exit of the current generation
# does. Never: nothing (the default); OnFailure: a restart after a non-zero exit, a vanished
# runtime or a failed launch; Always: also after exit 0. docs/state-machine.md has the table.
RestartPolicy = Literal["Never", "OnFailure", "Always"]
BackoffSeconds = Annotated[float, Field(ge=0.01, le=24 * 3600)]


class RestartBackoff(Strict):
    """The delay before the n-th restart in a row: ``initial_seconds * 2**(n-1)``, at most
    ``max_seconds``."""

    initial_seconds: BackoffSeconds = 1.0
    max_seconds: BackoffSeconds = 300.0

    @model_validator(mode="after")
    def _ordered(self) -> RestartBackoff:
        if self.max_seconds < self.initial_seconds:
            raise ValueError("max_seconds must not be below initial_seconds")
        return self


MaxRestarts = Annotated[int, Field(ge=0, le=INT32_MAX)]
# Seconds without use before a Ready sandbox is suspended (the scheduler adds the doors' flush
# interval, so a use not yet flushed never counts as idle time).
IdleSeconds = Annotated[int, Field(ge=1, le=365 * 24 * 3600)]


def _label_keys(value: dict[str, str]) -> dict[str, str]:
    return _check_keys(value, _LABEL_KEY, "label")


# Labels a claim adds to the sandbox it adopts (the spec's label rules).
ClaimLabels = Annotated[
    dict[str, Annotated[Text, StringConstraints(max_length=253)]],
    Field(max_length=64),
    AfterValidator(_label_keys),
]


def _env_keys(value: dict[str, str]) -> dict[str, str]:
    return _check_keys(value, _ENV_KEY, "environment variable")


# Environment variables a claim adds to (or replaces in) the spec of the sandbox it adopts
# (the spec's env rules). Plain values, on the log as a create's spec env is; never a
# provider's value (a claim names providers).
ClaimEnv = Annotated[
    dict[str, Annotated[Text, StringConstraints(max_length=10_000)]],
    Field(max_length=256),
    AfterValidator(_env_keys),
]


class SandboxSpec(Strict):
    image: Annotated[Text, StringConstraints(min_length=1, max_length=500)]
    command: list[Annotated[Text, StringConstraints(max_length=10_000)]] = Field(
        default_factory=list, max_length=256
    )
    env: dict[str, Annotated[Text, StringConstraints(max_length=10_000)]] = Field(
        default_factory=dict, max_length=256
    )
    labels: dict[str, Annotated[Text, StringConstraints(max_length=253)]] = Field(
        default_factory=dict, max_length=64
    )
    # Grace period between SIGTERM and SIGKILL when the runtime is stopped or deleted;
    # None means the driver's default.
    stop_timeout_seconds: Annotated[int, Field(ge=0, le=3600)] | None = None
    # Left out of the JSON while unset, so specs without them serialize as before (byte-identical
    # events on replay, readable by a version that does not know them).
    resources: SandboxResources | None = Field(default=None, exclude_if=lambda v: v is None)
    # The root filesystem is read-only unless the image needs to write to it (None: the
    # driver's default, read-only); /workspace and the tmpfs mounts stay writable.
    read_only_root: bool | None = Field(default=None, exclude_if=lambda v: v is None)
    # The restart policy (None: Never), its back-off (None: 1 s doubling to 5 min) and how many
    # restarts in a row it makes before the sandbox stays in Error (None: no limit). Left out
    # while unset, as above.
    restart_policy: RestartPolicy | None = Field(default=None, exclude_if=lambda v: v is None)
    restart_backoff: RestartBackoff | None = Field(default=None, exclude_if=lambda v: v is None)
    max_restarts: MaxRestarts | None = Field(default=None, exclude_if=lambda v: v is None)
    # Idle suspend: a Ready sandbox unused through sandstream's doors (exec, files, logs, a
    # watch of it) this long is suspended (None: never). Left out while unset, as above.
    idle_suspend_seconds: IdleSeconds | None = Field(default=None, exclude_if=lambda v: v is None)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_keys(value, _ENV_KEY, "environment variable")

    @field_validator("labels")
    @classmethod
    def _label_names(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_keys(value, _LABEL_KEY, "label")


# Lifecycle timers and policies (operator features): kept in the row, decided in the fold.
DeadlineKind = Literal["launch", "stop", "delete", "restart", "ttl", "idle"]
ExpiryPolicy = Literal["stop", "delete"]  # what a sandbox's time to live ending does
ExitPolicy = Literal["keep", "delete"]  # what becomes of a sandbox whose main process ended
TTLSeconds = Annotated[int, Field(ge=1, le=10 * 365 * 24 * 3600)]
HoldReason = Annotated[str, StringConstraints(min_length=1, max_length=500)]


class Deadline(Strict):
    """The deadline of the current phase: when it falls due, the scheduler says so on the log.

    ``launch`` guards Provisioning and Starting, ``stop`` guards Stopping (grace period plus a
    margin), ``delete`` guards Deleting (``attempt`` counts the retries so far), ``restart`` is a
    restart the restart policy scheduled in Error or Completed (``attempt``: the restarts in a
    row it will have made).
    """

    kind: Literal["launch", "stop", "delete", "restart"]
    due_at: Timestamp
    attempt: Annotated[int, Field(ge=0)] = 0


class LastExit(Strict):
    """How a generation ended, as the restart policy saw it."""

    generation: Generation
    exit_code: int | None = None
    reason: str
    at: Timestamp


class Restarts(Strict):
    """A sandbox's restart-policy record: ``count`` restarts of this incarnation in all,
    ``attempt`` of them in a row (since the back-off last reset), the last exit, and since when
    the sandbox runs Ready without an exit (None: it is not Ready; a restart for rotated
    credentials does not end the run)."""

    count: Annotated[int, Field(ge=0)] = 0
    attempt: Annotated[int, Field(ge=0)] = 0
    last_exit: LastExit | None = None
    ready_since: Timestamp | None = None


class Hold(Strict):
    """An operator's hold: who placed it, why, and when. Start and restart are refused."""

    by: Actor
    reason: HoldReason
    since: Timestamp


class TemplateRef(Strict):
    """Which template revision a sandbox's spec was resolved from (the spec itself travels in
    full: nothing reads the template back on replay)."""

    name: TemplateName
    revision: TemplateRevision


class Cause(Strict):
    """The input record a decided event or history entry came from."""

    topic: str
    partition: Annotated[int, Field(ge=0)]
    offset: Annotated[int, Field(ge=0)]
    message_type: str
    command_id: CommandId | None = None
