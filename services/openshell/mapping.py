"""OpenShell's resource model <-> sandstream's: pure functions, no I/O.

See docs/openshell-compat.md for the mapping in prose. Answers are built in the served schema
(``proto/served.proto``): both protocol generations' fields at once. Phases: sandstream's
Completed (the main process ended with 0) is COMPLETED for a 0.1 client and STOPPED, with its
exit code, for a 0.0 one (its enum has no COMPLETED); a tombstone (Deleted) is only ever seen
by a watch, as DELETING, right before the stream ends. ``metadata.id`` is the incarnation's
stable id, ``metadata.resource_version`` the row version.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final, TypeAlias

from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import ValidationError

from events.common import (
    PROVIDER_NAME_PATTERN,
    SANDBOX_NAME_PATTERN,
    ExitPolicy,
    ExpiryPolicy,
    Phase,
    RestartPolicy,
    SandboxSpec,
    TemplateRef,
)
from services.api.readmodel import SandboxView
from services.openshell.proto import served_pb2
from services.openshell.proto.served_pb2 import SandboxPhase, SandboxRestartPolicy
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm_0_1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.wire import Generation

DEFAULT_WORKSPACE: Final = "default"
CreateRequest: TypeAlias = os_0_0.CreateSandboxRequest | os_0_1.CreateSandboxRequest
# The main process of a spec without a command: keeps the sandbox running until stopped.
DEFAULT_COMMAND: Final = ("sleep", "infinity")
GENERATED_PREFIX: Final = "sandbox-"

PHASES: Final[Mapping[Phase, SandboxPhase.ValueType]] = {
    Phase.PROVISIONING: SandboxPhase.SANDBOX_PHASE_PROVISIONING,
    Phase.STARTING: SandboxPhase.SANDBOX_PHASE_STARTING,
    Phase.READY: SandboxPhase.SANDBOX_PHASE_READY,
    Phase.STOPPING: SandboxPhase.SANDBOX_PHASE_STOPPING,
    Phase.STOPPED: SandboxPhase.SANDBOX_PHASE_STOPPED,
    # OpenShell has no suspended phase: its clients see a suspended sandbox as stopped.
    Phase.SUSPENDING: SandboxPhase.SANDBOX_PHASE_STOPPING,
    Phase.SUSPENDED: SandboxPhase.SANDBOX_PHASE_STOPPED,
    Phase.COMPLETED: SandboxPhase.SANDBOX_PHASE_STOPPED,
    Phase.ERROR: SandboxPhase.SANDBOX_PHASE_ERROR,
    Phase.DELETING: SandboxPhase.SANDBOX_PHASE_DELETING,
    Phase.DELETED: SandboxPhase.SANDBOX_PHASE_DELETING,
}
_NAME = re.compile(SANDBOX_NAME_PATTERN)
# 0.1's SandboxSpec.restart_policy (OpenShell #2798) <-> sandstream's spec.restart_policy.
# UNSPECIFIED is sandstream's default, Never; the back-off and max_restarts, which OpenShell's
# spec does not carry, are sandstream's defaults (1 s doubling to 5 min, no limit).
RESTART_POLICIES: Final[Mapping[RestartPolicy, SandboxRestartPolicy.ValueType]] = {
    "Never": SandboxRestartPolicy.SANDBOX_RESTART_POLICY_NEVER,
    "OnFailure": SandboxRestartPolicy.SANDBOX_RESTART_POLICY_ON_FAILURE,
    "Always": SandboxRestartPolicy.SANDBOX_RESTART_POLICY_ALWAYS,
}
_REQUESTED_POLICY: Final[Mapping[int, RestartPolicy | None]] = {
    SandboxRestartPolicy.SANDBOX_RESTART_POLICY_UNSPECIFIED: None,
    SandboxRestartPolicy.SANDBOX_RESTART_POLICY_NEVER: None,
    **{int(v): k for k, v in RESTART_POLICIES.items() if k != "Never"},
}


class InvalidRequest(ValueError):
    """A request that cannot be mapped: INVALID_ARGUMENT with this message (naming the field)."""


def phase_of(phase: Phase, generation: Generation = Generation.V0_0) -> SandboxPhase.ValueType:
    if phase is Phase.COMPLETED and generation is Generation.V0_1:
        return SandboxPhase.SANDBOX_PHASE_COMPLETED
    return PHASES[phase]


def millis(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def timestamp(moment: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def object_meta(
    name: str, object_id: str, created: datetime, version: int, labels: Mapping[str, str]
) -> served_pb2.ObjectMeta:
    """Metadata with both generations' creation time (``created_at_ms`` and ``created_time``)."""
    return served_pb2.ObjectMeta(
        id=object_id,
        name=name,
        created_at_ms=millis(created),
        created_time=timestamp(created),
        labels=labels,
        resource_version=version,
        workspace=DEFAULT_WORKSPACE,
    )


def sandbox_message(
    view: SandboxView, generation: Generation = Generation.V0_0
) -> served_pb2.Sandbox:
    """The OpenShell resource of a sandstream row, readable by both generations (only the
    phase of a Completed sandbox depends on the reader's generation)."""
    metadata = object_meta(view.name, str(view.id), view.created_at, view.version, view.labels)
    if view.phase in (Phase.DELETING, Phase.DELETED):
        metadata.deletion_timestamp_ms = millis(view.updated_at)
        metadata.deletion_time.CopyFrom(timestamp(view.updated_at))
    spec = served_pb2.SandboxSpec(
        environment=view.spec.env,
        template=served_pb2.SandboxTemplate(image=view.spec.image, labels=view.labels),
        providers=view.providers,
        command=view.spec.command,
        restart_policy=RESTART_POLICIES[view.spec.restart_policy or "Never"],
    )
    status = served_pb2.SandboxStatus(
        sandbox_name=view.name,
        conditions=[
            served_pb2.SandboxCondition(
                type=c.type,
                status=c.status,
                reason=c.reason,
                message=c.message,
                last_transition_time=view.updated_at.isoformat(),
                transition_time=timestamp(view.updated_at),
            )
            for c in view.conditions
        ],
        phase=phase_of(view.phase, generation),
        restart_count=view.restart_count,
    )
    if view.next_restart_at is not None:
        status.next_restart_time.CopyFrom(timestamp(view.next_restart_at))
    if view.exit_code is not None and view.phase in (Phase.ERROR, Phase.COMPLETED):
        status.exit_code = view.exit_code
    made = served_pb2.Sandbox(metadata=metadata, spec=spec, status=status)
    if view.template is not None:  # 0.1's provenance: the template's name and revision
        made.created_from_workload_template.name = view.template.name
        made.created_from_workload_template.resource_version = str(view.template.revision)
    return made


# ---------------------------------------------------------------------------------------------
# Create requests


@dataclass(frozen=True, slots=True)
class NewSandbox:
    name: str
    spec: SandboxSpec
    providers: list[str]
    # A create naming a template takes these from it (services/openshell/sandboxes.py).
    ttl_seconds: int | None = None
    on_expiry: ExpiryPolicy = "stop"
    on_exit: ExitPolicy = "keep"
    template: TemplateRef | None = None


def sandbox_name(requested: str, command_id: str | None) -> str:
    """The requested name, checked; or a generated one (derived from the command id, when
    there is one, so that a retry of the same command names the same sandbox)."""
    if requested:
        if not _NAME.fullmatch(requested):
            raise InvalidRequest(
                f"name {requested!r}: must be a DNS label: 1-63 lowercase letters, digits or "
                "'-', starting and ending with a letter or digit"
            )
        return requested
    seed = command_id if command_id is not None else uuid.uuid4().hex
    return GENERATED_PREFIX + hashlib.sha256(seed.encode()).hexdigest()[:10]


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"])
        parts.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


_FIELDS_OF_SPEC: Final = {"image": "spec.template.image", "command": "spec.command",
                          "env": "spec.environment", "labels": "labels"}  # fmt: skip


def new_sandbox(
    request: CreateRequest, *, default_image: str, command_id: str | None
) -> NewSandbox:
    """The sandstream sandbox a CreateSandbox request (of either generation: their spec, name,
    labels and annotations agree) asks for; InvalidRequest if it cannot be. The workspace is
    the caller's to check.

    The spec is checked before a name is generated (a request without a spec names nothing).
    """
    if not request.HasField("spec"):
        raise InvalidRequest("spec: required")
    spec = request.spec
    if spec.resource_requirements.HasField("gpu"):
        gpu = spec.resource_requirements.gpu
        if gpu.HasField("count") and gpu.count == 0:
            raise InvalidRequest("spec.resource_requirements.gpu.count: must be at least 1")
        raise InvalidRequest("spec.resource_requirements.gpu: sandstream's drivers have no GPUs")
    template = spec.template
    unsupported = [
        ("annotations", bool(request.annotations)),
        ("spec.template.annotations", bool(template.annotations)),
        ("spec.template.runtime_class_name", bool(template.runtime_class_name)),
        ("spec.template.agent_socket", bool(template.agent_socket)),
        ("spec.template.user_namespaces", template.HasField("user_namespaces")),
    ]
    for field, given in unsupported:
        if given:
            raise InvalidRequest(f"{field}: not supported by sandstream")
    labels = {**template.labels, **request.labels}
    env = {**template.environment, **spec.environment}
    restart_policy = requested_restart_policy(request)
    try:
        checked = SandboxSpec(
            image=template.image or default_image,
            command=list(spec.command) or list(DEFAULT_COMMAND),
            env=env,
            labels=labels,
            restart_policy=restart_policy,
        )
    except ValidationError as exc:
        message = _describe(exc)
        for ours, theirs in _FIELDS_OF_SPEC.items():
            message = message.replace(f"{ours}:", f"{theirs}:").replace(f"{ours}.", f"{theirs}.")
        raise InvalidRequest(message) from None
    providers = checked_providers(spec.providers)
    return NewSandbox(sandbox_name(request.name, command_id), checked, providers)


def checked_providers(names: Iterable[str]) -> list[str]:
    """A create's ``spec.providers`` (with or without a template); InvalidRequest for a name no
    provider can have (the HTTP API's pattern)."""
    providers = list(names)
    for provider in providers:
        if not re.fullmatch(PROVIDER_NAME_PATTERN, provider):
            raise InvalidRequest(f"spec.providers: invalid provider name {provider!r}")
    return providers


def requested_restart_policy(request: CreateRequest) -> RestartPolicy | None:
    """A 0.1 request's ``spec.restart_policy`` (0.0 has none): None for Never or unspecified;
    INVALID_ARGUMENT for a value this release does not know."""
    if not isinstance(request, os_0_1.CreateSandboxRequest):
        return None
    value = request.spec.restart_policy
    if value not in _REQUESTED_POLICY:
        raise InvalidRequest(f"spec.restart_policy: unknown value {value}")
    return _REQUESTED_POLICY[value]


# ---------------------------------------------------------------------------------------------
# Lists


def label_filters(selector: str) -> list[str]:
    """``k1=v1,k2=v2`` (equality, ANDed) as the read model's ``key=value`` filters."""
    filters = []
    for part in selector.split(","):
        term = part.strip()
        if not term:
            continue
        key, sep, value = term.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or "=" in value or key.endswith("!"):
            raise InvalidRequest(f"label_selector: expected key=value[,key=value], got {term!r}")
        filters.append(f"{key}={value}")
    return filters


def selected_workspace(selector: dm_0_1.WorkspaceSelector) -> str | None:
    """The workspace a 0.1 selector names; None for all workspaces."""
    if selector.WhichOneof("selection") == "all_workspaces":
        return None
    return selector.workspace
