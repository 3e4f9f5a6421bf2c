"""Operator lifecycle: hold, release and extend a sandbox, and the sandboxes that need
attention (past a deadline, held, expiring soon).

The commands are built here like the others (``occurred_at`` at this edge, ``actor`` the
token's name: a hold records who placed it) and go through the gateway.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from events.commands import (
    ExtendSandbox,
    HoldSandbox,
    ReleaseSandbox,
    SetIdleSuspend,
    SetRestartPolicy,
)
from events.publisher import new_command_id, now
from services.api import readmodel
from services.api.deps import Reader, State, Writer
from services.api.models import (
    COMMAND_RESPONSES,
    ExtendRequest,
    HoldRequest,
    IdleSuspendRequest,
    LifecycleBody,
    LifecycleRequest,
    NamePath,
    RestartPolicyRequest,
    WaitQuery,
    responses,
)
from services.api.readmodel import Attention, CommandStatus
from services.api.routes.commands import idle_refusal, submit

router = APIRouter()


@router.post(
    "/v1/sandboxes/{name}:hold",
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Hold a sandbox: start and restart are refused until it is released",
    tags=["commands"],
)
async def hold_sandbox(
    name: NamePath, body: HoldRequest, principal: Writer, state: State, wait: WaitQuery = None
) -> JSONResponse:
    command = HoldSandbox(
        type="HoldSandbox",
        command_id=body.command_id or new_command_id(),
        key=name,
        occurred_at=now(),
        actor=principal.name,
        expected_version=body.expected_version,
        reason=body.reason,
    )
    return await submit(state.gateway, command, wait)


@router.post(
    "/v1/sandboxes/{name}:release",
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Release a held sandbox",
    tags=["commands"],
)
async def release_sandbox(
    name: NamePath,
    principal: Writer,
    state: State,
    body: LifecycleBody = None,
    wait: WaitQuery = None,
) -> JSONResponse:
    request = body or LifecycleRequest()
    command = ReleaseSandbox(
        type="ReleaseSandbox",
        command_id=request.command_id or new_command_id(),
        key=name,
        occurred_at=now(),
        actor=principal.name,
        expected_version=request.expected_version,
    )
    return await submit(state.gateway, command, wait)


@router.post(
    "/v1/sandboxes/{name}:extend",
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Set a sandbox's time to live anew, from now",
    tags=["commands"],
)
async def extend_sandbox(
    name: NamePath, body: ExtendRequest, principal: Writer, state: State, wait: WaitQuery = None
) -> JSONResponse:
    command = ExtendSandbox(
        type="ExtendSandbox",
        command_id=body.command_id or new_command_id(),
        key=name,
        occurred_at=now(),
        actor=principal.name,
        expected_version=body.expected_version,
        ttl_seconds=body.ttl_seconds,
    )
    return await submit(state.gateway, command, wait)


@router.post(
    "/v1/sandboxes/{name}:restart-policy",
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Set a sandbox's restart policy, its back-off and its limit",
    tags=["commands"],
)
async def set_restart_policy(
    name: NamePath,
    body: RestartPolicyRequest,
    principal: Writer,
    state: State,
    wait: WaitQuery = None,
) -> JSONResponse:
    command = SetRestartPolicy(
        type="SetRestartPolicy",
        command_id=body.command_id or new_command_id(),
        key=name,
        occurred_at=now(),
        actor=principal.name,
        expected_version=body.expected_version,
        restart_policy=body.restart_policy,
        restart_backoff=body.restart_backoff,
        max_restarts=body.max_restarts,
    )
    return await submit(state.gateway, command, wait)


@router.post(
    "/v1/sandboxes/{name}:idle-suspend",
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Set (or clear) a sandbox's idle timeout",
    tags=["commands"],
)
async def set_idle_suspend(
    name: NamePath,
    body: IdleSuspendRequest,
    principal: Writer,
    state: State,
    wait: WaitQuery = None,
) -> JSONResponse:
    if body.idle_suspend_seconds is not None:
        idle_refusal(state.settings, name, "idle_suspend_seconds")
    command = SetIdleSuspend(
        type="SetIdleSuspend",
        command_id=body.command_id or new_command_id(),
        key=name,
        occurred_at=now(),
        actor=principal.name,
        expected_version=body.expected_version,
        idle_suspend_seconds=body.idle_suspend_seconds,
    )
    return await submit(state.gateway, command, wait)


@router.get(
    "/v1/attention",
    response_model=Attention,
    responses=responses(401, 403, 503),
    summary="Counts of live sandboxes past a deadline, held, and expiring soon",
    tags=["sandboxes"],
)
async def get_attention(principal: Reader, state: State) -> Attention:
    return await readmodel.attention(state.pool, now(), state.settings.expiring_soon_seconds)
