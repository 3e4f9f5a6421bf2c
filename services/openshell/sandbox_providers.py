"""A sandbox's providers over OpenShell's gRPC: ListSandboxProviders, and Attach and
DetachSandboxProvider as the provider service's AttachProvider / DetachProvider commands
(``sandbox:write`` and ``provider:write``, as over HTTP); ``expected_resource_version`` is the
sandbox's version, ABORTED when it moved on.
"""

from __future__ import annotations

from typing import Any, Final

import grpc

from events.commands import AttachProvider, DetachProvider
from services.api.providers import ScopeMissing
from services.common import providers
from services.common.tokens import PROVIDER_READ, READ, WRITE
from services.openshell import mapping
from services.openshell import provider_messages as messages
from services.openshell.proto import served_pb2
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.provider_door import ProviderCalls, check, sent
from services.openshell.service import Context, abort
from services.openshell.wire import Generation

ATTACHMENTS: Final[dict[type[AttachProvider | DetachProvider], tuple[Any, Any, Any, Any, str]]] = {
    AttachProvider: (
        os_0_0.AttachSandboxProviderRequest,
        os_0_1.AttachSandboxProviderRequest,
        served_pb2.PROVIDER_MUTATION_KIND_ATTACH,
        served_pb2.AttachSandboxProviderResponse,
        "attached",
    ),
    DetachProvider: (
        os_0_0.DetachSandboxProviderRequest,
        os_0_1.DetachSandboxProviderRequest,
        served_pb2.PROVIDER_MUTATION_KIND_DETACH,
        served_pb2.DetachSandboxProviderResponse,
        "detached",
    ),
}


class SandboxProviderRpcs(ProviderCalls):
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
        self, kind: type[AttachProvider | DetachProvider], raw: bytes, context: Context
    ) -> Any:
        """Submit the service's AttachProvider or DetachProvider command; answer with the
        sandbox as it is after, and the command as the receipt."""
        principal = await self.door.authorize(context, WRITE)
        old, new, mutation, answer, flag = ATTACHMENTS[kind]
        decoded = await self._decode(raw, old, new, context)
        request = sent(decoded)
        if decoded.new is not None:
            sandbox, provider, field = request.sandbox, request.provider, "provider"
        else:
            sandbox, provider, field = request.sandbox_name, request.provider_name, "provider_name"
        await self.door.check_name(sandbox, "", context)
        await check(context, "provider", field, provider)
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
        receipt = served_pb2.ProviderMutationReceipt(
            receipt_id=command.command_id,
            mutation_id=command.command_id,
            provider=provider,
            workspace=mapping.DEFAULT_WORKSPACE,
            kind=mutation,
            desired=served_pb2.ProviderDesiredIdentity(sandbox_id=str(view.id), sandbox=sandbox),
            persisted_time=mapping.timestamp(view.updated_at),
        )
        generation = Generation.V0_1 if decoded.new is not None else Generation.V0_0
        return answer(
            sandbox=mapping.sandbox_message(view, generation), receipt=receipt, **{flag: True}
        )

    async def AttachSandboxProvider(
        self, raw: bytes, context: Context
    ) -> served_pb2.AttachSandboxProviderResponse:
        """Applies at the sandbox's next start (an attach restarts nothing)."""
        found: served_pb2.AttachSandboxProviderResponse
        found = await self._attachment(AttachProvider, raw, context)
        return found

    async def DetachSandboxProvider(
        self, raw: bytes, context: Context
    ) -> served_pb2.DetachSandboxProviderResponse:
        """A Ready sandbox restarts without the provider's values."""
        found: served_pb2.DetachSandboxProviderResponse
        found = await self._attachment(DetachProvider, raw, context)
        return found
