"""The provider RPCs: Create/Get/List/Update/DeleteProvider, a sandbox's List/Attach/Detach,
RotateProviderCredential and ConfigureProviderRefresh.

Every write goes through the provider service the HTTP routes call (services/api/providers.py):
the same scopes (``provider:read`` / ``provider:write``; attach and detach also
``sandbox:write``), the same receipts, outbox and restarts. Attach and detach are commands
like the HTTP API's; ``expected_resource_version`` is the sandbox's version (ABORTED when it
moved). An update's credentials replace the provider's whole set (as ``PUT
/v1/providers/{name}/credentials``); an update without credentials leaves them as they are.
sandstream mints no credentials: every credential is static, so a refresh strategy other
than STATIC is FAILED_PRECONDITION, and rotating a credential restarts the attached sandboxes
on its stored value.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Final, TypeVar

import grpc
from google.protobuf.message import Message

from events.commands import AttachProvider, DetachProvider
from events.publisher import new_command_id, now
from services.api.providers import ProviderInUse, ProviderService, ScopeMissing
from services.common import providers
from services.common.credentials import CredentialKeyError
from services.common.providers import (
    CredentialMissing,
    ProviderExists,
    ProviderInfo,
    ProviderMissing,
    Update,
)
from services.common.tokens import PROVIDER_READ, PROVIDER_WRITE, READ, WRITE
from services.openshell import mapping, wire
from services.openshell import provider_messages as messages
from services.openshell.proto import served_pb2
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.service import Context, Door, abort
from services.openshell.wire import Generation

T = TypeVar("T")

PROVIDER_METHODS: Final = (
    "CreateProvider",
    "GetProvider",
    "ListProviders",
    "UpdateProvider",
    "DeleteProvider",
    "ListSandboxProviders",
    "AttachSandboxProvider",
    "DetachSandboxProvider",
    "RotateProviderCredential",
    "ConfigureProviderRefresh",
)

REFUSALS: Final[tuple[tuple[type[Exception], grpc.StatusCode], ...]] = (
    (ScopeMissing, grpc.StatusCode.PERMISSION_DENIED),
    (CredentialKeyError, grpc.StatusCode.UNAVAILABLE),
    (ProviderMissing, grpc.StatusCode.NOT_FOUND),
    (CredentialMissing, grpc.StatusCode.NOT_FOUND),
    (ProviderExists, grpc.StatusCode.ALREADY_EXISTS),
    (ProviderInUse, grpc.StatusCode.FAILED_PRECONDITION),
)


def sent(decoded: wire.Decoded[Any, Any]) -> Any:
    """The request as its generation's schema reads it."""
    return decoded.new if decoded.new is not None else decoded.old


def workspace_of(decoded: wire.Decoded[Any, Any]) -> str | None:
    if decoded.new is not None:
        return mapping.selected_workspace(decoded.new.workspace_scope)
    return str(sent(decoded).workspace)


class ProviderRpcs:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def _service(self, context: Context) -> ProviderService:
        if self.door.providers is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "this gateway has no providers")
        return self.door.providers

    async def _refused(self, call: Awaitable[T], context: Context) -> T:
        """The call's result; the provider service's refusals as statuses."""
        try:
            return await call
        except tuple(kind for kind, _ in REFUSALS) as exc:
            status = next(s for kind, s in REFUSALS if isinstance(exc, kind))
            await abort(context, status, str(exc))

    async def _decode(
        self, raw: bytes, old: type[Message], new: type[Message], context: Context
    ) -> wire.Decoded[Any, Any]:
        """The request, in the default workspace (NOT_FOUND for another)."""
        try:
            decoded = wire.decode(raw, old, new)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        workspace = workspace_of(decoded)
        if workspace not in ("", mapping.DEFAULT_WORKSPACE):
            shown = "all workspaces" if workspace is None else repr(workspace)
            await abort(context, grpc.StatusCode.NOT_FOUND, f"workspace {shown} not found")
        return decoded

    async def _request_id(self, decoded: wire.Decoded[Any, Any], context: Context) -> str:
        given = getattr(decoded.new, "request_id", "") if decoded.new is not None else ""
        return await self.door.command_id(context, given) or new_command_id()

    async def _info(self, name: str, context: Context) -> ProviderInfo:
        async with self.door.pool.acquire() as conn:
            info = await providers.get_provider(conn, name)
        if info is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"provider {name!r} not found")
        return info

    # -- providers -----------------------------------------------------------------------------

    async def CreateProvider(self, raw: bytes, context: Context) -> served_pb2.ProviderResponse:
        """A provider with its first values (a baseline: nothing restarts)."""
        principal = await self.door.authorize(context, PROVIDER_WRITE)
        decoded = await self._decode(
            raw, os_0_0.CreateProviderRequest, os_0_1.CreateProviderRequest, context
        )
        request = sent(decoded)
        mutation_id = await self._request_id(decoded, context)
        try:
            wanted = messages.provider_input(request.provider)
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        service = await self._service(context)
        update = Update(wanted.name, wanted.credentials, wanted.type)
        await self._refused(service.update([update], actor=principal.name, create=True), context)
        info = await self._info(wanted.name, context)
        return served_pb2.ProviderResponse(
            provider=messages.provider_message(info), mutation_id=mutation_id
        )

    async def GetProvider(self, raw: bytes, context: Context) -> served_pb2.ProviderResponse:
        await self.door.authorize(context, PROVIDER_READ)
        decoded = await self._decode(
            raw, os_0_0.GetProviderRequest, os_0_1.GetProviderRequest, context
        )
        info = await self._info(sent(decoded).name, context)
        return served_pb2.ProviderResponse(provider=messages.provider_message(info))

    async def ListProviders(self, raw: bytes, context: Context) -> served_pb2.ListProvidersResponse:
        """A page by name: ``page_size``/``page_token`` (0.1) or ``limit``/``offset`` (0.0).
        Providers have no labels: a label selector matches none."""
        await self.door.authorize(context, PROVIDER_READ)
        try:
            decoded = wire.decode(raw, os_0_0.ListProvidersRequest, os_0_1.ListProvidersRequest)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if decoded.new is not None:
            n = decoded.new
            workspace, selector = mapping.selected_workspace(n.workspace_scope), n.label_selector
            size, token, skip = n.page_size, n.page_token, 0
        else:
            o = decoded.old
            assert o is not None
            workspace, selector = (None if o.all_workspaces else o.workspace), ""
            size, token, skip = o.limit, "", o.offset
        if workspace not in (None, "", mapping.DEFAULT_WORKSPACE):
            return served_pb2.ListProvidersResponse()
        async with self.door.pool.acquire() as conn:
            found = await providers.list_providers(conn)
        try:
            if mapping.label_filters(selector):
                found = []
            chosen = messages.page(found, size=size, token=token, skip=skip)
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return served_pb2.ListProvidersResponse(
            providers=[messages.provider_message(i) for i in chosen.items],
            next_page_token=chosen.next_page_token,
        )

    async def UpdateProvider(self, raw: bytes, context: Context) -> served_pb2.ProviderResponse:
        """New values for the provider (its whole set of keys); ``target_receipts``: what the
        update does to each attached live sandbox (a restart, or why not)."""
        principal = await self.door.authorize(context, PROVIDER_WRITE)
        decoded = await self._decode(
            raw, os_0_0.UpdateProviderRequest, os_0_1.UpdateProviderRequest, context
        )
        request = sent(decoded)
        mutation_id = await self._request_id(decoded, context)
        given = {d.name for d, _ in request.ListFields()}
        expirations = ("credential_expires_at_ms", "credential_expiration_times",
                       "clear_credential_expiration_keys")  # fmt: skip
        try:
            unkept = [f for f in expirations if f in given]
            wanted = messages.provider_input(request.provider, unkept_in_request=unkept)
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        receipts: list[served_pb2.ProviderMutationReceipt] = []
        if wanted.credentials:
            service = await self._service(context)
            update = Update(wanted.name, wanted.credentials)
            receipt = await self._refused(
                service.update([update], actor=principal.name, create=False), context
            )
            receipts = messages.target_receipts(receipt, mutation_id, now())
        info = await self._info(wanted.name, context)
        return served_pb2.ProviderResponse(
            provider=messages.provider_message(info),
            target_receipts=receipts,
            mutation_id=mutation_id,
        )

    async def DeleteProvider(
        self, raw: bytes, context: Context
    ) -> served_pb2.DeleteProviderResponse:
        """Refused (FAILED_PRECONDITION) while sandboxes have it attached: detach it first."""
        principal = await self.door.authorize(context, PROVIDER_WRITE)
        decoded = await self._decode(
            raw, os_0_0.DeleteProviderRequest, os_0_1.DeleteProviderRequest, context
        )
        await self._request_id(decoded, context)
        name = sent(decoded).name
        allow_missing = decoded.new is not None and decoded.new.allow_missing
        service = await self._service(context)

        async def delete() -> bool:
            try:
                await service.delete(name, principal=principal)
            except ProviderMissing:
                if not allow_missing:
                    raise
                return False
            return True

        if not await self._refused(delete(), context):
            return served_pb2.DeleteProviderResponse(
                outcome=served_pb2.DELETION_OUTCOME_ALREADY_ABSENT
            )
        return served_pb2.DeleteProviderResponse(
            deleted=True, outcome=served_pb2.DELETION_OUTCOME_COMPLETED
        )

    # -- a sandbox's providers -----------------------------------------------------------------

    async def ListSandboxProviders(
        self, raw: bytes, context: Context
    ) -> served_pb2.ListSandboxProvidersResponse:
        principal = await self.door.authorize(context, READ)
        if PROVIDER_READ not in principal.scopes:
            refused = ScopeMissing(principal, PROVIDER_READ, "to list a sandbox's providers")
            await abort(context, grpc.StatusCode.PERMISSION_DENIED, str(refused))
        decoded = await self._decode(
            raw, os_0_0.ListSandboxProvidersRequest, os_0_1.ListSandboxProvidersRequest, context
        )
        if decoded.new is not None:
            name, size, token = decoded.new.sandbox, decoded.new.page_size, decoded.new.page_token
        else:
            name, size, token = sent(decoded).sandbox_name, 0, ""
        await self.door.check_name(name, "", context)
        view = await self.door.row(name, context)
        async with self.door.pool.acquire() as conn:
            found = await providers.list_providers(conn, view.providers)
        try:
            chosen = messages.page(found, size=size, token=token)
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return served_pb2.ListSandboxProvidersResponse(
            providers=[messages.provider_message(i) for i in chosen.items],
            next_page_token=chosen.next_page_token,
        )

    async def _attachment(
        self,
        kind: type[AttachProvider | DetachProvider],
        decoded: wire.Decoded[Any, Any],
        context: Context,
    ) -> tuple[served_pb2.Sandbox, served_pb2.ProviderMutationReceipt]:
        """Submit the service's AttachProvider or DetachProvider command; the sandbox as it
        is after, and the command as the receipt."""
        principal = await self.door.authorize(context, WRITE)
        if decoded.new is not None:
            sandbox, provider = decoded.new.sandbox, decoded.new.provider
        else:
            sandbox, provider = sent(decoded).sandbox_name, sent(decoded).provider_name
        request = sent(decoded)
        await self.door.check_name(sandbox, "", context)
        command_id = await self._request_id(decoded, context)
        service = await self._service(context)
        command = await self._refused(
            service.attachment(
                kind,
                sandbox,
                provider,
                principal=principal,
                command_id=command_id,
                expected_version=request.expected_resource_version or None,
            ),
            context,
        )
        await self.door.submit(command, context)
        view = await self.door.row(sandbox, context)
        attach = kind is AttachProvider
        receipt = served_pb2.ProviderMutationReceipt(
            receipt_id=command.command_id,
            mutation_id=command.command_id,
            provider=provider,
            workspace=mapping.DEFAULT_WORKSPACE,
            kind=served_pb2.PROVIDER_MUTATION_KIND_ATTACH
            if attach
            else served_pb2.PROVIDER_MUTATION_KIND_DETACH,
            desired=served_pb2.ProviderDesiredIdentity(sandbox_id=str(view.id), sandbox=sandbox),
            persisted_time=mapping.timestamp(view.updated_at),
        )
        generation = Generation.V0_1 if decoded.new is not None else Generation.V0_0
        return mapping.sandbox_message(view, generation), receipt

    async def AttachSandboxProvider(
        self, raw: bytes, context: Context
    ) -> served_pb2.AttachSandboxProviderResponse:
        """Applies at the sandbox's next start (an attach restarts nothing)."""
        decoded = await self._decode(
            raw, os_0_0.AttachSandboxProviderRequest, os_0_1.AttachSandboxProviderRequest, context
        )
        sandbox, receipt = await self._attachment(AttachProvider, decoded, context)
        return served_pb2.AttachSandboxProviderResponse(
            sandbox=sandbox, attached=True, receipt=receipt
        )

    async def DetachSandboxProvider(
        self, raw: bytes, context: Context
    ) -> served_pb2.DetachSandboxProviderResponse:
        """A Ready sandbox restarts without the provider's values."""
        decoded = await self._decode(
            raw, os_0_0.DetachSandboxProviderRequest, os_0_1.DetachSandboxProviderRequest, context
        )
        sandbox, receipt = await self._attachment(DetachProvider, decoded, context)
        return served_pb2.DetachSandboxProviderResponse(
            sandbox=sandbox, detached=True, receipt=receipt
        )

    # -- refresh -------------------------------------------------------------------------------

    async def RotateProviderCredential(
        self, raw: bytes, context: Context
    ) -> served_pb2.RotateProviderCredentialResponse:
        """A static credential's rotation: every attached sandbox restarts on its stored value,
        as after an update that replaced it (the same receipts and outbox)."""
        principal = await self.door.authorize(context, PROVIDER_WRITE)
        decoded = await self._decode(
            raw,
            os_0_0.RotateProviderCredentialRequest,
            os_0_1.RotateProviderCredentialRequest,
            context,
        )
        await self._request_id(decoded, context)
        request = sent(decoded)
        service = await self._service(context)
        await self._refused(
            service.rotate(request.provider, request.credential_key, actor=principal.name),
            context,
        )
        info = await self._info(request.provider, context)
        status = messages.refresh_status(info, request.credential_key, "rotated", now())
        return served_pb2.RotateProviderCredentialResponse(status=status)

    async def ConfigureProviderRefresh(
        self, raw: bytes, context: Context
    ) -> served_pb2.RotateProviderCredentialResponse:
        """STATIC is what every sandstream credential is (nothing to store); a strategy that
        mints credentials (OAuth2, a cloud's STS, ...) is FAILED_PRECONDITION, named."""
        await self.door.authorize(context, PROVIDER_WRITE)
        decoded = await self._decode(
            raw,
            os_0_0.ConfigureProviderRefreshRequest,
            os_0_1.ConfigureProviderRefreshRequest,
            context,
        )
        await self._request_id(decoded, context)
        request = sent(decoded)
        if request.strategy != messages.STATIC:
            named = messages.strategy_name(request.strategy)
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"strategy {named}: sandstream does not mint or refresh credentials; every "
                "provider credential is STATIC (new values through UpdateProvider, "
                "RotateProviderCredential restarts the attached sandboxes on them)",
            )
        info = await self._info(request.provider, context)
        if request.credential_key not in info.fingerprints():
            missing = CredentialMissing(info.name, request.credential_key)
            await abort(context, grpc.StatusCode.NOT_FOUND, str(missing))
        status = messages.refresh_status(info, request.credential_key, "static", info.updated_at)
        return served_pb2.RotateProviderCredentialResponse(status=status)
