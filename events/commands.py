"""Commands: what producers ask for, published on the commands topic keyed by sandbox name."""

from __future__ import annotations

from typing import Annotated, Literal
from uuid import UUID

from pydantic import Field, StringConstraints

from events.common import (
    INT64_MAX,
    SCHEMA_VERSION,
    Actor,
    ClaimEnv,
    ClaimId,
    ClaimLabels,
    CommandId,
    ExitPolicy,
    ExpiryPolicy,
    HoldReason,
    IdleSeconds,
    MaxRestarts,
    PoolName,
    ProviderName,
    RestartBackoff,
    RestartPolicy,
    SandboxName,
    SandboxSpec,
    Strict,
    TemplateRef,
    Text,
    Timestamp,
    TTLSeconds,
)


class CommandBase(Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    # Idempotency key: a retry with the same id gets the first outcome back.
    command_id: CommandId
    key: SandboxName
    occurred_at: Timestamp
    actor: Actor


class VersionedCommand(CommandBase):
    # Client optimistic concurrency: a mismatch is rejected (ABORTED), never retried.
    expected_version: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None


class CreateSandbox(CommandBase):
    type: Literal["CreateSandbox"]
    spec: SandboxSpec
    providers: list[ProviderName] = Field(default_factory=list, max_length=64)
    # Time to live from this command's occurred_at; None: lives until deleted.
    ttl_seconds: TTLSeconds | None = None
    on_expiry: ExpiryPolicy = "stop"
    on_exit: ExitPolicy = "keep"
    # The template revision the API resolved the spec from; left out while unset, so creates
    # without one serialize as before.
    template: TemplateRef | None = Field(default=None, exclude_if=lambda v: v is None)
    # A warm pool's member (its key is generated): it waits Ready until a claim adopts it.
    # Left out of the JSON while unset, so other creates serialize as before.
    pool: PoolName | None = Field(default=None, exclude_if=lambda v: v is None)


class StartSandbox(VersionedCommand):
    type: Literal["StartSandbox"]


class StopSandbox(VersionedCommand):
    type: Literal["StopSandbox"]


class SuspendSandbox(VersionedCommand):
    """Free the sandbox's compute: stop and remove its runtime, keep its workspace and
    everything it is (name, incarnation, providers, policies) until ResumeSandbox."""

    type: Literal["SuspendSandbox"]


class ResumeSandbox(VersionedCommand):
    """Bring a suspended sandbox back: a new generation on the same workspace."""

    type: Literal["ResumeSandbox"]
    # Sent by a wake on access (an exec or files call), not asked for by an operator: refused
    # while the sandbox's time to live has ended. Left out of the JSON while unset, so other
    # resumes serialize as before.
    wake: bool = Field(default=False, exclude_if=lambda v: not v)


class RestartSandbox(VersionedCommand):
    type: Literal["RestartSandbox"]


class DeleteSandbox(VersionedCommand):
    type: Literal["DeleteSandbox"]


class AttachProvider(VersionedCommand):
    type: Literal["AttachProvider"]
    provider: ProviderName


class DetachProvider(VersionedCommand):
    """Take a provider off this sandbox. A Ready sandbox restarts without its values (its agent
    must stop seeing them) unless ``restart`` is false: then they leave at its next start."""

    type: Literal["DetachProvider"]
    provider: ProviderName
    restart: bool = True


class ProviderRotation(Strict):
    """One provider whose applied values were replaced, and the revision that replaced them."""

    provider: ProviderName
    revision: Annotated[int, Field(ge=1)]


class RotateCredentials(CommandBase):
    """Credentials of providers attached to this sandbox rotated: restart it once for all of
    them (``restart``), or let the new values wait for its next start. Carries names and
    revisions only, never a value."""

    type: Literal["RotateCredentials"]
    rotations: list[ProviderRotation] = Field(min_length=1, max_length=64)
    restart: bool = True


class HoldSandbox(VersionedCommand):
    """Quarantine: start and restart are refused (stop and delete are not) until released."""

    type: Literal["HoldSandbox"]
    reason: HoldReason


class ReleaseSandbox(VersionedCommand):
    type: Literal["ReleaseSandbox"]


class ExtendSandbox(VersionedCommand):
    """Set the time to live anew: the sandbox expires ``ttl_seconds`` after this command."""

    type: Literal["ExtendSandbox"]
    ttl_seconds: TTLSeconds


class SetRestartPolicy(VersionedCommand):
    """Change the restart policy, its back-off and its limit (each as in the spec; the back-off
    and the limit unset: the defaults). A scheduled restart stays only if the new values would
    have scheduled it (Never cancels it); otherwise they apply from the next exit on."""

    type: Literal["SetRestartPolicy"]
    restart_policy: RestartPolicy
    restart_backoff: RestartBackoff | None = None
    max_restarts: MaxRestarts | None = None


class SetIdleSuspend(VersionedCommand):
    """Change the idle timeout (None: never idle-suspended). The idle time counts anew from
    this command."""

    type: Literal["SetIdleSuspend"]
    idle_suspend_seconds: IdleSeconds | None


# -- Claims (docs/adr/0009): a claim adopts a Ready pool member in two steps, each decided on
# its own key and idempotent by claim_id. AdoptSandbox on the member's key; the processor then
# sends BindSandboxName on the claimant's key; if that name is taken it sends AbandonAdoption
# back to the member (which is deleted). Deleting an adopted sandbox sends UnbindSandboxName.


class AdoptSandbox(CommandBase):
    """Adopt this pool member (``key``) under the name ``claimant``: accepted only for a Ready,
    unheld member not adopted yet (or already adopted by this same ``claim_id``)."""

    type: Literal["AdoptSandbox"]
    claimant: SandboxName
    claim_id: ClaimId
    labels: ClaimLabels = Field(default_factory=dict)  # added to the member's, no restart
    # The claim's time to live, from this command's occurred_at (None: the member keeps none).
    # Left out while unset, as the fields below, so claims without them serialize as before.
    ttl_seconds: TTLSeconds | None = Field(default=None, exclude_if=lambda v: v is None)
    # The claim's env (added to or replacing the member's spec env) and providers (attached by
    # name, never their values): delivered to every exec through sandstream's doors; the
    # member's running process keeps its own environment (docs/pools.md).
    env: ClaimEnv = Field(default_factory=dict, exclude_if=lambda v: not v)
    providers: list[ProviderName] = Field(
        default_factory=list, max_length=64, exclude_if=lambda v: not v
    )


class BindSandboxName(CommandBase):
    """Bind the name ``key`` to the adopted member ``target`` (sent by the processor after
    SandboxAdopted): accepted only if no live sandbox and no other claim holds the name."""

    type: Literal["BindSandboxName"]
    target: SandboxName
    claim_id: ClaimId
    sandbox_id: UUID  # the member's incarnation
    spec: SandboxSpec  # the member's spec as adopted: what the name stands for


class AbandonAdoption(CommandBase):
    """The adoption ``claim_id`` of this member lost its name (sent by the processor after a
    refused BindSandboxName): the member is deleted and its pool refills."""

    type: Literal["AbandonAdoption"]
    claimant: SandboxName
    claim_id: ClaimId
    reason: Annotated[Text, StringConstraints(max_length=2000)]


class UnbindSandboxName(CommandBase):
    """The adopted member ``target`` is deleted: its name ``key`` is free again (sent by the
    processor after the member's SandboxDeleted). Only the binding of ``claim_id`` is undone."""

    type: Literal["UnbindSandboxName"]
    target: SandboxName
    claim_id: ClaimId


Command = Annotated[
    CreateSandbox
    | StartSandbox
    | StopSandbox
    | RestartSandbox
    | SuspendSandbox
    | ResumeSandbox
    | DeleteSandbox
    | AttachProvider
    | DetachProvider
    | RotateCredentials
    | HoldSandbox
    | ReleaseSandbox
    | ExtendSandbox
    | SetRestartPolicy
    | SetIdleSuspend
    | AdoptSandbox
    | BindSandboxName
    | AbandonAdoption
    | UnbindSandboxName,
    Field(discriminator="type"),
]
