"""The provider RPCs: Create/Get/List/Update/DeleteProvider, RotateProviderCredential and
ConfigureProviderRefresh (a sandbox's providers are in ``sandbox_providers``).

Every write goes through the provider service the HTTP routes call (services/api/providers.py):
the same scopes (``provider:read`` / ``provider:write``), checks, receipts, outbox and
restarts. An update's credentials replace the provider's whole set (as ``PUT
/v1/providers/{name}/credentials``); an update without credentials leaves them as they are.
sandstream mints no credentials: every credential is static, so a refresh strategy other
than STATIC is FAILED_PRECONDITION, and rotating a credential restarts the attached sandboxes
on its stored value.
"""

from __future__ import annotations

from typing import Final

import grpc

from events.publisher import new_command_id, now
from services.common import providers
from services.common.providers import CredentialMissing, ProviderMissing, Update
from services.common.tokens import PROVIDER_READ
from services.openshell import mapping, wire
from services.openshell import provider_messages as messages
from services.openshell.proto import served_pb2
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.provider_door import ProviderCalls, check, sent
from services.openshell.service import Context, abort

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


class ProviderRpcs(ProviderCalls):
    # -- providers -----------------------------------------------------------------------------

    async def CreateProvider(self, raw: bytes, context: Context) -> served_pb2.ProviderResponse:
        """A provider with its first values (a baseline: nothing restarts)."""
        principal, decoded, request_id = await self._write(
            raw, os_0_0.CreateProviderRequest, os_0_1.CreateProviderRequest, context
        )
        mutation_id = request_id or new_command_id()
        request = sent(decoded)
        try:
            wanted = messages.provider_input(request.provider)
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        service = await self._service(context)
        update = Update(wanted.name, wanted.credentials, wanted.type)
        created = service.update([update], actor=principal.name, create=True, request_id=request_id)
        await self._refused(created, context)
        info = await self._info(wanted.name, context)
        return served_pb2.ProviderResponse(
            provider=messages.provider_message(info), mutation_id=mutation_id
        )

    async def GetProvider(self, raw: bytes, context: Context) -> served_pb2.ProviderResponse:
        await self.door.authorize(context, PROVIDER_READ)
        decoded = await self._decode(
            raw, os_0_0.GetProviderRequest, os_0_1.GetProviderRequest, context
        )
        name = sent(decoded).name
        await check(context, "provider", "name", name)
        info = await self._info(name, context)
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
        """New values for the provider (its whole set of keys; none: unchanged); the type is
        fixed at create. ``target_receipts``: what the update does to each attached live
        sandbox (a restart, or why not)."""
        principal, decoded, request_id = await self._write(
            raw, os_0_0.UpdateProviderRequest, os_0_1.UpdateProviderRequest, context
        )
        mutation_id = request_id or new_command_id()
        request = sent(decoded)
        given = {d.name for d, _ in request.ListFields()}
        expirations = ("credential_expires_at_ms", "credential_expiration_times",
                       "clear_credential_expiration_keys")  # fmt: skip
        try:
            unkept = [f for f in expirations if f in given]
            wanted = messages.provider_input(request.provider, unkept_in_request=unkept)
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        before = await self._info(wanted.name, context)
        if wanted.type not in (None, before.type):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"provider.type: {wanted.type!r}: a provider's type is set at create "
                f"(this one is {before.type!r})",
            )
        receipts: list[served_pb2.ProviderMutationReceipt] = []
        if wanted.credentials:
            service = await self._service(context)
            update = Update(wanted.name, wanted.credentials)
            updated = service.update(
                [update], actor=principal.name, create=False, request_id=request_id
            )
            receipt = await self._refused(updated, context)
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
        """Refused (FAILED_PRECONDITION) while sandboxes have it attached (detach it first) or a
        template names it."""
        principal, decoded, request_id = await self._write(
            raw, os_0_0.DeleteProviderRequest, os_0_1.DeleteProviderRequest, context
        )
        name = sent(decoded).name
        await check(context, "provider", "name", name)
        allow_missing = decoded.new is not None and decoded.new.allow_missing
        service = await self._service(context)

        async def delete() -> bool:
            try:
                await service.delete(name, principal=principal, request_id=request_id)
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

    # -- refresh -------------------------------------------------------------------------------

    async def RotateProviderCredential(
        self, raw: bytes, context: Context
    ) -> served_pb2.RotateProviderCredentialResponse:
        """A static credential's rotation: every attached sandbox restarts on its stored value,
        as after an update that replaced it (the same receipts and outbox)."""
        principal, decoded, request_id = await self._write(
            raw, os_0_0.RotateProviderCredentialRequest, os_0_1.RotateProviderCredentialRequest,
            context,
        )  # fmt: skip
        request = sent(decoded)
        await check(context, "provider", "provider", request.provider)
        await check(context, "key", "credential_key", request.credential_key)
        service = await self._service(context)
        await self._refused(
            service.rotate(
                request.provider,
                request.credential_key,
                actor=principal.name,
                request_id=request_id,
            ),
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
        _, decoded, _ = await self._write(
            raw, os_0_0.ConfigureProviderRefreshRequest, os_0_1.ConfigureProviderRefreshRequest,
            context,
        )  # fmt: skip
        request = sent(decoded)
        await check(context, "provider", "provider", request.provider)
        await check(context, "key", "credential_key", request.credential_key)
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
