"""ExecSandbox: a command inside the sandbox, through the driver (Podman's exec API).

Bounded three ways (settings ``openshell_exec_*``): every command ends by a deadline (the
client's ``execution_timeout`` / ``timeout_seconds``, never above the setting, which is also
the default), one token has at most so many sessions open at once, and all tokens together at
most so many (each session holds a thread reading Podman's stream while it runs).

The deadline, and a client that cancels or goes away, end the command too: the RPC leaves the
driver's stream early, and the driver ends what it started (the Podman driver: SIGTERM to the
command's process group, SIGKILL after a grace, signalled from the host by the exec session's
PID, which works for any image where the gateway shares the Podman service's PID namespace;
drivers/podman_exec_end.py). DEADLINE_EXCEEDED goes out once that is done.

So does a token that lapses while the command runs (checked every second, as WatchSandbox
does: revoked, expired, no longer holding ``sandbox:exec``): UNAUTHENTICATED (PERMISSION_DENIED
for the scope), "exec ended: …", once the command is ended. A call let in without a token (the
local unauthenticated mode) has nothing to re-check.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.duration_pb2 import Duration

from drivers.protocol import BackendRefused, DriverError, ExecExit
from events.common import Phase
from services.api.wake import WakeFailed, woken
from services.common.credentials import CredentialKeyError, Vault
from services.common.exec_env import ExecEnvUnavailable, exec_environment
from services.common.exec_sessions import (
    ExecLimits,
    ExecTimedOut,
    check_argv,
    check_env,
    check_workdir,
    within,
)
from services.common.tokens import EXEC, RECHECK, Denied, while_granted
from services.openshell import mapping, wire
from services.openshell.proto import openshell_pb2 as pinned
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.service import Context, Door, abort, status_of


@dataclass(frozen=True, slots=True)
class ExecRequest:
    reference: str  # an incarnation id (0.0) or a name (0.1)
    workspace: str | None
    command: list[str]
    environment: dict[str, str]
    workdir: str
    stdin: bytes
    timeout: float | None  # seconds; None: the client set none


def execution_timeout(duration: Duration) -> float:
    """0.1's ``execution_timeout`` (a Duration) in seconds; Malformed (INVALID_ARGUMENT) when
    negative or not a Duration (nanos beyond a second, or of the other sign). Any size: the
    caller holds it to the limit."""
    seconds, nanos = duration.seconds, duration.nanos
    if not -999_999_999 <= nanos <= 999_999_999 or seconds * nanos < 0:
        raise wire.Malformed(
            "execution_timeout: nanos must be within ±999999999, of the sign of seconds"
        )
    if seconds < 0 or nanos < 0:
        raise wire.Malformed("execution_timeout: must not be negative")
    return float(seconds) + nanos / 1e9


def exec_request(raw: bytes) -> ExecRequest:
    decoded = wire.decode(raw, os_0_0.ExecSandboxRequest, os_0_1.ExecSandboxRequest)
    if decoded.new is not None:
        n = decoded.new
        timeout = (
            execution_timeout(n.execution_timeout) if n.HasField("execution_timeout") else None
        )
        return ExecRequest(
            n.sandbox,
            mapping.selected_workspace(n.workspace_scope),
            list(n.command),
            dict(n.environment),
            n.workdir,
            n.stdin,
            timeout,
        )
    assert decoded.old is not None
    o = decoded.old
    return ExecRequest(
        o.sandbox_id,
        "",
        list(o.command),
        dict(o.environment),
        o.workdir,
        o.stdin,
        float(o.timeout_seconds) or None,
    )


class ExecRpcs:
    def __init__(self, door: Door, limits: ExecLimits) -> None:
        self.door = door
        self.limits = limits

    async def ExecSandbox(
        self, raw: bytes, context: Context
    ) -> AsyncIterator[pinned.ExecSandboxEvent]:
        """Output chunks as they come, then the exit; DEADLINE_EXCEEDED past the limit."""
        principal = await self.door.authorize(context, EXEC)
        try:
            request = exec_request(raw)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.command:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "command: required")
        checks: tuple[tuple[str, Callable[[], object]], ...] = (  # the HTTP door's (its 422)
            ("command", lambda: check_argv(request.command)),
            ("environment", lambda: check_env(request.environment)),
            ("workdir", lambda: check_workdir(request.workdir or None)),
        )
        for field, check in checks:
            try:
                check()
            except ValueError as exc:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {exc}")
        limit = self.limits.timeout
        if request.timeout is not None and request.timeout > limit:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"execution_timeout: at most {limit:.0f} seconds",
            )
        if request.workspace not in ("", mapping.DEFAULT_WORKSPACE):
            await abort(
                context, grpc.StatusCode.NOT_FOUND, f"workspace {request.workspace!r} not found"
            )
        view = await self.door.resolve(request.reference, context)
        driver = self.door.driver
        if driver is None:
            await abort(context, grpc.StatusCode.UNIMPLEMENTED, "the driver cannot exec")
        await self._within_limits(principal.name, view.member_key, context)  # refused: no wake
        try:  # a Suspended sandbox is resumed first (services/api/wake.py)
            view = await woken(self.door.gateway, view, principal.name, self.door.wake_timeout)
        except WakeFailed as exc:
            status = (
                grpc.StatusCode.DEADLINE_EXCEEDED
                if exc.timed_out
                else grpc.StatusCode.UNAVAILABLE
                if exc.unavailable
                else grpc.StatusCode.FAILED_PRECONDITION
            )
            await abort(context, status, f"sandbox {view.name!r} was Suspended and {exc.reason}")
        if view.phase is not Phase.READY:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"sandbox {view.name!r} is {view.phase.value}, not Ready",
            )
        await self._within_limits(principal.name, view.member_key, context)  # begun meanwhile?
        timeout = self.limits.deadline(request.timeout)
        await self.door.use.begin(view.member_key, view.spec.idle_suspend_seconds)  # the next scan
        try:  # a claim's env and providers' values (services/common/exec_env.py)
            env = await exec_environment(
                self.door.pool, self._vault, view.member_key, view.claim_part, request.environment
            )
        except ExecEnvUnavailable as exc:
            await abort(context, grpc.StatusCode.UNAVAILABLE, exc.reason)
        with (
            self.limits.session(principal.name, view.member_key),
            self.door.use.using(view.member_key),
        ):
            stream = driver.exec_stream(
                view.member_key,
                view.generation,
                request.command,
                env=env,
                workdir=request.workdir or None,
                stdin=request.stdin or None,
            )
            held = self.door.grant(context, EXEC)
            events = while_granted(within(stream, timeout), held, RECHECK)
            try:
                async for event in events:
                    if isinstance(event, Denied):
                        await events.aclose()  # the command is ended before the answer
                        await abort(context, status_of(event), f"exec ended: {event.message}")
                    if isinstance(event, ExecTimedOut):
                        await abort(
                            context,
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the command ran longer than {timeout:g}s",
                        )
                    yield _event(event)
            except DriverError as exc:
                await abort(context, exec_failure_code(exc), exc.reason)
            finally:
                await events.aclose()
                await stream.aclose()

    async def _vault(self) -> Vault:
        if self.door.providers is None:
            raise CredentialKeyError("this door holds no credentials key")
        return await self.door.providers.vault()

    async def _within_limits(self, token: str, name: str, context: Context) -> None:
        refused = self.limits.refusal(token, name)
        if refused is not None:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refused)


def _event(event: object) -> pinned.ExecSandboxEvent:
    """The event in both generations' words (ExecSandboxEvent did not change)."""
    if isinstance(event, ExecExit):
        return pinned.ExecSandboxEvent(exit=pinned.ExecSandboxExit(exit_code=event.exit_code))
    stream, data = getattr(event, "stream", ""), getattr(event, "data", b"")
    if stream == "stdout":
        return pinned.ExecSandboxEvent(stdout=pinned.ExecSandboxStdout(data=data))
    return pinned.ExecSandboxEvent(stderr=pinned.ExecSandboxStderr(data=data))


def exec_failure_code(exc: DriverError) -> grpc.StatusCode:
    """A driver's failure as OpenShell's status, as the HTTP door answers it: transient, or the
    backend refusing sandstream's own account (the deployment's RBAC), UNAVAILABLE; the
    sandbox's state FAILED_PRECONDITION."""
    if exc.retryable or isinstance(exc, BackendRefused):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.FAILED_PRECONDITION
