"""The door's plumbing: authentication, command ids, submitting commands, finding sandboxes.

Commands are built like the HTTP API builds them (a command id, the token's name as actor,
``occurred_at`` at this edge) and go through the HTTP API's ``CommandGateway`` (the same
publisher) onto the commands topic; the answer waits for the processor's outcome of that
command id. Reads come from the projection, watches from the change feed that also serves
``/v1/watch``, exec and logs from the runtime. Nothing here keeps state of its own. The RPCs
live in one module per resource (sandboxes, exec, watch, logs, providers); ``handlers.py``
registers them under OpenShell's method paths.

A command's id is the request's ``request_id`` (OpenShell 0.1), else the metadata
``sandstream-command-id``, else a new one: a retry with the same id (after a lost answer) gets
the first outcome back and publishes nothing again.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, NoReturn, TypeAlias

import asyncpg
import grpc

from drivers.logs import LogSource
from drivers.protocol import ExecDriver
from events.commands import Command
from events.common import COMMAND_ID_PATTERN, SANDBOX_NAME_PATTERN, Phase
from events.outcomes import Code, CommandOutcome
from projections.store import SANDBOX_COLUMNS
from services.api import readmodel
from services.api.gateway import CommandGateway, CommandTooLarge, PublishFailed, PublishForbidden
from services.api.idempotency import IdempotencyConflict
from services.api.providers import ProviderService
from services.api.readmodel import SandboxView
from services.common.settings import Settings
from services.common.tokens import (
    READ,
    WRITE,
    Denied,
    Grant,
    Principal,
    TokenStore,
    grant_of,
    the_header,
)
from services.common.usage import UseRecorder
from services.openshell import mapping

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"
Context: TypeAlias = grpc.aio.ServicerContext[object, object]

COMMAND_ID_KEY: Final = "sandstream-command-id"
LOCAL_NAME: Final = "openshell-local"  # the actor of unauthenticated calls' commands
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


# The most of an error message sent: its start (which names the field) and its end (which
# says what is wrong), an echoed value cut in between. Sent percent-encoded in a trailer, so at
# most about 10 KB: within the 16 KB of metadata a gRPC client takes, however long the input.
DETAILS_HEAD: Final = 600
DETAILS_TAIL: Final = 200


def bounded(message: str) -> str:
    """``message``, or its first DETAILS_HEAD and last DETAILS_TAIL characters around a mark
    saying how many were cut."""
    cut = len(message) - DETAILS_HEAD - DETAILS_TAIL
    if cut <= 0:
        return message
    return f"{message[:DETAILS_HEAD]}…[{cut} characters cut]…{message[-DETAILS_TAIL:]}"


async def abort(context: Context, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, bounded(message))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


@dataclass(frozen=True, slots=True)
class Authenticator:
    """Bearer tokens from the metadata (``authorization: Bearer <token>``), as the HTTP API.

    With ``allow_unauthenticated``, a call without credentials acts as the local principal
    holding ``local_scopes`` (by default sandboxes' reads and commands: not exec, not providers);
    a call with credentials is always checked.
    """

    tokens: TokenStore
    allow_unauthenticated: bool = False
    local_scopes: frozenset[str] = frozenset({READ, WRITE})

    @property
    def local(self) -> Principal:
        return Principal(LOCAL_NAME, self.local_scopes)

    def check(
        self, authorization: Sequence[str], scope: str
    ) -> Principal | tuple[grpc.StatusCode, str]:
        """``authorization``: every value of the metadata key, in order."""
        header = the_header(authorization) or ""
        if isinstance(header, Denied):  # sent twice
            return grpc.StatusCode.UNAUTHENTICATED, header.message
        scheme, _, value = header.partition(" ")
        if not header:
            if self.allow_unauthenticated:
                return self._local(scope)
            return grpc.StatusCode.UNAUTHENTICATED, "missing bearer token (authorization metadata)"
        if scheme.lower() != "bearer" or not value.strip():
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization metadata must be 'Bearer <token>'",
            )
        checked = self.tokens.authorize(value.strip(), scope)
        if isinstance(checked, Denied):
            return status_of(checked), checked.message
        return checked

    def grant(self, authorization: Sequence[str], scope: str) -> Grant:
        """What a long stream that ``check`` let in re-checks (nothing, if it sent no token)."""
        if not the_header(authorization):
            return Grant(self.tokens, None, scope)
        return grant_of(self.tokens, authorization, scope)

    def _local(self, scope: str) -> Principal | tuple[grpc.StatusCode, str]:
        if scope in self.local_scopes:
            return self.local
        granted = ", ".join(sorted(self.local_scopes)) or "no scope"
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"a call without a token holds {granted} here, not {scope}: send a token with "
            "that scope (or add it to SANDSTREAM_OPENSHELL_UNAUTHENTICATED_SCOPES)",
        )


def status_of(denied: Denied) -> grpc.StatusCode:
    if denied.status == 403:
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.UNAUTHENTICATED


def _authorization(context: Context) -> list[str]:
    sent = context.invocation_metadata() or ()
    return [v for k, v in sent if k.lower() == "authorization" and isinstance(v, str)]


def metadata_of(context: Context) -> dict[str, str]:
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
    if record is None or record["key"] is None:
        return None
    if record["bound_to"] is not None:
        # A claimed name's row carries its adopted member's id: the member is the sandbox.
        return await readmodel.get_sandbox(pool, record["bound_to"], include_deleted=True)
    return readmodel.sandbox_view(record)


@dataclass
class Door:
    """What every RPC shares: the read model, the command gateway, the token check, and the
    runtime's capabilities (exec, logs), with the plumbing the RPCs have in common."""

    pool: Pool
    gateway: CommandGateway
    auth: Authenticator
    driver: ExecDriver | None
    logs: LogSource | None
    providers: ProviderService | None
    driver_name: str
    default_image: str
    events_topic: str  # where the decided events go (the outbox rows the watch reads)
    outcome_wait: float = OUTCOME_WAIT
    # The longest grace period a create may ask for, unless its token sets its own.
    max_stop_timeout: int = Settings.model_fields["api_max_stop_timeout_seconds"].default
    # The time to live of a sandbox created without one (settings.default_ttl_seconds).
    default_ttl: int | None = None
    wake_timeout: float = 60.0  # an exec on a Suspended sandbox waits this long for Ready
    # Use of the sandboxes through this door, for idle suspend (the HTTP API's under `up`; one
    # without a pool records nothing).
    use: UseRecorder = field(default_factory=lambda: UseRecorder(None, 10.0))
    # Why a sandbox of a name cannot be suspended here (services/common/suspend.py): a create
    # with an idle timeout is refused then, as over HTTP. By default every one can.
    unsuspendable: Callable[[str], str | None] = lambda _name: None

    async def authorize(self, context: Context, scope: str) -> Principal:
        checked = self.auth.check(_authorization(context), scope)
        if isinstance(checked, Principal):
            return checked
        await abort(context, *checked)

    def grant(self, context: Context, scope: str) -> Grant:
        """The check an authorized stream makes again at every wake (``Grant.lapsed``)."""
        return self.auth.grant(_authorization(context), scope)

    async def command_id(self, context: Context, request_id: str = "") -> str | None:
        """The client's id for this command: ``request_id`` or the metadata; None if neither."""
        given = metadata_of(context).get(COMMAND_ID_KEY)
        for where, value in (("request_id", request_id), (f"metadata {COMMAND_ID_KEY}", given)):
            if value and not _COMMAND_ID.fullmatch(value):
                await abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}: must be 1-128 characters from A-Z a-z 0-9 . _ : -",
                )
        if request_id and given and request_id != given:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id {request_id!r} and metadata {COMMAND_ID_KEY} {given!r} differ",
            )
        return request_id or given or None

    async def submit(
        self, command: Command, context: Context, *, reject: bool = True
    ) -> CommandOutcome:
        """The command's outcome, through the HTTP API's gateway: the known one for a retried
        command id, else published once and awaited. Rejections end the RPC with their status
        (unless ``reject`` is False), as do the gateway's refusals, mapped like the HTTP API
        maps them."""
        async with self.refusals(command, context):
            submitted = await self.gateway.submit(command, self.outcome_wait)
        outcome = submitted.outcome
        if outcome is None:
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"the command was published but not decided within {self.outcome_wait:.0f}s; "
                f"retry with the same request_id (or metadata {COMMAND_ID_KEY}) "
                f"{command.command_id}",
            )
        if reject and not outcome.accepted:
            await abort(context, STATUS_OF[outcome.code], outcome.message)
        return outcome

    @contextlib.asynccontextmanager
    async def refusals(self, command: Command, context: Context) -> AsyncIterator[None]:
        """The gateway's refusals of what it publishes within (``command``, or a claim's
        adoption for it, whose id is the request's) as the RPC's status."""
        try:
            yield
        except PublishForbidden as exc:  # INTERNAL, not the retryable UNAVAILABLE
            await abort(context, grpc.StatusCode.INTERNAL, str(exc))
        except PublishFailed:
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "Kafka did not acknowledge the command; it may still be applied: retry with "
                f"the same request_id (or metadata {COMMAND_ID_KEY}) {command.command_id}",
            )
        except IdempotencyConflict as exc:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except CommandTooLarge as exc:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def check_name(self, name: str, workspace: str | None, context: Context) -> None:
        """A sandbox name in the one workspace; NOT_FOUND for another workspace or a name no
        sandbox can have."""
        if workspace not in ("", mapping.DEFAULT_WORKSPACE):
            shown = "all workspaces" if workspace is None else repr(workspace)
            await abort(context, grpc.StatusCode.NOT_FOUND, f"workspace {shown} not found")
        if not name:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "name: required")
        if not re.fullmatch(SANDBOX_NAME_PATTERN, name):
            await abort(context, grpc.StatusCode.NOT_FOUND, f"sandbox {name!r} not found")

    async def row(self, name: str, context: Context) -> SandboxView:
        view = await readmodel.get_sandbox(self.pool, name)
        if view is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"sandbox {name!r} not found")
        return view

    async def resolve(self, reference: str, context: Context) -> SandboxView:
        """The live sandbox a Watch, Exec or logs request names in its field 1: an incarnation
        id (OpenShell 0.0) or a name (0.1). A UUID is a valid sandbox name too, so a reference
        that is the id of one live sandbox and the name of another is refused
        (FAILED_PRECONDITION) rather than guessed: no reading of it can misroute the call."""
        by_id: SandboxView | None = None
        with contextlib.suppress(ValueError):  # not an id
            by_id = await sandbox_by_id(self.pool, uuid.UUID(reference))
        by_name: SandboxView | None = None
        if re.fullmatch(SANDBOX_NAME_PATTERN, reference):
            by_name = await readmodel.get_sandbox(self.pool, reference)
        live = [v for v in (by_id, by_name) if v is not None and v.phase is not Phase.DELETED]
        if len(live) == 2 and live[0].id != live[1].id:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{reference!r} is the name of sandbox {reference!r} and the incarnation id of "
                f"sandbox {live[0].name!r}: ask for one of them by a reference only it has",
            )
        view = live[0] if live else None
        if view is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"sandbox {reference!r} not found")
        return view
