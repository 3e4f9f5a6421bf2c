"""The sandbox RPCs: Health, gateway info, create, get, list, stop, start, delete.

Each request is parsed with the schema of the generation that wrote it (``wire.decode``) and
answered in the served schema, which both generations read (``proto/served.proto``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import grpc
from google.protobuf.message import Message

from events.commands import CreateSandbox, DeleteSandbox, StartSandbox, StopSandbox
from events.common import SANDBOX_NAME_PATTERN
from events.outcomes import Code
from events.publisher import new_command_id, now
from services.api import pool_claims, readmodel
from services.api.providers import require_existing
from services.api.readmodel import ClaimOutcome, InvalidArgument
from services.common import templates
from services.common.providers import ProviderMissing
from services.common.tokens import PROVIDER_WRITE, READ, WRITE, Principal, stop_timeout_refusal
from services.openshell import mapping, wire
from services.openshell.proto import openshell_pb2 as pinned
from services.openshell.proto import sandbox_pb2, served_pb2
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.service import STATUS_OF, Context, Door, abort, version
from services.openshell.wire import Generation

DEFAULT_PAGE = 100  # sandboxes per answer when a 0.1 client asks for no page size
MAX_OFFSET = 10_000  # the deepest a 0.0 client's offset may reach (each answer reads it all)


@dataclass(frozen=True, slots=True)
class Target:
    """A request naming one sandbox, in either generation's words."""

    name: str
    workspace: str | None  # None: all workspaces
    generation: Generation
    request_id: str = ""
    allow_missing: bool = False


def target(raw: bytes, old: type[Message], new: type[Message]) -> Target:
    """Get, Stop, Start and Delete requests: a name, a workspace (and in 0.1 maybe a request
    id and allow_missing), in fields both generations' messages name alike."""
    decoded = wire.decode(raw, old, new)
    m: Any
    if decoded.new is not None:
        m = decoded.new
        return Target(
            m.name,
            mapping.selected_workspace(m.workspace_scope),
            Generation.V0_1,
            getattr(m, "request_id", ""),
            getattr(m, "allow_missing", False),
        )
    m = decoded.old
    return Target(m.name, m.workspace, Generation.V0_0)


# The overrides resolve() names, as a 0.1 CreateSandbox request gives them.
_OVERRIDES_HERE: Final = {
    "overrides.env": "spec.environment",
    "overrides.labels": "labels",
    "overrides.command": "spec.command",
}


def overrides_of(request: os_0_1.CreateSandboxRequest) -> templates.Overrides:
    """What a 0.1 create naming ``workload_template`` changes of the template."""
    spec = request.spec
    return templates.Overrides(
        env=dict(spec.environment),
        labels=dict(request.labels),
        providers=mapping.checked_providers(spec.providers),
        command=list(spec.command) or None,
    )


async def from_template(
    pool: Any, request: os_0_1.CreateSandboxRequest, command_id: str | None
) -> mapping.NewSandbox:
    """A 0.1 create naming ``workload_template``: the template gives the workload (image,
    environment, resources, labels) and the rest of a sandbox; the request's own labels and
    environment are added (a template's label not changed), its providers added, its command
    replaces the template's. A workload in the request's spec is INVALID_ARGUMENT."""
    if not re.fullmatch(SANDBOX_NAME_PATTERN, request.workload_template):
        raise mapping.InvalidRequest("workload_template: not a template name (a DNS label)")
    spec = request.spec
    own = ("environment", "providers", "command", "log_level", "tty")  # the sandbox's own
    given = [f"spec.{d.name}" for d, _ in spec.ListFields() if d.name not in own]
    given += ["annotations"] if request.annotations else []
    if given:
        raise mapping.InvalidRequest(
            f"{given[0]}: not with workload_template (the template gives it)"
        )
    overrides = overrides_of(request)
    name, template = mapping.sandbox_name(request.name, command_id), request.workload_template
    try:
        async with pool.acquire() as conn:
            decided = None  # a retry resolves to the revision its first was decided with
            if command_id is not None:
                decided = await templates.revision_decided(conn, name, command_id, template)
            made = await templates.resolve(
                conn, template, overrides, decided, deleted=decided is not None
            )
    except templates.OverrideRefused as exc:  # named as this request names it
        field = exc.field
        for ours, theirs in _OVERRIDES_HERE.items():
            if field == ours or field.startswith(f"{ours}."):
                field = theirs + field.removeprefix(ours)
        raise mapping.InvalidRequest(f"{field}: {exc.message}") from None
    return mapping.NewSandbox(
        name, made.spec, made.providers, made.ttl_seconds, made.on_expiry, made.on_exit, made.ref
    )


async def claim_of(
    door: Door, principal: Principal, request: os_0_1.CreateSandboxRequest, command: CreateSandbox
) -> pool_claims.Claim | None:
    """A create naming a pooled ``workload_template`` tried as a claim (the HTTP door's path,
    the request id its claim id); None for any other create."""
    if command.template is None:
        return None
    caller = pool_claims.Caller(
        principal, door.max_stop_timeout, door.default_ttl, door.unsuspendable(command.key)
    )
    return await pool_claims.claim_first(
        door.gateway,
        command,
        caller,
        overrides_of(request),
        cold_because=(
            "a per-claim spec.command needs a cold start (the member runs the template's)"
            if request.spec.command
            else None
        ),
        driver=door.driver,
    )


def claim_condition(claim: ClaimOutcome, at: datetime) -> served_pb2.SandboxCondition:
    """The claim's outcome in the one place a Sandbox message has for it: a condition of the
    create's answer (``PoolClaim``: True warm, False cold; the reason in its message)."""
    where = f"pool {claim.pool!r}: "
    return served_pb2.SandboxCondition(
        type="PoolClaim",
        status="True" if claim.warm else "False",
        reason="Warm" if claim.warm else "Cold",
        message=where + (claim.reason if claim.warm else f"created cold: {claim.reason}"),
        last_transition_time=at.isoformat(),
        transition_time=mapping.timestamp(at),
    )


class SandboxRpcs:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def _decode(self, raw: bytes, old: type, new: type, context: Context) -> Target:
        try:
            return target(raw, old, new)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _answer(
        self, name: str, generation: Generation, context: Context
    ) -> served_pb2.SandboxResponse:
        view = await self.door.row(name, context)
        return served_pb2.SandboxResponse(sandbox=mapping.sandbox_message(view, generation))

    # -- the gateway ---------------------------------------------------------------------------

    async def Health(self, raw: bytes, context: Context) -> pinned.HealthResponse:
        return pinned.HealthResponse(status=pinned.SERVICE_STATUS_HEALTHY, version=version())

    async def GetGatewayInfo(self, raw: bytes, context: Context) -> pinned.GetGatewayInfoResponse:
        await self.door.authorize(context, READ)
        name = self.door.driver_name
        driver = pinned.ComputeDriverInfo(
            name=name,
            capabilities=pinned.ComputeDriverCapabilities(
                driver_name=name, driver_version=version()
            ),
        )
        return pinned.GetGatewayInfoResponse(
            status=pinned.SERVICE_STATUS_HEALTHY,
            gateway_version=version(),
            compute_drivers=[driver],
        )

    async def GetSandboxConfig(
        self, raw: bytes, context: Context
    ) -> sandbox_pb2.GetSandboxConfigResponse:
        await self.door.authorize(context, READ)
        return sandbox_pb2.GetSandboxConfigResponse()  # sandstream has no sandbox policies

    # -- commands ------------------------------------------------------------------------------

    async def CreateSandbox(self, raw: bytes, context: Context) -> served_pb2.SandboxResponse:
        principal = await self.door.authorize(context, WRITE)
        try:
            decoded = wire.decode(raw, os_0_0.CreateSandboxRequest, os_0_1.CreateSandboxRequest)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request: mapping.CreateRequest
        if decoded.new is not None:
            request, request_id = decoded.new, decoded.new.request_id
            workspace = mapping.selected_workspace(decoded.new.workspace_scope)
            if decoded.new.service_exposures:
                await abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "service_exposures: not supported by sandstream",
                )
        else:
            assert decoded.old is not None
            request, request_id, workspace = decoded.old, "", decoded.old.workspace
        command_id = await self.door.command_id(context, request_id)
        try:
            if workspace not in ("", mapping.DEFAULT_WORKSPACE):
                raise mapping.InvalidRequest(
                    f"workspace {workspace!r}: only {mapping.DEFAULT_WORKSPACE!r} exists"
                )
            if decoded.new is not None and decoded.new.workload_template:
                wanted = await from_template(self.door.pool, decoded.new, command_id)
            else:
                wanted = mapping.new_sandbox(
                    request, default_image=self.door.default_image, command_id=command_id
                )
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except templates.TemplateMissing as exc:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"workload_template: {exc}")
        asked = wanted.spec.stop_timeout_seconds  # only a template sets it: the cap holds
        if (why := stop_timeout_refusal(principal, self.door.max_stop_timeout, asked)) is not None:
            where = "workload_template: its stop_timeout_seconds"
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {why}")
        idle = wanted.spec.idle_suspend_seconds  # only a template sets it, as the grace above
        if idle is not None and (why := self.door.unsuspendable(wanted.name)) is not None:
            await abort(  # as over HTTP (routes/commands.py, idle_refusal)
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"workload_template: its idle_suspend_seconds ({idle}) suspends the sandbox, "
                f"and {wanted.name!r} cannot be suspended here: {why}",
            )
        if wanted.providers and PROVIDER_WRITE not in principal.scopes:
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"token {principal.name!r} lacks the scope {PROVIDER_WRITE} "
                "(attaching providers at create needs it, as attaching later does)",
            )
        try:  # as an attach of a missing provider is refused
            await require_existing(self.door.pool, wanted.providers, command_id)
        except ProviderMissing as exc:
            own = list(decoded.new.spec.providers) if decoded.new is not None else []
            if (source := templates.named_by(wanted.template, own, exc.name)) is not None:
                await abort(
                    context, grpc.StatusCode.NOT_FOUND, f"workload_template: {exc} ({source})"
                )
            await abort(context, grpc.StatusCode.NOT_FOUND, f"spec.providers: {exc}")
        command = CreateSandbox(
            type="CreateSandbox",
            command_id=command_id or new_command_id(),
            key=wanted.name,
            occurred_at=now(),
            actor=principal.name,
            spec=wanted.spec,
            providers=wanted.providers,
            ttl_seconds=wanted.ttl_seconds or self.door.default_ttl,  # as over HTTP
            on_expiry=wanted.on_expiry,
            on_exit=wanted.on_exit,
            template=wanted.template,
        )
        claim = None
        if decoded.new is not None:  # a template with a warm pool: a claim first, as over HTTP
            async with self.door.refusals(command, context):  # its adoption is published too
                claim = await claim_of(self.door, principal, decoded.new, command)
        if claim is not None and claim.warm:
            view = await readmodel.get_sandbox(self.door.pool, wanted.name)  # the member's row
            sandbox_id = view.id if view is not None else None
        else:
            sandbox_id = (await self.door.submit(command, context)).sandbox_id
            view = await readmodel.get_sandbox(self.door.pool, wanted.name)
        if claim is not None:
            await pool_claims.count(self.door.gateway.pool, claim, command)
        if view is None or view.id != sandbox_id:
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"sandbox {wanted.name!r} was created and is gone already",
            )
        made = mapping.sandbox_message(view, decoded.generation)
        if claim is not None:
            made.status.conditions.append(claim_condition(claim.outcome, view.updated_at))
        return served_pb2.SandboxResponse(sandbox=made)

    async def _lifecycle(
        self,
        kind: type[StartSandbox | StopSandbox | DeleteSandbox],
        request: Target,
        context: Context,
    ) -> tuple[Code, str]:
        """The command's outcome code and incarnation id (ALREADY_ABSENT's NOT_FOUND passes)."""
        principal = await self.door.authorize(context, WRITE)
        await self.door.check_name(request.name, request.workspace, context)
        command = kind(
            type=kind.__name__,
            command_id=await self.door.command_id(context, request.request_id) or new_command_id(),
            key=request.name,
            occurred_at=now(),
            actor=principal.name,
        )
        outcome = await self.door.submit(command, context, reject=False)
        if not outcome.accepted and not (request.allow_missing and outcome.code is Code.NOT_FOUND):
            await abort(context, STATUS_OF[outcome.code], outcome.message)
        return outcome.code, str(outcome.sandbox_id or "")

    async def StopSandbox(self, raw: bytes, context: Context) -> served_pb2.SandboxResponse:
        request = await self._decode(
            raw, os_0_0.StopSandboxRequest, os_0_1.StopSandboxRequest, context
        )
        await self._lifecycle(StopSandbox, request, context)
        return await self._answer(request.name, request.generation, context)

    async def StartSandbox(self, raw: bytes, context: Context) -> served_pb2.SandboxResponse:
        request = await self._decode(
            raw, os_0_0.StartSandboxRequest, os_0_1.StartSandboxRequest, context
        )
        await self._lifecycle(StartSandbox, request, context)
        return await self._answer(request.name, request.generation, context)

    async def DeleteSandbox(self, raw: bytes, context: Context) -> served_pb2.DeleteSandboxResponse:
        request = await self._decode(
            raw, os_0_0.DeleteSandboxRequest, os_0_1.DeleteSandboxRequest, context
        )
        code, sandbox_id = await self._lifecycle(DeleteSandbox, request, context)
        if code is Code.NOT_FOUND:  # allow_missing
            return served_pb2.DeleteSandboxResponse(
                deleted=False, outcome=served_pb2.DELETION_OUTCOME_ALREADY_ABSENT
            )
        # Accepted: the row is Deleting; the runtime and workspace are removed after this.
        return served_pb2.DeleteSandboxResponse(
            deleted=True, outcome=served_pb2.DELETION_OUTCOME_ACCEPTED, sandbox_id=sandbox_id
        )

    # -- reads ---------------------------------------------------------------------------------

    async def GetSandbox(self, raw: bytes, context: Context) -> served_pb2.SandboxResponse:
        await self.door.authorize(context, READ)
        request = await self._decode(
            raw, os_0_0.GetSandboxRequest, os_0_1.GetSandboxRequest, context
        )
        await self.door.check_name(request.name, request.workspace, context)
        return await self._answer(request.name, request.generation, context)

    async def ListSandboxes(self, raw: bytes, context: Context) -> served_pb2.ListSandboxesResponse:
        """One page, sorted by name: ``page_size`` and ``page_token`` (0.1), or ``limit`` and
        ``offset`` (0.0); without a size, a page of DEFAULT_PAGE with its next_page_token."""
        await self.door.authorize(context, READ)
        try:
            decoded = wire.decode(raw, os_0_0.ListSandboxesRequest, os_0_1.ListSandboxesRequest)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        token: str | None = None
        if decoded.new is not None:
            m = decoded.new
            workspace = mapping.selected_workspace(m.workspace_scope)
            size, skip, token, selector = m.page_size, 0, m.page_token or None, m.label_selector
            if size < 0:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "page_size: negative")
        else:
            assert decoded.old is not None
            o = decoded.old
            workspace = None if o.all_workspaces else o.workspace
            size, skip, selector = o.limit, o.offset, o.label_selector
            if skip > MAX_OFFSET:
                await abort(
                    context, grpc.StatusCode.INVALID_ARGUMENT, f"offset: at most {MAX_OFFSET}"
                )
        if workspace not in (None, "", mapping.DEFAULT_WORKSPACE):
            return served_pb2.ListSandboxesResponse()
        size = min(size or DEFAULT_PAGE, readmodel.MAX_PAGE)
        try:
            labels = mapping.label_filters(selector)
            found = await readmodel.list_sandboxes(
                self.door.pool, labels=labels, limit=size + skip, page_token=token
            )
        except (mapping.InvalidRequest, InvalidArgument) as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        items = found.items[skip:]
        return served_pb2.ListSandboxesResponse(
            sandboxes=[mapping.sandbox_message(v, decoded.generation) for v in items],
            next_page_token=found.next_page_token or "",
        )
