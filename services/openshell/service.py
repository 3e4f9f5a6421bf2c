"""The servicer of ``openshell.v1.OpenShell``: a second door into the same house.

Commands are built like the HTTP API builds them (a command id, the token's name as actor,
``occurred_at`` at this edge) and go through the HTTP API's ``CommandGateway`` (the same
publisher) onto the commands topic; the answer waits for the processor's outcome of that
command id. Reads come from the projection,
watches from the change feed that also serves ``/v1/watch``, exec from the driver (inside the
sandbox). Nothing here keeps state of its own.

A client may send its own command id in the metadata ``sandstream-command-id``: a retry with
the same id (after a lost answer) gets the first outcome back and publishes nothing again.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final, NoReturn, TypeAlias

import asyncpg
import grpc

from drivers.protocol import DriverError, ExecDriver, ExecExit
from events.commands import (
    Command,
    CreateSandbox,
    DeleteSandbox,
    StartSandbox,
    StopSandbox,
)
from events.common import COMMAND_ID_PATTERN, SANDBOX_NAME_PATTERN, Phase
from events.outcomes import Code, CommandOutcome
from events.publisher import new_command_id, now
from projections.store import SANDBOX_COLUMNS
from services.api import readmodel
from services.api.gateway import CommandGateway, PublishFailed
from services.api.readmodel import InvalidArgument, SandboxView
from services.common.tokens import READ, WRITE, Denied, Principal, TokenStore
from services.openshell import mapping
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import sandbox_pb2

log = logging.getLogger("sandstream.openshell")

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"
Context: TypeAlias = grpc.aio.ServicerContext[object, object]

COMMAND_ID_KEY: Final = "sandstream-command-id"
LOCAL_PRINCIPAL: Final = Principal("openshell-local", frozenset({READ, WRITE}))
OUTCOME_WAIT: Final = 30.0  # seconds an RPC waits for the processor to decide its command
_COMMAND_ID = re.compile(COMMAND_ID_PATTERN)

STATUS_OF: Final[dict[Code, grpc.StatusCode]] = {
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Code.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.ABORTED: grpc.StatusCode.ABORTED,
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
}


def version() -> str:
    try:
        return importlib.metadata.version("sandstream")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True, slots=True)
class Authenticator:
    """Bearer tokens from the metadata (``authorization: Bearer <token>``), as the HTTP API.

    With ``allow_unauthenticated``, a call without credentials acts as a local admin; a call
    with credentials is always checked.
    """

    tokens: TokenStore
    allow_unauthenticated: bool = False

    def check(
        self, metadata: dict[str, str], scope: str
    ) -> Principal | tuple[grpc.StatusCode, str]:
        header = metadata.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if not header:
            if self.allow_unauthenticated:
                return LOCAL_PRINCIPAL
            return grpc.StatusCode.UNAUTHENTICATED, "missing bearer token (authorization metadata)"
        if scheme.lower() != "bearer" or not value.strip():
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization metadata must be 'Bearer <token>'",
            )
        checked = self.tokens.authorize(value.strip(), scope)
        if isinstance(checked, Denied):
            status = grpc.StatusCode.UNAUTHENTICATED
            if checked.status == 403:
                status = grpc.StatusCode.PERMISSION_DENIED
            return status, checked.message
        return checked


def _metadata(context: Context) -> dict[str, str]:
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            found[key.lower()] = value
    return found


# No index of sandboxes serves sandbox_id: one would cost every processor write. The name of
# an incarnation is found through its history instead (`history_incarnation`), then its row by
# name. The processor writes every row with the history entry of the input that left it, which
# carries its sandbox_id, and an id belongs to one name only (uuid5 of the name). One record:
# `named` null when no entry names the id; the row's columns null when the name's row is
# another incarnation's by now (re-created). The name reaches the row as a parameter (an
# InitPlan), not by a join: a generic plan made on empty tables joined by scanning sandboxes.
BY_ID: Final = (
    "WITH h AS (SELECT key FROM history WHERE sandbox_id = $1 LIMIT 1) "
    f"SELECT (SELECT h.key FROM h) AS named, {SANDBOX_COLUMNS}, change_seq FROM (SELECT) AS one "
    "LEFT JOIN sandboxes s ON s.key = (SELECT h.key FROM h) AND s.sandbox_id = $1"
)
# An id no history entry names: unknown, or its entries were archived or written before
# migration 0041 (sandbox_id null). Only a scan of the rows can tell.
BY_ID_UNNAMED: Final = f"SELECT {SANDBOX_COLUMNS}, change_seq FROM sandboxes WHERE sandbox_id = $1"


async def sandbox_by_id(pool: Pool, sandbox_id: uuid.UUID) -> SandboxView | None:
    """The row of an incarnation (also its tombstone); None once the name moved on."""
    record = await pool.fetchrow(BY_ID, sandbox_id)
    if record is not None and record["named"] is None:
        record = await pool.fetchrow(BY_ID_UNNAMED, sandbox_id)
    found = record is not None and record["key"] is not None
    return readmodel.sandbox_view(record) if found else None


class OpenShellService:
    """The RPCs; registered with ``add_OpenShellServicer_to_server``."""

    def __init__(
        self,
        *,
        pool: Pool,
        gateway: CommandGateway,
        auth: Authenticator,
        driver: ExecDriver | None,
        driver_name: str,
        default_image: str,
        outcome_wait: float = OUTCOME_WAIT,
    ) -> None:
        self.pool = pool
        self.gateway = gateway
        self.feed = gateway.feed
        self.auth = auth
        self.driver = driver
        self.driver_name = driver_name
        self.default_image = default_image
        self.outcome_wait = outcome_wait

    # -- plumbing ------------------------------------------------------------------------------

    async def _authorize(self, context: Context, scope: str) -> Principal:
        checked = self.auth.check(_metadata(context), scope)
        if isinstance(checked, Principal):
            return checked
        await _abort(context, *checked)

    async def _command_id(self, context: Context) -> str | None:
        given = _metadata(context).get(COMMAND_ID_KEY)
        if given is None:
            return None
        if not _COMMAND_ID.fullmatch(given):
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"metadata {COMMAND_ID_KEY}: must be 1-128 characters from A-Z a-z 0-9 . _ : -",
            )
        return given

    async def _submit(self, command: Command, context: Context) -> CommandOutcome:
        """The command's outcome, through the HTTP API's gateway: the known one for a retried
        command id, else published once and awaited. Rejections end the RPC with their status."""
        try:
            submitted = await self.gateway.submit(command, self.outcome_wait)
        except PublishFailed:
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "Kafka did not acknowledge the command; it may still be applied: retry with "
                f"metadata {COMMAND_ID_KEY}={command.command_id}",
            )
        outcome = submitted.outcome
        if outcome is None:
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"the command was published but not decided within {self.outcome_wait:.0f}s; "
                f"retry with metadata {COMMAND_ID_KEY}={command.command_id}",
            )
        if not outcome.accepted:
            await _abort(context, STATUS_OF[outcome.code], outcome.message)
        return outcome

    async def _lifecycle(
        self,
        kind: type[StartSandbox | StopSandbox | DeleteSandbox],
        name: str,
        workspace: str,
        context: Context,
    ) -> CommandOutcome:
        principal = await self._authorize(context, WRITE)
        await self._check_name(name, workspace, context)
        command = kind(
            type=kind.__name__,
            command_id=await self._command_id(context) or new_command_id(),
            key=name,
            occurred_at=now(),
            actor=principal.name,
        )
        return await self._submit(command, context)

    async def _check_name(self, name: str, workspace: str, context: Context) -> None:
        if workspace not in ("", mapping.DEFAULT_WORKSPACE):
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"workspace {workspace!r} not found")
        if not name:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "name: required")
        if not re.fullmatch(SANDBOX_NAME_PATTERN, name):
            # No sandbox can have such a name.
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"sandbox {name!r} not found")

    async def _current(self, name: str, context: Context) -> pb.SandboxResponse:
        view = await readmodel.get_sandbox(self.pool, name)
        if view is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"sandbox {name!r} not found")
        return pb.SandboxResponse(sandbox=mapping.sandbox_message(view))

    async def _incarnation(self, raw_id: str, context: Context) -> SandboxView:
        try:
            sandbox_id = uuid.UUID(raw_id)
        except ValueError:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"sandbox id {raw_id!r} not found")
        view = await sandbox_by_id(self.pool, sandbox_id)
        if view is None or view.phase is Phase.DELETED:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"sandbox id {raw_id!r} not found")
        return view

    # -- operations ----------------------------------------------------------------------------

    async def Health(self, request: pb.HealthRequest, context: Context) -> pb.HealthResponse:
        return pb.HealthResponse(status=pb.SERVICE_STATUS_HEALTHY, version=version())

    async def GetGatewayInfo(
        self, request: pb.GetGatewayInfoRequest, context: Context
    ) -> pb.GetGatewayInfoResponse:
        await self._authorize(context, READ)
        driver = pb.ComputeDriverInfo(
            name=self.driver_name,
            capabilities=pb.ComputeDriverCapabilities(
                driver_name=self.driver_name, driver_version=version()
            ),
        )
        return pb.GetGatewayInfoResponse(
            status=pb.SERVICE_STATUS_HEALTHY, gateway_version=version(), compute_drivers=[driver]
        )

    async def GetSandboxConfig(
        self, request: sandbox_pb2.GetSandboxConfigRequest, context: Context
    ) -> sandbox_pb2.GetSandboxConfigResponse:
        await self._authorize(context, READ)
        return sandbox_pb2.GetSandboxConfigResponse()  # sandstream has no sandbox policies

    # -- commands ------------------------------------------------------------------------------

    async def CreateSandbox(
        self, request: pb.CreateSandboxRequest, context: Context
    ) -> pb.SandboxResponse:
        principal = await self._authorize(context, WRITE)
        command_id = await self._command_id(context)
        try:
            wanted = mapping.new_sandbox(
                request, default_image=self.default_image, command_id=command_id
            )
        except mapping.InvalidRequest as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        command = CreateSandbox(
            type="CreateSandbox",
            command_id=command_id or new_command_id(),
            key=wanted.name,
            occurred_at=now(),
            actor=principal.name,
            spec=wanted.spec,
            providers=wanted.providers,
        )
        outcome = await self._submit(command, context)
        view = await readmodel.get_sandbox(self.pool, wanted.name)
        if view is None or view.id != outcome.sandbox_id:
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"sandbox {wanted.name!r} was created and is gone already",
            )
        return pb.SandboxResponse(sandbox=mapping.sandbox_message(view))

    async def StopSandbox(
        self, request: pb.StopSandboxRequest, context: Context
    ) -> pb.SandboxResponse:
        await self._lifecycle(StopSandbox, request.name, request.workspace, context)
        return await self._current(request.name, context)

    async def StartSandbox(
        self, request: pb.StartSandboxRequest, context: Context
    ) -> pb.SandboxResponse:
        await self._lifecycle(StartSandbox, request.name, request.workspace, context)
        return await self._current(request.name, context)

    async def DeleteSandbox(
        self, request: pb.DeleteSandboxRequest, context: Context
    ) -> pb.DeleteSandboxResponse:
        await self._lifecycle(DeleteSandbox, request.name, request.workspace, context)
        return pb.DeleteSandboxResponse(deleted=True)

    # -- reads ---------------------------------------------------------------------------------

    async def GetSandbox(
        self, request: pb.GetSandboxRequest, context: Context
    ) -> pb.SandboxResponse:
        await self._authorize(context, READ)
        await self._check_name(request.name, request.workspace, context)
        return await self._current(request.name, context)

    async def ListSandboxes(
        self, request: pb.ListSandboxesRequest, context: Context
    ) -> pb.ListSandboxesResponse:
        await self._authorize(context, READ)
        if request.workspace not in ("", mapping.DEFAULT_WORKSPACE):
            return pb.ListSandboxesResponse()
        try:
            labels = mapping.label_filters(request.label_selector)
            items: list[pb.Sandbox] = []
            token: str | None = None
            wanted = request.offset + request.limit if request.limit else None
            while True:
                found = await readmodel.list_sandboxes(
                    self.pool, labels=labels, limit=readmodel.MAX_PAGE, page_token=token
                )
                items += [mapping.sandbox_message(v) for v in found.items]
                token = found.next_page_token
                if token is None or (wanted is not None and len(items) >= wanted):
                    break
        except (mapping.InvalidRequest, InvalidArgument) as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ListSandboxesResponse(
            sandboxes=mapping.page(items, request.limit, request.offset)
        )

    async def WatchSandbox(
        self, request: pb.WatchSandboxRequest, context: Context
    ) -> AsyncIterator[pb.SandboxStreamEvent]:
        """Snapshots of one incarnation: the current one, then one per change of its row.

        Ends after the tombstone (sent as DELETING), when the name is re-created (another
        incarnation), or with ``stop_on_terminal`` at READY or ERROR.
        """
        await self._authorize(context, READ)
        view = await self._incarnation(request.id, context)
        terminal = (Phase.READY, Phase.ERROR) if request.stop_on_terminal else ()
        if request.follow_status:
            yield pb.SandboxStreamEvent(sandbox=mapping.sandbox_message(view))
        if view.phase in terminal:
            return
        cursor = view.change_seq
        while not self.feed.closed:
            mark = self.feed.mark()
            horizon = await self.feed.horizon(mark)
            while horizon is not None and horizon > cursor:
                rows = await readmodel.changes_after(self.pool, cursor, horizon, names=[view.name])
                full = len(rows) == readmodel.CHANGES_PAGE
                cursor = rows[-1].change_seq if full else horizon
                for row in rows:
                    if row.id != view.id:
                        return  # the name was re-created: this incarnation is gone
                    if request.follow_status:
                        yield pb.SandboxStreamEvent(sandbox=mapping.sandbox_message(row))
                    if row.phase is Phase.DELETED or row.phase in terminal:
                        return
            await self.feed.wait(mark, self.feed.poll_interval)

    # -- exec ----------------------------------------------------------------------------------

    async def ExecSandbox(
        self, request: pb.ExecSandboxRequest, context: Context
    ) -> AsyncIterator[pb.ExecSandboxEvent]:
        """The command runs in the sandbox through the driver; output chunks, then the exit."""
        await self._authorize(context, WRITE)
        if not request.command:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "command: required")
        if request.stdin:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "stdin: not supported")
        view = await self._incarnation(request.sandbox_id, context)
        if view.phase is not Phase.READY:
            await _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"sandbox {view.name!r} is {view.phase.value}, not Ready",
            )
        if self.driver is None:
            await _abort(context, grpc.StatusCode.UNIMPLEMENTED, "the driver cannot exec")
        stream = self.driver.exec_stream(
            view.name,
            view.generation,
            list(request.command),
            env=dict(request.environment),
            workdir=request.workdir or None,
        )
        try:
            async with asyncio.timeout(request.timeout_seconds or None):
                async for event in stream:
                    if isinstance(event, ExecExit):
                        yield pb.ExecSandboxEvent(
                            exit=pb.ExecSandboxExit(exit_code=event.exit_code)
                        )
                    elif event.stream == "stdout":
                        yield pb.ExecSandboxEvent(stdout=pb.ExecSandboxStdout(data=event.data))
                    else:
                        yield pb.ExecSandboxEvent(stderr=pb.ExecSandboxStderr(data=event.data))
        except TimeoutError:
            await _abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the command ran longer than {request.timeout_seconds}s",
            )
        except DriverError as exc:
            code = (
                grpc.StatusCode.UNAVAILABLE
                if exc.retryable
                else grpc.StatusCode.FAILED_PRECONDITION
            )
            await _abort(context, code, exc.reason)
        finally:
            await stream.aclose()


async def _abort(context: Context, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover
