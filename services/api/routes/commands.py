"""Commands: create, stop, start, restart, suspend, resume, delete, and a command's outcome
by id.

Commands are built here (``occurred_at`` is the time at this edge, ``actor`` the token's name)
and handed to the gateway; the answer is 202 once Kafka acknowledged them, or with
``?wait=<seconds>`` the command's outcome.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse

from events.commands import (
    Command,
    CreateSandbox,
    DeleteSandbox,
    RestartSandbox,
    ResumeSandbox,
    StartSandbox,
    StopSandbox,
    SuspendSandbox,
)
from events.common import COMMAND_ID_PATTERN, SANDBOX_NAME_PATTERN, SandboxSpec
from events.outcomes import CommandOutcome
from events.publisher import new_command_id, now
from services.api import idempotency, pool_claims, readmodel
from services.api.deps import ApiState, Reader, State, Writer, require_also
from services.api.errors import STATUS_OF, ApiError, error_response
from services.api.gateway import CommandGateway, CommandTooLarge, PublishFailed, PublishForbidden
from services.api.idempotency import IdempotencyConflict
from services.api.models import (
    COMMAND_RESPONSES,
    CreateSandboxRequest,
    LifecycleBody,
    LifecycleRequest,
    NamePath,
    WaitQuery,
    responses,
)
from services.api.providers import require_existing
from services.api.readmodel import CommandStatus
from services.common import templates
from services.common.providers import ProviderMissing
from services.common.settings import Settings
from services.common.suspend import suspend_refusal
from services.common.tokens import PROVIDER_WRITE, stop_timeout_refusal

router = APIRouter()


def outcome_response(outcome: CommandOutcome, created: bool) -> JSONResponse:
    status = STATUS_OF[outcome.code]
    headers = {}
    if created and outcome.accepted:
        status = 201
        headers["Location"] = f"/v1/sandboxes/{outcome.key}"
    body = readmodel.command_status(outcome).model_dump(mode="json")
    return JSONResponse(body, status, headers=headers)


# What the gateway raises for a command it did not publish (or may not have).
REFUSALS: Final = (PublishForbidden, PublishFailed, IdempotencyConflict, CommandTooLarge)


def refused(exc: Exception, command_id: str, message: str) -> JSONResponse:
    """The answer to one of REFUSALS for the request's command ``command_id``."""
    if isinstance(exc, PublishForbidden):  # 500, not the retryable 503: an operator must act
        return error_response(500, "KAFKA_FORBIDDEN", message, command_id=command_id)
    if isinstance(exc, PublishFailed):
        return error_response(503, "UNAVAILABLE", message, command_id=command_id)
    if isinstance(exc, IdempotencyConflict):
        return error_response(409, "IDEMPOTENCY_CONFLICT", message, command_id=command_id)
    return error_response(413, "PAYLOAD_TOO_LARGE", message)


async def submit(gateway: CommandGateway, command: Command, wait: float | None) -> JSONResponse:
    created = isinstance(command, CreateSandbox)
    try:
        submitted = await gateway.submit(command, wait)
    except REFUSALS as exc:
        return refused(exc, command.command_id, str(exc))
    if submitted.outcome is not None:
        return outcome_response(submitted.outcome, created)
    body = readmodel.pending_status(
        command.command_id, command.key, command.type, "published; the outcome is pending"
    )
    return JSONResponse(
        body.model_dump(mode="json"),
        202,
        headers={"Location": f"/v1/commands/{command.command_id}"},
    )


@router.post(
    "/v1/sandboxes",
    status_code=201,
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Create a sandbox",
    description="Needs sandbox:write; a create that attaches providers (`providers`) also "
    "needs provider:write, as attaching one later does.",
    tags=["commands"],
)
async def create_sandbox(
    body: CreateSandboxRequest, principal: Writer, state: State, wait: WaitQuery = None
) -> JSONResponse:
    made = await made_from(body, state)
    if made.providers:  # an attached provider's values reach the agent this token controls
        require_also(principal, PROVIDER_WRITE, "to attach providers at create")
        try:  # as an attach of a missing provider is refused
            await require_existing(state.pool, made.providers, body.command_id)
        except ProviderMissing as exc:
            if (source := templates.named_by(made.ref, body.providers, exc.name)) is not None:
                raise ApiError(404, "NOT_FOUND", f"field 'template': {exc} ({source})") from exc
            raise ApiError(404, "NOT_FOUND", f"field 'providers': {exc}") from exc
    cap = state.settings.api_max_stop_timeout_seconds
    if (why := stop_timeout_refusal(principal, cap, made.spec.stop_timeout_seconds)) is not None:
        raise ApiError(422, "INVALID_ARGUMENT", f"field 'spec.stop_timeout_seconds': {why}")
    if made.spec.idle_suspend_seconds is not None:
        field = "template" if body.template is not None else "spec.idle_suspend_seconds"
        idle_refusal(state.settings, body.name, field)
    command = CreateSandbox(
        type="CreateSandbox",
        command_id=body.command_id or new_command_id(),
        key=body.name,
        occurred_at=now(),
        actor=principal.name,
        spec=made.spec,
        providers=made.providers,
        ttl_seconds=made.ttl_seconds or state.settings.default_ttl_seconds,
        on_expiry=made.on_expiry,
        on_exit=made.on_exit,
        template=made.ref,
    )
    try:
        claimed = await pool_claims.create_or_claim(
            state, principal, body, command, lambda: submit(state.gateway, command, wait)
        )
    except REFUSALS as exc:  # the claim's adoption of a member (a command of its own)
        message = f"claiming a member of the template's warm pool: {exc}"
        if isinstance(exc, PublishFailed):  # retried, the create is the same claim
            message = (
                "claiming a member of the template's warm pool: Kafka did not acknowledge the "
                "adoption; it may still be applied: retry with the same command_id "
                f"{command.command_id!r}"
            )
        return refused(exc, command.command_id, message)
    return claimed if claimed is not None else await submit(state.gateway, command, wait)


def idle_refusal(settings: Settings, name: str, field: str) -> None:
    """A 422 naming ``field`` when ``name`` has an idle timeout it cannot be suspended for:
    each idle suspend would fail and leave it Ready, to be found idle again (the scheduler
    skips such a sandbox too)."""
    if (why := suspend_refusal(settings, name)) is not None:
        raise ApiError(422, "INVALID_ARGUMENT", f"field '{field}': an idle timeout suspends "
                       f"the sandbox, and {name!r} cannot be suspended here: {why}")  # fmt: skip


# The fields a create from a template may not set (the template does).
_FROM_TEMPLATE: Final = ("spec", "on_expiry", "on_exit")


async def made_from(body: CreateSandboxRequest, state: ApiState) -> templates.Resolved:
    """The create's full spec: the request's own, or its template's with its overrides (the
    rule in services/common/templates.py). A 4xx names the offending field."""
    if body.template is None:
        if body.spec is None:
            raise ApiError(422, "INVALID_ARGUMENT", "field 'spec': required (or name a template)")
        if body.overrides is not None:
            raise ApiError(422, "INVALID_ARGUMENT", "field 'overrides': only with a template")
        spec = SandboxSpec.model_validate(body.spec.model_dump())
        return templates.Resolved(
            spec, list(body.providers), body.ttl_seconds, body.on_expiry, body.on_exit, None
        )
    for name in _FROM_TEMPLATE:
        if name in body.model_fields_set:
            raise ApiError(
                422,
                "INVALID_ARGUMENT",
                f"field {name!r}: set by template {body.template.name!r}; a create from a "
                "template may set only overrides.env, overrides.labels, ttl_seconds and "
                "providers",
            )
    overrides = pool_claims.request_overrides(body)
    ref = body.template
    try:
        async with state.pool.acquire() as conn:
            revision, decided = ref.revision, None
            if revision is None and body.command_id is not None:  # a retry: as decided first
                decided = await templates.revision_decided(
                    conn, body.name, body.command_id, ref.name
                )
            return await templates.resolve(
                conn, ref.name, overrides, revision or decided, deleted=decided is not None
            )
    except templates.TemplateMissing as exc:
        raise ApiError(404, "NOT_FOUND", f"field 'template': {exc}") from exc
    except templates.OverrideRefused as exc:
        raise ApiError(422, "INVALID_ARGUMENT", str(exc)) from exc


Lifecycle = (
    StartSandbox | StopSandbox | RestartSandbox | SuspendSandbox | ResumeSandbox | DeleteSandbox
)


def lifecycle(kind: type[Lifecycle]) -> Any:
    """The handler of one lifecycle command on a named sandbox."""
    type_name = kind.__name__

    async def handler(
        name: NamePath,
        principal: Writer,
        state: State,
        body: LifecycleBody = None,
        wait: WaitQuery = None,
    ) -> JSONResponse:
        request = body or LifecycleRequest()
        if kind is SuspendSandbox and (why := suspend_refusal(state.settings, name)) is not None:
            raise ApiError(412, "FAILED_PRECONDITION", f"cannot suspend {name!r}: {why}")
        command = kind(
            type=type_name,
            command_id=request.command_id or new_command_id(),
            key=name,
            occurred_at=now(),
            actor=principal.name,
            expected_version=request.expected_version,
        )
        return await submit(state.gateway, command, wait)

    handler.__name__ = f"{type_name[:-7].lower()}_sandbox"
    return handler


_SUMMARIES: Final = {
    "stop": "Stop a sandbox",
    "start": "Start a sandbox",
    "restart": "Restart a sandbox",
    "suspend": "Suspend a sandbox: remove its runtime, keep its workspace and everything it is",
    "resume": "Resume a suspended sandbox: a new generation on the same workspace",
}
for _verb, _kind in (
    ("stop", StopSandbox),
    ("start", StartSandbox),
    ("restart", RestartSandbox),
    ("suspend", SuspendSandbox),
    ("resume", ResumeSandbox),
):
    router.post(
        f"/v1/sandboxes/{{name}}:{_verb}",
        response_model=CommandStatus,
        responses=COMMAND_RESPONSES,
        summary=_SUMMARIES[_verb],
        tags=["commands"],
    )(lifecycle(_kind))
router.delete(
    "/v1/sandboxes/{name}",
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Delete a sandbox",
    tags=["commands"],
)(lifecycle(DeleteSandbox))


@router.get(
    "/v1/commands/{command_id}",
    response_model=CommandStatus,
    responses=responses(401, 403, 404, 422, 503),
    summary="A command's outcome (pending until the processor decided it; 404 if never seen)",
    tags=["commands"],
)
async def get_command(
    command_id: Annotated[str, Path(pattern=COMMAND_ID_PATTERN)],
    principal: Reader,
    state: State,
    sandbox: Annotated[
        str | None,
        Query(pattern=SANDBOX_NAME_PATTERN, description="the sandbox the command was for"),
    ] = None,
    wait: WaitQuery = None,
) -> CommandStatus:
    if wait:
        outcome = await state.gateway.wait_outcome(command_id, sandbox, wait)
    else:
        outcome = await readmodel.get_outcome(state.pool, command_id, sandbox)
    if outcome is not None:
        return readmodel.command_status(outcome)
    known = await idempotency.recorded(state.pool, command_id)
    if known is None or not known.published or sandbox not in (None, known.key):
        raise ApiError(
            404,
            "NOT_FOUND",
            f"command {command_id!r} is not known"
            + (f" for sandbox {sandbox!r}" if sandbox else "")
            + ": neither decided nor published through this API",
        )
    return readmodel.pending_status(
        command_id, known.key, known.command_type, "published; the outcome is pending"
    )
