"""WatchSandbox: status snapshots of one incarnation, its log lines, and resumable cursors.

The cursor of a snapshot is ``<change_seq>.<version>``: the row's position in the change feed
(PostgreSQL's, so it survives a restart of the gateway) and its version. A 0.1 client resuming
with ``resume_after_cursor`` gets the current snapshot only if the row changed after it, then
every later change: nothing twice. The read model keeps each row's latest state only, so
changes between two reads are coalesced into the newer snapshot; a resumed client that missed
more than one change is told so with a warning before that snapshot (0.1 only: a 0.0 client
never resumes and gets exactly the stream it always got). With ``follow_logs``, the runtime's
output lines are sent too, as they are written, until the runtime stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

import grpc

from drivers.logs import LogsUnavailable
from events.common import Phase
from services.api import readmodel
from services.api.readmodel import SandboxView
from services.common.tokens import READ
from services.openshell import mapping, wire
from services.openshell.logs import log_message
from services.openshell.proto import served_pb2
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.service import Context, Door, abort
from services.openshell.wire import Generation

_STATUS_END: Final = object()
_LOGS_END: Final = object()


@dataclass(frozen=True, slots=True)
class WatchRequest:
    reference: str
    workspace: str | None
    generation: Generation
    follow_status: bool
    follow_logs: bool
    log_tail: int
    stop_on_terminal: bool
    resume_after: tuple[int, int] | None  # (change_seq, version)


def cursor_of(view: SandboxView) -> str:
    return f"{view.change_seq}.{view.version}"


def parse_cursor(text: str) -> tuple[int, int]:
    seq, dot, version = text.partition(".")
    if not dot or not seq.isdigit() or not version.isdigit():
        raise wire.Malformed(f"resume_after_cursor {text!r}: not a cursor of this gateway")
    return int(seq), int(version)


def watch_request(raw: bytes) -> WatchRequest:
    decoded = wire.decode(raw, os_0_0.WatchSandboxRequest, os_0_1.WatchSandboxRequest)
    if decoded.new is not None:
        n = decoded.new
        resume = parse_cursor(n.resume_after_cursor) if n.resume_after_cursor else None
        return WatchRequest(
            n.sandbox,
            mapping.selected_workspace(n.workspace_scope),
            Generation.V0_1,
            n.follow_status,
            n.follow_logs,
            n.log_tail_lines,
            n.stop_on_terminal,
            resume,
        )
    assert decoded.old is not None
    o = decoded.old
    return WatchRequest(
        o.id,
        "",
        Generation.V0_0,
        o.follow_status,
        o.follow_logs,
        o.log_tail_lines,
        o.stop_on_terminal,
        None,
    )


class WatchRpcs:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def WatchSandbox(
        self, raw: bytes, context: Context
    ) -> AsyncIterator[served_pb2.SandboxStreamEvent]:
        """Ends after the tombstone (sent as DELETING), when the name is re-created (another
        incarnation), with ``stop_on_terminal`` at READY or ERROR, or (logs only) when the
        runtime's output ends."""
        await self.door.authorize(context, READ)
        try:
            request = watch_request(raw)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.workspace not in ("", mapping.DEFAULT_WORKSPACE):
            await abort(
                context, grpc.StatusCode.NOT_FOUND, f"workspace {request.workspace!r} not found"
            )
        view = await self.door.resolve(request.reference, context)
        queue: asyncio.Queue[served_pb2.SandboxStreamEvent | object] = asyncio.Queue(maxsize=256)
        tasks = []
        if request.follow_status or not request.follow_logs:
            tasks.append(asyncio.create_task(self._status(view, request, queue)))
        if request.follow_logs:
            tasks.append(asyncio.create_task(self._logs(view, request, queue)))
        # The status stream decides when the watch ends; a logs-only watch, its logs.
        last = _LOGS_END if len(tasks) == 1 and request.follow_logs else _STATUS_END
        try:
            while (item := await queue.get()) is not last:
                if isinstance(item, served_pb2.SandboxStreamEvent):
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _status(
        self,
        view: SandboxView,
        request: WatchRequest,
        queue: asyncio.Queue[served_pb2.SandboxStreamEvent | object],
    ) -> None:
        try:
            await self._follow_status(view, request, queue)
        finally:
            await queue.put(_STATUS_END)

    async def _follow_status(
        self,
        view: SandboxView,
        request: WatchRequest,
        queue: asyncio.Queue[served_pb2.SandboxStreamEvent | object],
    ) -> None:
        terminal = (Phase.READY, Phase.ERROR) if request.stop_on_terminal else ()
        send = request.follow_status

        async def emit(row: SandboxView) -> None:
            if send:
                message = mapping.sandbox_message(row, request.generation)
                await queue.put(
                    served_pb2.SandboxStreamEvent(sandbox=message, cursor=cursor_of(row))
                )

        cursor = view.change_seq
        if request.resume_after is None:
            await emit(view)
        else:
            cursor, seen_version = request.resume_after
            if view.version > seen_version:
                if view.version > seen_version + 1 and send:
                    missed = view.version - seen_version - 1
                    warning = served_pb2.SandboxStreamWarning(
                        message=f"{missed} changes after the cursor were coalesced: the next "
                        "snapshot is the sandbox's state now"
                    )
                    await queue.put(served_pb2.SandboxStreamEvent(warning=warning))
                await emit(view)
            cursor = max(cursor, view.change_seq)
        if view.phase in terminal:
            return
        feed = self.door.gateway.feed
        while not feed.closed:
            mark = feed.mark()
            horizon = await feed.horizon(mark)
            while horizon is not None and horizon > cursor:
                rows = await readmodel.changes_after(
                    self.door.pool, cursor, horizon, names=[view.name]
                )
                full = len(rows) == readmodel.CHANGES_PAGE
                cursor = rows[-1].change_seq if full else horizon
                for row in rows:
                    if row.id != view.id:
                        return  # the name was re-created: this incarnation is gone
                    await emit(row)
                    if row.phase is Phase.DELETED or row.phase in terminal:
                        return
            await feed.wait(mark, feed.poll_interval)

    async def _logs(
        self,
        view: SandboxView,
        request: WatchRequest,
        queue: asyncio.Queue[served_pb2.SandboxStreamEvent | object],
    ) -> None:
        try:
            source = self.door.logs
            if source is None:
                raise LogsUnavailable("this gateway has no log source")
            async for line in source.read(
                view.name, view.generation, tail=request.log_tail or None, follow=True
            ):
                await queue.put(served_pb2.SandboxStreamEvent(log=log_message(view, line)))
        except LogsUnavailable as exc:
            warning = served_pb2.SandboxStreamWarning(message=f"logs: {exc}")
            await queue.put(served_pb2.SandboxStreamEvent(warning=warning))
        finally:
            await queue.put(_LOGS_END)
