"""What the read model answers with: the views of a sandbox row, a page of rows, a history
entry and a command's status, built from records without I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal
from uuid import UUID

from pydantic import BaseModel, Field, PrivateAttr

from events.common import (
    Deadline,
    ExitPolicy,
    ExpiryPolicy,
    Hold,
    LastExit,
    Phase,
    SandboxSpec,
    TemplateRef,
)
from events.outcomes import Code, CommandOutcome
from projections.lifecycle import Sandbox
from projections.store import SANDBOX_COLUMNS, sandbox_from_record
from services.common.exec_env import ClaimPart, claim_part

PROGRESSING = (
    Phase.PROVISIONING, Phase.STARTING, Phase.STOPPING, Phase.SUSPENDING, Phase.DELETING,
)  # fmt: skip
# The columns ``sandbox_view`` reads: the row and its position in the change feed.
VIEW_COLUMNS: Final = f"{SANDBOX_COLUMNS}, change_seq"
# The columns ``history_entry`` reads.
HISTORY_COLUMNS: Final = (
    'id, topic, partition, "offset", message_type, command_id, disposition, reason, phase, '
    "generation, version, event_types, message, occurred_at, recorded_at, sandbox_id"
)


class Condition(BaseModel):
    """A yes/no summary of the phase, in the style of Kubernetes conditions."""

    type: Literal["Ready", "Progressing", "Failed"]
    status: Literal["True", "False"]
    reason: str = Field(description="the phase the condition was derived from")
    message: str = ""


class SandboxView(BaseModel):
    id: UUID = Field(description="this incarnation's stable id")
    name: str = Field(description="the sandbox's name: the claimant's for an adopted pool member")
    member_key: str = Field(
        description="the key sandstream keeps the sandbox under (its runtime, history and log "
        "key): its name, except for an adopted pool member (its generated member key)"
    )
    pool: str | None = Field(
        default=None, description="the warm pool it was created for (kept after its adoption)"
    )
    phase: Phase
    generation: int = Field(description="bumped by every create, start, restart and resume")
    version: int = Field(description="+1 per accepted change; use as expected_version")
    spec: SandboxSpec
    labels: dict[str, str]
    providers: list[str] = Field(description="the providers attached (names; values never)")
    claim_providers: list[str] = Field(
        default_factory=list,
        description="those of `providers` a claim attached to this adopted pool member (names): "
        "its process was started before the claim, so their values reach each exec, read at "
        "the exec, and its processes from its next start on",
    )
    identity: str = Field(description="the current generation's runtime identity (not a secret)")
    conditions: list[Condition]
    exit_code: int | None
    reason: str | None = Field(description="why the sandbox is in Error (or a failed operation)")
    created_at: datetime
    updated_at: datetime
    change_seq: int = Field(description="position of this row's last change in the watch feed")
    deadline: Deadline | None = Field(
        default=None, description="the current phase's deadline (Provisioning, Starting, ...)"
    )
    expires_at: datetime | None = Field(
        default=None, description="when the time to live ends (then on_expiry applies)"
    )
    on_expiry: ExpiryPolicy = "stop"
    on_exit: ExitPolicy = Field(
        default="keep", description="delete: deleted once its main process ended"
    )
    hold: Hold | None = Field(
        default=None, description="an operator's hold: start and restart are refused"
    )
    restart_count: int = Field(
        default=0, description="restarts the restart policy made of this incarnation"
    )
    last_exit: LastExit | None = Field(
        default=None, description="how the last generation the restart policy saw ended"
    )
    next_restart_at: datetime | None = Field(
        default=None, description="when the restart the restart policy scheduled is due"
    )
    template: TemplateRef | None = Field(
        default=None, description="the template revision its spec was made from (null: none)"
    )
    # The claim's env and providers, from the same row: what an exec's env needs without a
    # read of its own (services/common/exec_env.py). Never in an answer.
    _claim: ClaimPart | None = PrivateAttr(default=None)

    @property
    def claim_part(self) -> ClaimPart | None:
        return self._claim


class SandboxList(BaseModel):
    items: list[SandboxView]
    next_page_token: str | None = Field(
        description="pass as page_token for the next page; absent on the last page"
    )
    cursor: int = Field(
        description="watch cursor: /v1/watch?cursor=<this> follows every change after this list"
    )


class HistoryEntry(BaseModel):
    seq: int = Field(description="position in the history (ascending)")
    topic: str
    partition: int
    offset: int
    message_type: str | None
    command_id: str | None
    disposition: str = Field(
        description="applied, idempotent, rejected, ignored, duplicate or dead-lettered"
    )
    reason: str
    phase: Phase | None
    generation: int | None
    version: int | None
    events: list[str] = Field(description="the decided events this input produced")
    message: dict[str, Any] | None = Field(description="the input message as recorded")
    occurred_at: datetime | None
    recorded_at: datetime
    sandbox_id: UUID | None = Field(
        default=None, description="the incarnation of the row after this input (null: none)"
    )


class HistoryPage(BaseModel):
    name: str
    items: list[HistoryEntry]
    next_page_token: str | None


class ClaimOutcome(BaseModel):
    """How a create from a pooled template was served (absent for every other command)."""

    pool: str = Field(description="the warm pool of the template")
    warm: bool = Field(description="true: a Ready member adopted; false: a cold create")
    reason: str = Field(description="why (which member, or why none could be adopted)")
    member: str | None = Field(description="the adopted member's key (warm only)")


class CommandStatus(BaseModel):
    command_id: str
    name: str
    command_type: str
    status: Literal["pending", "accepted", "rejected"]
    code: Code | None = Field(description="OK when accepted; the rejection code; null if pending")
    message: str
    sandbox_id: UUID | None = None
    phase: Phase | None = Field(default=None, description="the phase right after the decision")
    generation: int | None = None
    version: int | None = None
    identity: str | None = Field(
        default=None,
        description="the runtime identity of the sandbox's generation right after the decision "
        "(for create, start and restart: the one the command minted)",
    )
    claim: ClaimOutcome | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="a create naming a template that has a warm pool: warm or cold, and why",
    )


def command_status(outcome: CommandOutcome) -> CommandStatus:
    return CommandStatus(
        command_id=outcome.command_id,
        name=outcome.key,
        command_type=outcome.command_type,
        status=outcome.status,
        code=outcome.code,
        message=outcome.message,
        sandbox_id=outcome.sandbox_id,
        phase=outcome.phase,
        generation=outcome.generation,
        version=outcome.version,
        identity=outcome.identity,
    )


def pending_status(command_id: str, name: str, command_type: str, message: str) -> CommandStatus:
    return CommandStatus(
        command_id=command_id,
        name=name,
        command_type=command_type,
        status="pending",
        code=None,
        message=message,
    )


def conditions(phase: Phase, reason: str | None) -> list[Condition]:
    def cond(kind: Literal["Ready", "Progressing", "Failed"], on: bool, msg: str = "") -> Condition:
        return Condition(type=kind, status="True" if on else "False", reason=phase.value,
                         message=msg)  # fmt: skip

    return [
        cond("Ready", phase is Phase.READY),
        cond("Progressing", phase in PROGRESSING),
        cond("Failed", phase is Phase.ERROR, reason or ""),
    ]


@dataclass(frozen=True, slots=True)
class Row:
    """A row as the processor keeps it (what its decided events fold from), and its position
    in the change feed."""

    sandbox: Sandbox
    change_seq: int

    @property
    def view(self) -> SandboxView:
        return view_of(self.sandbox, self.change_seq)


def row_of(record: Any) -> Row:
    return Row(sandbox_from_record(record), record["change_seq"])


def sandbox_view(record: Any) -> SandboxView:
    return view_of(sandbox_from_record(record), record["change_seq"])


def view_of(s: Sandbox, change_seq: int) -> SandboxView:
    """The view of a row (as stored, or a version of it rebuilt from its events)."""
    view = SandboxView(
        id=s.sandbox_id,
        name=s.adopted_as or s.key,
        member_key=s.key,
        pool=s.pool,
        phase=s.phase,
        generation=s.generation,
        version=s.version,
        spec=s.spec,
        labels=dict(s.spec.labels),
        providers=list(s.providers),
        claim_providers=list(s.claim_providers),
        identity=s.identity,
        conditions=conditions(s.phase, s.reason),
        exit_code=s.exit_code,
        reason=s.reason,
        created_at=s.created_at,
        updated_at=s.updated_at,
        change_seq=change_seq,
        deadline=s.deadline,
        expires_at=s.expires_at,
        on_expiry=s.on_expiry,
        on_exit=s.on_exit,
        hold=s.hold,
        restart_count=s.restarts.count if s.restarts else 0,
        last_exit=s.restarts.last_exit if s.restarts else None,
        next_restart_at=(
            s.deadline.due_at if s.deadline is not None and s.deadline.kind == "restart" else None
        ),
        template=s.template,
    )
    view._claim = claim_part(s)
    return view


def history_entry(r: Any) -> HistoryEntry:
    """A record of the history table as the API shows it."""
    return HistoryEntry(
        seq=r["id"],
        topic=r["topic"],
        partition=r["partition"],
        offset=r["offset"],
        message_type=r["message_type"],
        command_id=r["command_id"],
        disposition=r["disposition"],
        reason=r["reason"],
        phase=Phase(r["phase"]) if r["phase"] else None,
        generation=r["generation"],
        version=r["version"],
        events=list(r["event_types"]),
        message=json.loads(r["message"]) if r["message"] is not None else None,
        occurred_at=r["occurred_at"],
        recorded_at=r["recorded_at"],
        sandbox_id=r["sandbox_id"],
    )


def input_label(message_type: str | None, message: dict[str, Any] | None) -> str:
    """A history entry's input in a few words: ``Stop``, ``Snapshot(exited 137)``,
    ``Result(launch succeeded)``, ``Deadline(launch)`` (the CLI's and the console's)."""
    message = message or {}
    kind = message_type or "?"
    if kind == "RuntimeSnapshot":
        state, code = message.get("state"), message.get("exit_code")
        if state == "exited" and code is not None:
            return f"Snapshot(exited {code})"
        return f"Snapshot({state})"
    if kind == "DriverOperationResult":
        return f"Result({message.get('operation')} {message.get('outcome')})"
    if kind == "RuntimeRemoved":
        return "Removed"
    if kind == "DeadlineDue":
        return f"Deadline({message.get('deadline')})"
    if kind == "AdoptSandbox":
        return f"Adopt(as {message.get('claimant')})"
    return kind.removesuffix("Sandbox") if kind != "CreateSandbox" else "Create"
