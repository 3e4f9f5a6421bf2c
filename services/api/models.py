"""Request and response bodies of the API that are not read-model views, and the shared
parameter and response declarations of its routes."""

from __future__ import annotations

from typing import Annotated, Any, Final

from fastapi import Body, Path, Query
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from events.common import (
    INT64_MAX,
    SANDBOX_NAME_PATTERN,
    CommandId,
    ExitPolicy,
    ExpiryPolicy,
    HoldReason,
    MaxRestarts,
    ProviderName,
    RestartBackoff,
    RestartPolicy,
    SandboxName,
    SandboxResources,
    SandboxSpec,
    TemplateRevision,
    TTLSeconds,
)
from services.api.errors import ErrorBody
from services.api.readmodel import CommandStatus

MAX_WAIT: Final = 60.0  # seconds a command request may wait for its outcome


class SandboxResourcesRequest(SandboxResources):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _no_nul(value: Any) -> None:
    if isinstance(value, str) and "\x00" in value:
        raise ValueError("must not contain NUL characters")
    if isinstance(value, list):
        for item in value:
            _no_nul(item)
    if isinstance(value, dict):
        for key, item in value.items():
            _no_nul(key)
            _no_nul(item)


class SandboxSpecRequest(SandboxSpec):
    """The spec as a request carries it: JSON types are not coerced (``"3"`` is no integer),
    and no string has a NUL character (PostgreSQL's text and jsonb cannot store one: the
    processor would have to dead-letter the command)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @field_validator("image", "command", "env", "labels")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        _no_nul(value)
        return value

    resources: SandboxResourcesRequest | None = Field(default=None, exclude_if=lambda v: v is None)


class TemplateRefRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: SandboxName = Field(description="the template name")
    revision: TemplateRevision | None = Field(
        default=None, description="this revision (default: the newest)"
    )


class OverridesRequest(BaseModel):
    """What a sandbox may change of its template: env added or replaced, labels added (not a
    label the template sets). The time to live is the request's `ttl_seconds`, providers its
    `providers` (added to the template's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    env: dict[str, Annotated[str, StringConstraints(max_length=10_000)]] = Field(
        default_factory=dict, max_length=256
    )
    labels: dict[str, Annotated[str, StringConstraints(max_length=253)]] = Field(
        default_factory=dict, max_length=64
    )

    @field_validator("env", "labels")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        _no_nul(value)
        return value


class CreateSandboxRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: SandboxName = Field(description="the sandbox name: a DNS label, unique among live ones")
    spec: SandboxSpecRequest | None = Field(
        default=None, description="the full spec (or `template` instead)"
    )
    template: TemplateRefRequest | None = Field(
        default=None,
        description="make it from this template (instead of `spec`); the sandbox records the "
        "revision. Of the other fields, only `overrides`, `ttl_seconds` and `providers` "
        "(added to the template's) may be set with it",
    )
    overrides: OverridesRequest | None = Field(
        default=None, description="with `template`: env added or replaced, labels added"
    )
    providers: list[ProviderName] = Field(default_factory=list, max_length=64)
    command_id: CommandId | None = Field(
        default=None, description="idempotency key; a retry with the same id gets the same outcome"
    )
    ttl_seconds: TTLSeconds | None = Field(
        default=None,
        description="time to live from now; without it the server's default (if any) applies",
    )
    on_expiry: ExpiryPolicy = Field(default="stop", description="what the end of the ttl does")
    on_exit: ExitPolicy = Field(
        default="keep",
        description="delete: delete the sandbox once its main process ended (Completed, Error)",
    )


class LifecycleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    command_id: CommandId | None = Field(
        default=None, description="idempotency key; a retry with the same id gets the same outcome"
    )
    expected_version: int | None = Field(
        default=None,
        ge=0,
        le=INT64_MAX,  # a `bigint` column
        description="reject with ABORTED (409) unless the row is at this version",
    )


class HealthBody(BaseModel):
    status: str


class Check(BaseModel):
    ok: bool
    detail: str


class ReadyBody(BaseModel):
    status: str
    # The rest only for a token with the ops:read scope.
    checks: dict[str, Check] | None = None
    lag: int | None = Field(default=None, description="records the processor has still to apply")
    max_lag: int | None = None


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    described = {
        401: "missing or invalid token",
        403: "the token lacks the scope",
        404: "NOT_FOUND: no such sandbox (or command)",
        409: "ALREADY_EXISTS, ABORTED (expected_version mismatch), or IDEMPOTENCY_CONFLICT "
        "(the command_id was first used for another request)",
        413: "PAYLOAD_TOO_LARGE: the body or the command is above the limit",
        412: "FAILED_PRECONDITION: the phase does not admit the command (or, for a provider, "
        "it is still attached)",
        422: "INVALID_ARGUMENT: the request names the offending field",
        500: "KAFKA_FORBIDDEN: Kafka refused the command for want of an ACL (not accepted; "
        "an operator must grant it, then retry with the same command_id)",
        503: "UNAVAILABLE: Kafka or PostgreSQL cannot be reached",
    }
    return {c: {"model": ErrorBody, "description": described[c]} for c in codes}


COMMAND_RESPONSES = {
    202: {"model": CommandStatus, "description": "published; the outcome is pending"},
    **responses(401, 403, 404, 409, 412, 413, 422, 500, 503),
}

WaitQuery = Annotated[
    float | None,
    Query(
        ge=0,
        le=MAX_WAIT,
        description="seconds to wait for the outcome; without it the answer is 202 at once",
    ),
]
# OpenAPI 3.1: the schema of an event stream describes one event.
SSE_EVENT_SCHEMA: Final = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": ["sandbox", "bookmark", "denied"]},
        "id": {"type": "string", "pattern": "^[0-9]+$", "description": "the change_seq"},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "a SandboxView (event: sandbox), {cursor} (event: bookmark) or "
            "{status, code, message} (event: denied: the token lapsed; the stream ends)",
        },
        "retry": {"type": "integer"},
    },
}
NamePath = Annotated[str, Path(pattern=SANDBOX_NAME_PATTERN, description="the sandbox name")]
LifecycleBody = Annotated[LifecycleRequest | None, Body()]


class HoldRequest(LifecycleRequest):
    reason: HoldReason = Field(description="why it is held (shown to whoever tries to start it)")


class ExtendRequest(LifecycleRequest):
    ttl_seconds: TTLSeconds = Field(description="the sandbox expires this long from now")


class RestartPolicyRequest(LifecycleRequest):
    restart_policy: RestartPolicy = Field(
        description="Never, OnFailure (after a non-zero exit, a vanished runtime or a failed "
        "launch) or Always (also after exit 0)"
    )
    restart_backoff: RestartBackoff | None = Field(
        default=None, description="the delay before each restart in a row (default 1 s to 300 s)"
    )
    max_restarts: MaxRestarts | None = Field(
        default=None, description="restarts in a row before the sandbox stays in Error"
    )
