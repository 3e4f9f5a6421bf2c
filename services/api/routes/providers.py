"""Providers: create, list, get, update credentials (one or several), delete; and attach or
detach a provider on a sandbox. Responses carry key names, fingerprints and times only.

Every write takes the commands' idempotency key, ``command_id`` in the body (a delete's body
is optional and holds only it): a retry with the same id gets the first outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Final, Literal

from fastapi import APIRouter, Body, Path, Query, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from events.commands import AttachProvider, DetachProvider
from events.common import INT64_MAX, PROVIDER_NAME_PATTERN, CommandId, ProviderName
from services.api import readmodel
from services.api.deps import ApiState, ProviderReader, ProviderWriter, State, Writer
from services.api.errors import ApiError
from services.api.idempotency import IdempotencyConflict
from services.api.models import COMMAND_RESPONSES, NamePath, WaitQuery, responses
from services.api.providers import ProviderInUse, ProviderService, Receipt, ScopeMissing
from services.api.readmodel import CommandStatus
from services.api.readmodel.pages import name_after, name_page
from services.api.routes.commands import submit
from services.common import providers
from services.common.credentials import CredentialKeyError
from services.common.providers import ProviderExists, ProviderInfo, ProviderMissing, Update
from services.common.tokens import Principal

router = APIRouter()

CREDENTIAL_KEY_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_]{0,255}$"
EnvName = Annotated[str, StringConstraints(pattern=CREDENTIAL_KEY_PATTERN)]


def _settable(value: str) -> str:
    # A value becomes an environment variable, which cannot hold a NUL: the agent would see it cut.
    if "\x00" in value:
        raise ValueError("must not contain NUL characters (an environment variable cannot)")
    return value


SecretValue = Annotated[str, StringConstraints(max_length=65_536), AfterValidator(_settable)]
ProviderType = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
Credentials = Annotated[
    dict[EnvName, SecretValue],
    Field(max_length=256, description="key (the environment variable) -> value; write-only"),
]
ProviderPath = Annotated[str, Path(pattern=PROVIDER_NAME_PATTERN, description="provider")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Write(_Strict):
    command_id: CommandId | None = Field(
        default=None,
        description="the idempotency key (as a command's): a retry with the same id and "
        "request gets the first outcome and changes nothing; another request under it is 409",
    )


class CreateProviderRequest(_Write):
    name: ProviderName
    type: ProviderType = "generic"
    credentials: Credentials = Field(default_factory=dict)


class UpdateCredentialsRequest(_Write):
    credentials: Credentials
    no_restart: bool = Field(
        default=False, description="apply without restarting anyone (they apply at next start)"
    )


class ProviderValues(_Strict):
    name: ProviderName
    type: ProviderType | None = None
    credentials: Credentials


class UpdateProvidersRequest(_Write):
    providers: list[ProviderValues] = Field(min_length=1, max_length=256)
    no_restart: bool = False
    create_missing: bool = Field(default=False, description="create providers that do not exist")


class DeleteProviderRequest(_Write):
    pass


class AttachRequest(_Strict):
    provider: ProviderName
    command_id: CommandId | None = None
    expected_version: int | None = Field(default=None, ge=0, le=INT64_MAX)  # a `bigint` column


class DetachRequest(AttachRequest):
    no_restart: bool = Field(
        default=False,
        description="leave a Ready sandbox running: the provider's values leave at its next "
        "start (by default it restarts without them)",
    )


class KeyView(BaseModel):
    name: str
    fingerprint: str = Field(description="HMAC-SHA256 of the value under this installation's salt")
    updated_at: datetime


class ProviderView(BaseModel):
    name: str
    type: str
    revision: int
    created_at: datetime
    updated_at: datetime
    keys: list[KeyView]


class ProviderList(BaseModel):
    items: list[ProviderView]
    next_page_token: str | None = Field(
        default=None, description="pass as page_token for the next page; absent on the last page"
    )


class ProviderChangeView(BaseModel):
    name: str
    revision: int
    created: bool
    baseline: list[str] = Field(description="keys seen for the first time: restart nothing")
    rotated: list[str] = Field(description="keys whose applied value was replaced")
    removed: list[str]
    unchanged: list[str]


class SandboxActionView(BaseModel):
    sandbox: str
    providers: list[str]
    action: Literal["restart", "skip"]
    reason: str
    command_id: str
    delivery: Literal["sent", "pending"] = Field(
        description="sent: Kafka acknowledged the command; pending: not yet, it is stored with "
        "the values and sent again until Kafka acknowledges it (nothing to retry)"
    )


class UpdateReceipt(BaseModel):
    providers: list[ProviderChangeView]
    sandboxes: list[SandboxActionView] = Field(
        description="what the update does to every attached live sandbox (as of the update; "
        "the history records what was decided)"
    )
    restart: bool
    unsent: list[str] = Field(
        description="the command ids Kafka has not acknowledged yet (delivery pending): stored "
        "with the values and sent until it does"
    )


class DeleteResult(BaseModel):
    name: str
    detached: list[str]
    unsent: list[str] = Field(
        description="the DetachProvider command ids Kafka has not acknowledged yet: stored with "
        "the delete and sent until it does"
    )


def service(request: Request) -> ProviderService:
    found: ProviderService = request.app.state.providers
    return found


def view(info: ProviderInfo) -> ProviderView:
    return ProviderView(
        name=info.name,
        type=info.type,
        revision=info.revision,
        created_at=info.created_at,
        updated_at=info.updated_at,
        keys=[KeyView(name=k.name, fingerprint=k.fingerprint, updated_at=k.updated_at)
              for k in info.keys],
    )  # fmt: skip


def receipt_view(receipt: Receipt) -> UpdateReceipt:
    return UpdateReceipt(
        providers=[
            ProviderChangeView(
                name=a.change.provider,
                revision=a.revision,
                created=a.created,
                baseline=a.change.of("baseline"),
                rotated=a.change.of("rotated"),
                removed=a.change.of("removed"),
                unchanged=a.change.of("unchanged"),
            )
            for a in receipt.applied
        ],
        sandboxes=[
            SandboxActionView(
                sandbox=line.sandbox,
                providers=list(line.providers),
                action=line.action,
                reason=line.reason,
                command_id=line.command_id,
                delivery="pending" if line.command_id in receipt.unsent else "sent",
            )
            for line in receipt.sandboxes
        ],
        restart=receipt.restart,
        unsent=receipt.unsent,
    )


async def _update(
    request: Request,
    principal: Principal,
    updates: list[Update],
    restart: bool,
    create: bool | None,
    request_id: str | None,
) -> Receipt:
    for update in updates:
        reserved = sorted(k for k in update.values if k.startswith(providers.RESERVED_PREFIX))
        if reserved:
            raise ApiError(
                422,
                "INVALID_ARGUMENT",
                f"credentials: {', '.join(reserved)} of provider {update.name!r}: names starting "
                f"with {providers.RESERVED_PREFIX} are reserved",
            )
    with refusals():
        return await service(request).update(
            updates, actor=principal.name, restart=restart, create=create, request_id=request_id
        )


@contextmanager
def refusals() -> Iterator[None]:
    """The provider service's refusals as the API's answers."""
    try:
        yield
    except ScopeMissing as exc:
        raise ApiError(403, "PERMISSION_DENIED", str(exc)) from exc
    except CredentialKeyError as exc:
        raise ApiError(503, "UNAVAILABLE", f"credentials key: {exc}") from exc
    except ProviderMissing as exc:
        raise ApiError(404, "NOT_FOUND", str(exc)) from exc
    except ProviderExists as exc:
        raise ApiError(409, "ALREADY_EXISTS", str(exc)) from exc
    except ProviderInUse as exc:
        raise ApiError(412, "FAILED_PRECONDITION", str(exc)) from exc
    except IdempotencyConflict as exc:
        raise ApiError(409, "IDEMPOTENCY_CONFLICT", str(exc), command_id=exc.command_id) from exc


PROVIDER_RESPONSES = responses(401, 403, 404, 409, 413, 422, 503)


@router.post(
    "/v1/providers",
    status_code=201,
    response_model=ProviderView,
    responses=PROVIDER_RESPONSES,
    summary="Create a provider (its first values are a baseline: nothing restarts)",
    tags=["providers"],
)
async def create_provider(
    body: CreateProviderRequest, principal: ProviderWriter, state: State, request: Request
) -> JSONResponse:
    update = Update(body.name, body.credentials, body.type)
    await _update(request, principal, [update], True, True, body.command_id)
    async with state.pool.acquire() as conn:
        info = await providers.get_provider(conn, body.name)
    if info is None:  # a retried create of a provider deleted since
        raise ApiError(404, "NOT_FOUND", f"provider {body.name!r} was deleted since it was created")
    return JSONResponse(
        view(info).model_dump(mode="json"), 201, headers={"Location": f"/v1/providers/{body.name}"}
    )


@router.get(
    "/v1/providers",
    response_model=ProviderList,
    responses=responses(401, 403, 422, 503),
    summary="List providers, by name, a page at a time",
    tags=["providers"],
)
async def list_providers(
    principal: ProviderReader,
    state: State,
    limit: Annotated[int, Query(ge=1, le=readmodel.MAX_PAGE)] = 100,
    page_token: Annotated[str | None, Query(max_length=readmodel.PAGE_TOKEN_MAX_LENGTH)] = None,
) -> ProviderList:
    after = name_after("providers", page_token)
    async with state.pool.acquire() as conn:
        found = await providers.list_providers(conn, after=after, limit=limit + 1)
    items, token = name_page("providers", found, limit, lambda i: i.name)
    return ProviderList(items=[view(i) for i in items], next_page_token=token)


@router.get(
    "/v1/providers/{provider}",
    response_model=ProviderView,
    responses=responses(401, 403, 404, 422, 503),
    summary="One provider: key names and fingerprints, never values",
    tags=["providers"],
)
async def get_provider(
    provider: ProviderPath, principal: ProviderReader, state: State
) -> ProviderView:
    async with state.pool.acquire() as conn:
        info = await providers.get_provider(conn, provider)
    if info is None:
        raise ApiError(404, "NOT_FOUND", f"provider {provider!r} not found")
    return view(info)


@router.put(
    "/v1/providers/{provider}/credentials",
    response_model=UpdateReceipt,
    responses=PROVIDER_RESPONSES,
    summary="Replace a provider's credentials; the receipt says what happens to each sandbox",
    tags=["providers"],
)
async def update_credentials(
    provider: ProviderPath,
    body: UpdateCredentialsRequest,
    principal: ProviderWriter,
    request: Request,
) -> UpdateReceipt:
    update = Update(provider, body.credentials)
    receipt = await _update(
        request, principal, [update], not body.no_restart, False, body.command_id
    )
    return receipt_view(receipt)


@router.post(
    "/v1/providers:update",
    response_model=UpdateReceipt,
    responses=PROVIDER_RESPONSES,
    summary="Replace the credentials of several providers at once (a sandbox restarts once)",
    tags=["providers"],
)
async def update_providers(
    body: UpdateProvidersRequest, principal: ProviderWriter, request: Request
) -> UpdateReceipt:
    names = [p.name for p in body.providers]
    if len(set(names)) != len(names):
        raise ApiError(422, "INVALID_ARGUMENT", "providers: a provider is named twice")
    updates = [Update(p.name, p.credentials, p.type) for p in body.providers]
    create = None if body.create_missing else False
    receipt = await _update(
        request, principal, updates, not body.no_restart, create, body.command_id
    )
    return receipt_view(receipt)


@router.delete(
    "/v1/providers/{provider}",
    response_model=DeleteResult,
    responses=responses(401, 403, 404, 409, 412, 422, 503),
    summary="Delete a provider (refused while attached, unless forced: then detached too, "
    "which needs sandbox:write as well)",
    tags=["providers"],
)
async def delete_provider(
    provider: ProviderPath,
    principal: ProviderWriter,
    request: Request,
    force: Annotated[
        bool,
        Query(description="detach it from every sandbox and delete (needs sandbox:write too)"),
    ] = False,
    no_restart: Annotated[
        bool,
        Query(
            description="with force: the Ready sandboxes it is detached from keep running "
            "(its values leave at their next start) instead of restarting without them"
        ),
    ] = False,
    body: Annotated[DeleteProviderRequest | None, Body()] = None,
) -> DeleteResult:
    with refusals():
        deleted = await service(request).delete(
            provider,
            principal=principal,
            force=force,
            restart=not no_restart,
            request_id=body.command_id if body else None,
        )
    return DeleteResult(name=deleted.name, detached=deleted.detached, unsent=deleted.unsent)


async def _attachment(
    kind: type[AttachProvider | DetachProvider],
    name: str,
    body: AttachRequest,
    principal: Principal,
    state: ApiState,
    request: Request,
    wait: float | None,
    restart: bool = True,
) -> JSONResponse:
    with refusals():
        command = await service(request).attachment(
            kind,
            name,
            body.provider,
            principal=principal,
            command_id=body.command_id,
            expected_version=body.expected_version,
            restart=restart,
        )
    return await submit(state.gateway, command, wait)


@router.post(
    "/v1/sandboxes/{name}:attach",
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Attach a provider (needs sandbox:write and provider:write; applies at the next start)",
    tags=["commands"],
)
async def attach_provider(
    name: NamePath,
    body: AttachRequest,
    principal: Writer,
    state: State,
    request: Request,
    wait: WaitQuery = None,
) -> JSONResponse:
    return await _attachment(AttachProvider, name, body, principal, state, request, wait)


@router.post(
    "/v1/sandboxes/{name}:detach",
    response_model=CommandStatus,
    responses=COMMAND_RESPONSES,
    summary="Detach a provider (needs sandbox:write and provider:write; a Ready sandbox "
    "restarts without its values unless no_restart)",
    tags=["commands"],
)
async def detach_provider(
    name: NamePath,
    body: DetachRequest,
    principal: Writer,
    state: State,
    request: Request,
    wait: WaitQuery = None,
) -> JSONResponse:
    return await _attachment(
        DetachProvider, name, body, principal, state, request, wait, not body.no_restart
    )
