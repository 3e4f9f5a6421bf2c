"""GetSandboxLogs: the sandbox's output, read from its runtime (Podman's container log, the
Pod's log), never stored. One line per ``SandboxLogLine``: ``source`` is ``sandbox``,
``target`` the stream (``stdout`` or ``stderr``), ``level`` ``INFO`` (a process's output has
no level), the time in both generations' fields."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from drivers.logs import EPOCH, MAX_TAIL, LogLine, LogsUnavailable
from services.api.readmodel import SandboxView
from services.common.tokens import READ
from services.openshell import mapping, wire
from services.openshell.proto import served_pb2
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.service import Context, Door, abort

SOURCE: Final = "sandbox"
DEFAULT_LINES: Final = 1000  # lines answered when the client asks for none
MAX_LINES: Final = MAX_TAIL  # 10000; a larger ``lines`` is read as this
# A protobuf Timestamp's range, which is also Python's: 0001-01-01 to 9999-12-31 (UTC).
FIRST_SECOND: Final = -62_135_596_800
LAST_SECOND: Final = 253_402_300_799
RANGE: Final = "0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z"


def log_message(view: SandboxView, line: LogLine) -> served_pb2.SandboxLogLine:
    return served_pb2.SandboxLogLine(
        sandbox_id=str(view.id),
        timestamp_ms=mapping.millis(line.at),
        event_time=mapping.timestamp(line.at),
        level="INFO",
        target=line.stream,
        message=line.text,
        source=SOURCE,
    )


@dataclass(frozen=True, slots=True)
class LogsRequest:
    reference: str
    workspace: str | None
    lines: int
    since: datetime | None
    sources: list[str]


def since_time(at: Timestamp) -> datetime:
    """0.1's ``since_time`` (a Timestamp); Malformed (INVALID_ARGUMENT) outside its range."""
    if not FIRST_SECOND <= at.seconds <= LAST_SECOND:
        raise wire.Malformed(f"since_time: seconds out of range ({RANGE})")
    if not 0 <= at.nanos <= 999_999_999:
        raise wire.Malformed("since_time: nanos out of range (0 to 999999999)")
    return at.ToDatetime(tzinfo=UTC)


def since_ms(ms: int) -> datetime:
    """0.0's ``since_ms`` (milliseconds since the epoch); Malformed outside the range."""
    if not FIRST_SECOND * 1000 <= ms <= LAST_SECOND * 1000 + 999:
        raise wire.Malformed(f"since_ms: out of range ({RANGE})")
    return EPOCH + timedelta(milliseconds=ms)


def logs_request(raw: bytes) -> LogsRequest:
    decoded = wire.decode(raw, os_0_0.GetSandboxLogsRequest, os_0_1.GetSandboxLogsRequest)
    if decoded.new is not None:
        n = decoded.new
        since = since_time(n.since_time) if n.HasField("since_time") else None
        return LogsRequest(
            n.sandbox,
            mapping.selected_workspace(n.workspace_scope),
            n.lines,
            since,
            list(n.sources),
        )
    assert decoded.old is not None
    o = decoded.old
    since = since_ms(o.since_ms) if o.since_ms else None
    return LogsRequest(o.sandbox_id, o.workspace, o.lines, since, list(o.sources))


class LogRpcs:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def GetSandboxLogs(
        self, raw: bytes, context: Context
    ) -> served_pb2.GetSandboxLogsResponse:
        """The last ``lines`` lines (DEFAULT_LINES when 0, at most MAX_LINES), since
        ``since``; none when ``sources`` leaves out ``sandbox``."""
        await self.door.authorize(context, READ)
        try:
            request = logs_request(raw)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.workspace not in ("", mapping.DEFAULT_WORKSPACE):
            await abort(
                context, grpc.StatusCode.NOT_FOUND, f"workspace {request.workspace!r} not found"
            )
        view = await self.door.resolve(request.reference, context)
        if request.sources and SOURCE not in request.sources:
            return served_pb2.GetSandboxLogsResponse()
        lines = min(request.lines or DEFAULT_LINES, MAX_LINES)
        found = []
        try:
            source = self.door.logs
            if source is None:
                raise LogsUnavailable("this gateway has no log source")
            async for line in source.read(
                view.member_key, view.generation, tail=lines, since=request.since
            ):
                found.append(log_message(view, line))
        except LogsUnavailable as exc:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"logs of {view.name!r}: {exc}")
        return served_pb2.GetSandboxLogsResponse(logs=found, buffer_total=len(found))
