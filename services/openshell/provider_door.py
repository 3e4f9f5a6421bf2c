"""What the provider RPCs share: the provider service, its refusals as statuses, decoding a
request of either generation in the one workspace, and a write's caller and request id (the
idempotency key the sandbox commands take: ``request_id`` or the metadata).

The RPCs are ``providers`` (the providers and their refresh) and ``sandbox_providers`` (a
sandbox's providers).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from typing import Any, Final, TypeVar

import grpc
from google.protobuf.message import Message

from events.common import PROVIDER_NAME_PATTERN
from events.publisher import new_command_id
from services.api.idempotency import IdempotencyConflict
from services.api.providers import ProviderInUse, ProviderService, ScopeMissing
from services.api.routes.providers import CREDENTIAL_KEY_PATTERN
from services.common import providers
from services.common.credentials import CredentialKeyError
from services.common.providers import (
    CredentialMissing,
    ProviderExists,
    ProviderInfo,
    ProviderMissing,
)
from services.common.tokens import PROVIDER_WRITE, Principal
from services.openshell import mapping, wire
from services.openshell.service import Context, Door, abort

T = TypeVar("T")

REFUSALS: Final[tuple[tuple[type[Exception], grpc.StatusCode], ...]] = (
    (ScopeMissing, grpc.StatusCode.PERMISSION_DENIED),
    (CredentialKeyError, grpc.StatusCode.UNAVAILABLE),
    (ProviderMissing, grpc.StatusCode.NOT_FOUND),
    (CredentialMissing, grpc.StatusCode.NOT_FOUND),
    (ProviderExists, grpc.StatusCode.ALREADY_EXISTS),
    (ProviderInUse, grpc.StatusCode.FAILED_PRECONDITION),
    (IdempotencyConflict, grpc.StatusCode.ALREADY_EXISTS),  # as for the sandbox commands
)


# Attach and detach: each generation's request, the receipt's kind, the answer and its flag.
def sent(decoded: wire.Decoded[Any, Any]) -> Any:
    """The request as its generation's schema reads it."""
    return decoded.new if decoded.new is not None else decoded.old


def workspace_of(decoded: wire.Decoded[Any, Any]) -> str | None:
    if decoded.new is not None:
        return mapping.selected_workspace(decoded.new.workspace_scope)
    return str(sent(decoded).workspace)


# What the HTTP API answers 422 for, in its words (a name or key outside them is no provider's).
CHECKS: Final[dict[str, tuple[str, str]]] = {
    "provider": (PROVIDER_NAME_PATTERN, "must be 1-128 characters from A-Z a-z 0-9 . _ -"),
    "key": (
        CREDENTIAL_KEY_PATTERN,
        "must be an environment variable name: a letter or '_', then up to 255 letters, "
        "digits or '_'",
    ),
}


async def check(context: Context, kind: str, field: str, value: str) -> None:
    """INVALID_ARGUMENT naming ``field`` when ``value`` is no provider name (``kind``
    "provider") or credential key ("key") the HTTP API accepts; its 422, before anything
    reaches PostgreSQL (which cannot hold a NUL)."""
    pattern, words = CHECKS[kind]
    if not re.fullmatch(pattern, value):
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {words}")


class ProviderCalls:
    """The helpers of the provider RPCs, over the shared Door."""

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

    async def _given_id(self, decoded: wire.Decoded[Any, Any], context: Context) -> str | None:
        """The client's request id, if it gave one."""
        given = getattr(decoded.new, "request_id", "") if decoded.new is not None else ""
        return await self.door.command_id(context, given)

    async def _request_id(self, decoded: wire.Decoded[Any, Any], context: Context) -> str:
        return await self._given_id(decoded, context) or new_command_id()

    async def _write(
        self, raw: bytes, old: type[Message], new: type[Message], context: Context
    ) -> tuple[Principal, wire.Decoded[Any, Any], str | None]:
        """A provider write's caller (``provider:write``), request and the client's request
        id (the write's idempotency key; the mutation id when given)."""
        principal = await self.door.authorize(context, PROVIDER_WRITE)
        decoded = await self._decode(raw, old, new, context)
        return principal, decoded, await self._given_id(decoded, context)

    async def _info(self, name: str, context: Context) -> ProviderInfo:
        async with self.door.pool.acquire() as conn:
            info = await providers.get_provider(conn, name)
        if info is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"provider {name!r} not found")
        return info
