"""Templates: create, list, get (the newest revision or one named), update (a new revision,
only from the newest: ``expected_revision``), delete.

Templates are sandbox specs, so they take the sandbox scopes: reading one needs sandbox:read,
writing one sandbox:write (and provider:write when it names providers, as a create that
attaches them does). A create naming a template is in routes/commands.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from events.common import (
    SANDBOX_NAME_PATTERN,
    ExitPolicy,
    ExpiryPolicy,
    ProviderName,
    SandboxName,
    SandboxSpec,
    TemplateRevision,
    TTLSeconds,
)
from events.publisher import now
from services.api import readmodel
from services.api.deps import Reader, State, Writer, require_also
from services.api.errors import ApiError
from services.api.models import SandboxSpecRequest, responses
from services.api.providers import require_existing
from services.api.readmodel.pages import name_after, name_page
from services.common import pools, templates
from services.common.providers import ProviderMissing
from services.common.settings import Settings
from services.common.suspend import members_suspend_refusal
from services.common.templates import (
    StaleRevision,
    TemplateBody,
    TemplateExists,
    TemplateInfo,
    TemplateMissing,
)
from services.common.tokens import PROVIDER_WRITE, Principal, stop_timeout_refusal

router = APIRouter()

TemplatePath = Annotated[str, Path(pattern=SANDBOX_NAME_PATTERN, description="the template name")]
Description = Annotated[str, StringConstraints(max_length=1000, pattern=r"^[^\x00]*$")]


class TemplateFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    spec: SandboxSpecRequest
    providers: list[ProviderName] = Field(
        default_factory=list, max_length=64, description="attached to every sandbox made from it"
    )
    ttl_seconds: TTLSeconds | None = Field(
        default=None, description="each sandbox's time to live (a create may set its own)"
    )
    on_expiry: ExpiryPolicy = "stop"
    on_exit: ExitPolicy = "keep"
    description: Description = ""


class CreateTemplateRequest(TemplateFields):
    name: SandboxName = Field(description="the template name: a DNS label")


class UpdateTemplateRequest(TemplateFields):
    expected_revision: TemplateRevision = Field(
        description="the revision this update is based on: 409 ABORTED unless it is the newest"
    )


class TemplateView(BaseModel):
    name: str
    revision: int
    spec: SandboxSpec
    providers: list[str]
    ttl_seconds: int | None
    on_expiry: ExpiryPolicy
    on_exit: ExitPolicy
    description: str
    created_at: datetime
    updated_at: datetime = Field(description="when this revision was written")
    created_by: str
    updated_by: str = Field(description="who wrote this revision")


class TemplateList(BaseModel):
    items: list[TemplateView]
    next_page_token: str | None = Field(
        default=None, description="pass as page_token for the next page; absent on the last page"
    )


class DeletedTemplate(BaseModel):
    name: str
    revision: int = Field(description="the revision it was at (its revisions are kept)")


def view(info: TemplateInfo) -> TemplateView:
    b = info.body
    return TemplateView(
        name=info.name,
        revision=info.revision,
        spec=b.spec,
        providers=b.providers,
        ttl_seconds=b.ttl_seconds,
        on_expiry=b.on_expiry,
        on_exit=b.on_exit,
        description=b.description,
        created_at=info.created_at,
        updated_at=info.updated_at,
        created_by=info.created_by,
        updated_by=info.updated_by,
    )


@contextmanager
def refusals() -> Iterator[None]:
    """The template store's refusals as the API's answers."""
    try:
        yield
    except TemplateMissing as exc:
        raise ApiError(404, "NOT_FOUND", str(exc)) from exc
    except TemplateExists as exc:
        raise ApiError(409, "ALREADY_EXISTS", str(exc)) from exc
    except StaleRevision as exc:
        raise ApiError(409, "ABORTED", str(exc)) from exc
    except ProviderMissing as exc:
        raise ApiError(404, "NOT_FOUND", f"field 'providers': {exc}") from exc


async def _body(fields: TemplateFields, principal: Principal, state: State) -> TemplateBody:
    asked, cap = fields.spec.stop_timeout_seconds, state.settings.api_max_stop_timeout_seconds
    if (why := stop_timeout_refusal(principal, cap, asked)) is not None:  # as a create's
        raise ApiError(422, "INVALID_ARGUMENT", f"field 'spec.stop_timeout_seconds': {why}")
    if fields.providers:  # every sandbox made from it gets their values
        require_also(principal, PROVIDER_WRITE, "to name providers in a template")
        await require_existing(state.pool, fields.providers)
    return TemplateBody(
        spec=SandboxSpec.model_validate(fields.spec.model_dump()),
        providers=sorted(set(fields.providers)),
        ttl_seconds=fields.ttl_seconds,
        on_expiry=fields.on_expiry,
        on_exit=fields.on_exit,
        description=fields.description,
    )


async def _refuse_unsuspendable_pools(
    conn: Any, name: str, body: TemplateBody, settings: Settings
) -> None:
    """A 422 naming the idle timeout when a warm pool keeps members of template ``name`` that
    cannot be suspended here: every claim from it would be refused (routes/pools.py refuses
    such a pool when it is written). Call it in the transaction that writes the template,
    with its row locked: a pool written meanwhile waits for the template (its check reads the
    revision written here)."""
    idle = body.spec.idle_suspend_seconds
    if idle is None:
        return
    for pool in await pools.pools_of_template(conn, name):
        if (why := members_suspend_refusal(settings, pool.name)) is not None:
            raise ApiError(
                422,
                "INVALID_ARGUMENT",
                f"field 'spec.idle_suspend_seconds': template {name!r} keeps warm pool "
                f"{pool.name!r}, whose members cannot be suspended here: {why} (every claim "
                "from the pool would be refused); clear the timeout, or point the pool at "
                "another template first",
            )


@router.post(
    "/v1/templates",
    status_code=201,
    response_model=TemplateView,
    responses=responses(401, 403, 404, 409, 413, 422, 503),
    summary="Create a template (revision 1, or the next after a deleted one of the name)",
    tags=["templates"],
)
async def create_template(
    body: CreateTemplateRequest, principal: Writer, state: State
) -> JSONResponse:
    with refusals():
        stored = await _body(body, principal, state)
        async with state.pool.acquire() as conn, conn.transaction():
            # A pool may name a template deleted since: its claims follow this one.
            await _refuse_unsuspendable_pools(conn, body.name, stored, state.settings)
            info = await templates.create_template(conn, body.name, stored, principal.name, now())
    return JSONResponse(
        view(info).model_dump(mode="json"), 201, headers={"Location": f"/v1/templates/{info.name}"}
    )


@router.get(
    "/v1/templates",
    response_model=TemplateList,
    responses=responses(401, 403, 422, 503),
    summary="List templates (each at its newest revision), by name, a page at a time",
    tags=["templates"],
)
async def list_templates(
    principal: Reader,
    state: State,
    limit: Annotated[int, Query(ge=1, le=readmodel.MAX_PAGE)] = 100,
    page_token: Annotated[str | None, Query(max_length=readmodel.PAGE_TOKEN_MAX_LENGTH)] = None,
) -> TemplateList:
    after = name_after("templates", page_token)
    async with state.pool.acquire() as conn:
        found = await templates.list_templates(conn, after=after, limit=limit + 1)
    items, token = name_page("templates", found, limit, lambda i: i.name)
    return TemplateList(items=[view(i) for i in items], next_page_token=token)


@router.get(
    "/v1/templates/{template}",
    response_model=TemplateView,
    responses=responses(401, 403, 404, 422, 503),
    summary="One template: its newest revision, or the one asked for (kept after the "
    "template is deleted)",
    tags=["templates"],
)
async def get_template(
    template: TemplatePath,
    principal: Reader,
    state: State,
    revision: Annotated[
        TemplateRevision | None, Query(description="this revision (kept after later ones)")
    ] = None,
) -> TemplateView:
    async with state.pool.acquire() as conn:
        info = await templates.get_template(conn, template, revision, deleted=True)
    if info is None:
        raise ApiError(404, "NOT_FOUND", str(TemplateMissing(template, revision)))
    return view(info)


@router.put(
    "/v1/templates/{template}",
    response_model=TemplateView,
    responses=responses(401, 403, 404, 409, 413, 422, 503),
    summary="Replace a template: a new revision, only from the newest (expected_revision); "
    "sandboxes made from earlier revisions keep their spec",
    tags=["templates"],
)
async def update_template(
    template: TemplatePath, body: UpdateTemplateRequest, principal: Writer, state: State
) -> TemplateView:
    with refusals():
        stored = await _body(body, principal, state)
        async with state.pool.acquire() as conn, conn.transaction():
            newest = await conn.fetchval(
                "SELECT revision FROM templates WHERE name = $1 FOR UPDATE", template
            )
            if newest == body.expected_revision:  # else the store's 404 or 409 answers
                await _refuse_unsuspendable_pools(conn, template, stored, state.settings)
            info = await templates.update_template(
                conn, template, stored, body.expected_revision, principal.name, now()
            )
    return view(info)


@router.delete(
    "/v1/templates/{template}",
    response_model=DeletedTemplate,
    responses=responses(401, 403, 404, 409, 422, 503),
    summary="Delete a template (sandboxes made from it are left alone; its revisions are kept)",
    tags=["templates"],
)
async def delete_template(
    template: TemplatePath,
    principal: Writer,
    state: State,
    expected_revision: Annotated[
        TemplateRevision | None, Query(description="409 ABORTED unless it is the newest")
    ] = None,
) -> DeletedTemplate:
    with refusals():
        async with state.pool.acquire() as conn:
            revision = await templates.delete_template(conn, template, expected_revision)
    return DeletedTemplate(name=template, revision=revision)
