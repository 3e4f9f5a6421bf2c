"""OpenShell's method paths (``/openshell.v1.OpenShell/<Method>``) -> the RPCs, with raw bytes in.

The handlers take the request undecoded: its generation is decided per message (wire.py). The
answer is serialized as built (served schema, or a message both generations share). Methods
not listed are UNIMPLEMENTED. A lost database ends a call with UNAVAILABLE, any other failure with
INTERNAL, each with a plain message (the details go to the log), never UNKNOWN with an
exception's text.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import grpc
from google.protobuf.message import Message

from projections.store import CONNECTION_ERRORS
from services.common.exec_sessions import ExecLimits
from services.openshell.exec_rpc import ExecRpcs
from services.openshell.logs import LogRpcs
from services.openshell.providers import PROVIDER_METHODS, ProviderRpcs
from services.openshell.sandbox_providers import SandboxProviderRpcs
from services.openshell.sandboxes import SandboxRpcs
from services.openshell.service import Context, Door
from services.openshell.templates import TEMPLATE_METHODS, TemplateRpcs
from services.openshell.watch import WatchRpcs

log = logging.getLogger("sandstream.openshell")

SERVICE: Final = "openshell.v1.OpenShell"
UNARY: Final = (
    "Health",
    "GetGatewayInfo",
    "GetSandboxConfig",
    "CreateSandbox",
    "GetSandbox",
    "ListSandboxes",
    "StopSandbox",
    "StartSandbox",
    "DeleteSandbox",
    "GetSandboxLogs",
    *PROVIDER_METHODS,
    *TEMPLATE_METHODS,
)
STREAMING: Final = ("ExecSandbox", "WatchSandbox")
UNAVAILABLE_MESSAGE: Final = "the gateway's database is unavailable; retry"


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def _fail(method: str, exc: Exception, context: Context) -> None:
    """UNAVAILABLE for a lost backend, INTERNAL for anything else; the details are logged."""
    if isinstance(exc, CONNECTION_ERRORS):
        log.warning("OpenShell %s: backend unavailable: %r", method, exc)
        await context.abort(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_MESSAGE)
    log.exception("OpenShell %s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method} (logged)")


def _unary(method: str, fn: Callable[[bytes, Context], Awaitable[Message]]) -> Any:
    @functools.wraps(fn)
    async def call(raw: bytes, context: Context) -> Message:
        try:
            return await fn(raw, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _fail(method, exc, context)
            raise AssertionError("unreachable: abort raises") from None

    return grpc.unary_unary_rpc_method_handler(call, response_serializer=_serialize)


def _streaming(method: str, fn: Callable[[bytes, Context], AsyncIterator[Message]]) -> Any:
    @functools.wraps(fn)
    async def call(raw: bytes, context: Context) -> AsyncIterator[Message]:
        try:
            async for message in fn(raw, context):
                yield message
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _fail(method, exc, context)

    return grpc.unary_stream_rpc_method_handler(call, response_serializer=_serialize)


class OpenShellService:
    """Every RPC, one object per resource over one shared Door."""

    def __init__(self, door: Door, limits: ExecLimits) -> None:
        self.door = door
        self.parts: tuple[object, ...] = (
            SandboxRpcs(door),
            ExecRpcs(door, limits),
            WatchRpcs(door),
            LogRpcs(door),
            ProviderRpcs(door),
            SandboxProviderRpcs(door),
            TemplateRpcs(door),
        )

    def method(self, name: str) -> Any:
        for part in self.parts:
            found = getattr(part, name, None)
            if found is not None:
                return found
        raise AttributeError(name)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        methods = {name: _unary(name, self.method(name)) for name in UNARY}
        methods |= {name: _streaming(name, self.method(name)) for name in STREAMING}
        return grpc.method_handlers_generic_handler(SERVICE, methods)
