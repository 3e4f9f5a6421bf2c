"""WatchSandbox: status snapshots of one incarnation, one per change, its log lines, and
resumable cursors.

A change is one version of the sandbox's row (each decided event makes one). The stream sends
a snapshot of every version in order: the row change feed says when and how far the row moved,
and the versions it skipped (several decided between two reads, or by one input) are rebuilt
from the decided events (``readmodel.versions``). The cursor of a snapshot is
``<change_seq>.<version>``: where the change feed was read and the version. A 0.1 client
resuming with ``resume_after_cursor`` gets every version after the cursor's, then the live
stream: nothing twice, also after the gateway restarted (everything is in PostgreSQL). The
versions it missed are rebuilt by folding the incarnation's events from its creation, at most
``readmodel.REPLAY_EVENTS``; where the events are no longer kept, or are more than that, the
stream ends with RESOURCE_EXHAUSTED (as OpenShell ends a watch that lagged behind): watch
again without a cursor. With ``follow_logs``, the runtime's output lines are sent too (the
last ``log_tail_lines`` first, at most MAX_LINES; every line when 0), as they are written,
until the runtime stops.

The call's token is checked again every RECHECK seconds (and before each message): once it is
revoked, expires or no longer holds ``sandbox:read``, the stream ends with UNAUTHENTICATED (or
PERMISSION_DENIED) saying why. A call let in without a token (the local unauthenticated mode)
has nothing to re-check.
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
from projections.lifecycle import Sandbox
from services.api import readmodel
from services.api.readmodel import Row, SandboxView
from services.common.tokens import READ
from services.openshell import mapping, wire
from services.openshell.logs import MAX_LINES, log_message
from services.openshell.proto import served_pb2
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os_0_0
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.service import Context, Door, abort, status_of
from services.openshell.wire import Generation

RECHECK: Final = 1.0  # seconds at most between two checks of an open watch's token


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


@dataclass(frozen=True, slots=True)
class _End:
    """One part of the watch (status or logs) ended; with ``error``, the RPC ends with it."""

    part: str
    error: BaseException | None = None


_Item = served_pb2.SandboxStreamEvent | _End


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
        grant = self.door.grant(context, READ)
        try:
            request = watch_request(raw)
        except wire.Malformed as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.workspace not in ("", mapping.DEFAULT_WORKSPACE):
            await abort(
                context, grpc.StatusCode.NOT_FOUND, f"workspace {request.workspace!r} not found"
            )
        view = await self.door.resolve(request.reference, context)
        if request.resume_after is not None and request.resume_after[1] > view.version:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resume_after_cursor: version {request.resume_after[1]} is ahead of the "
                f"sandbox's ({view.version}): not a cursor of this sandbox",
            )
        queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=256)
        tasks = []
        if request.follow_status or not request.follow_logs:
            tasks.append(asyncio.create_task(self._status(view, request, queue)))
        if request.follow_logs:
            tasks.append(asyncio.create_task(self._logs(view, request, queue)))
        # The status stream decides when the watch ends; a logs-only watch, its logs.
        last = "logs" if len(tasks) == 1 and request.follow_logs else "status"
        try:
            while True:
                item = await _next(queue)
                if (lapsed := grant.lapsed()) is not None:
                    await abort(context, status_of(lapsed), f"watch ended: {lapsed.message}")
                if item is None:
                    continue
                if isinstance(item, served_pb2.SandboxStreamEvent):
                    yield item
                    continue
                if isinstance(item.error, readmodel.VersionsLost):
                    await abort(
                        context,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"changes were lost to this watch: {item.error}; watch again without "
                        "a cursor to start from the sandbox's state now",
                    )
                if item.error is not None:
                    raise item.error
                if item.part == last:
                    return
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _status(
        self, view: SandboxView, request: WatchRequest, queue: asyncio.Queue[_Item]
    ) -> None:
        """The status part; its failure ends the RPC (a lost database: UNAVAILABLE)."""
        error: BaseException | None = None
        try:
            await _StatusStream(self.door, view, request, queue).run()
        except Exception as exc:
            error = exc
        finally:
            await queue.put(_End("status", error))

    async def _logs(
        self, view: SandboxView, request: WatchRequest, queue: asyncio.Queue[_Item]
    ) -> None:
        try:
            source = self.door.logs
            if source is None:
                raise LogsUnavailable("this gateway has no log source")
            # 0: every line; at most MAX_LINES, as GetSandboxLogs' ``lines``.
            tail = min(request.log_tail, MAX_LINES) if request.log_tail else None
            async for line in source.read(view.member_key, view.generation, tail=tail, follow=True):
                await queue.put(served_pb2.SandboxStreamEvent(log=log_message(view, line)))
        except LogsUnavailable as exc:
            warning = served_pb2.SandboxStreamWarning(message=f"logs: {exc}")
            await queue.put(served_pb2.SandboxStreamEvent(warning=warning))
        finally:
            await queue.put(_End("logs"))


async def _next(queue: asyncio.Queue[_Item]) -> _Item | None:
    """The next item, or None after RECHECK seconds without one (the token is due a check)."""
    try:
        return await asyncio.wait_for(queue.get(), RECHECK)
    except TimeoutError:
        return None


class _Ended(Exception):
    """The status part is done: the tombstone, another incarnation, or a terminal phase."""


@dataclass
class _StatusStream:
    """Snapshots of every version of one incarnation, from the start or after a cursor."""

    door: Door
    view: SandboxView
    request: WatchRequest
    queue: asyncio.Queue[_Item]

    async def run(self) -> None:
        row = await readmodel.get_row(self.door.pool, self.view.member_key)
        if row is None or row.sandbox.sandbox_id != self.view.id:
            return  # deleted and created again since it was resolved
        try:
            first = await self._first(row)
            await self._send(first, row.change_seq)
            if not first and self._ends(row.sandbox):
                return  # resumed after the version that ended the stream
            await self._follow(row)
        except _Ended:
            return

    async def _first(self, row: Row) -> list[Sandbox]:
        """The versions to send first: the row; or, resuming, every version after the cursor."""
        if self.request.resume_after is None:
            return [row.sandbox]
        seen = self.request.resume_after[1]
        now = row.sandbox
        if now.version - seen <= 1 or not self.request.follow_status:
            return [now] if now.version > seen else []
        versions = await readmodel.incarnation_versions(
            self.door.pool, self.door.events_topic, now.key, now.sandbox_id, now.version
        )
        return [v for v in versions[:-1] if v.version > seen] + [now]

    async def _follow(self, row: Row) -> None:
        """Every later version, read as the change feed says the row moved."""
        door, last, cursor = self.door, row.sandbox, row.change_seq
        feed = door.gateway.feed
        while not feed.closed:
            mark = feed.mark()
            horizon = await feed.horizon(mark)
            while horizon is not None and horizon > cursor:
                rows = await readmodel.changed_rows(
                    door.pool, cursor, horizon, names=[self.view.member_key]
                )
                full = len(rows) == readmodel.CHANGES_PAGE
                cursor = rows[-1].change_seq if full else horizon
                for changed in rows:
                    if changed.sandbox.sandbox_id != self.view.id:
                        return  # the name was re-created: this incarnation is gone
                    await self._send(await self._since(last, changed), changed.change_seq)
                    last = changed.sandbox
            await feed.wait(mark, feed.poll_interval)

    async def _since(self, last: Sandbox, changed: Row) -> list[Sandbox]:
        """The versions from ``last`` (excluded) to the changed row (included)."""
        now = changed.sandbox
        if now.version <= last.version:
            return []
        if now.version == last.version + 1 or not self.request.follow_status:
            return [now]
        between = await readmodel.versions_after(
            self.door.pool, self.door.events_topic, last, now.version - 1
        )
        return [*between, now]

    def _ends(self, version: Sandbox) -> bool:
        terminal = (Phase.READY, Phase.ERROR) if self.request.stop_on_terminal else ()
        return version.phase is Phase.DELETED or version.phase in terminal

    async def _send(self, versions: list[Sandbox], change_seq: int) -> None:
        for version in versions:
            if self.request.follow_status:
                message = mapping.sandbox_message(
                    readmodel.view_of(version, change_seq), self.request.generation
                )
                cursor = f"{change_seq}.{version.version}"
                await self.queue.put(served_pb2.SandboxStreamEvent(sandbox=message, cursor=cursor))
            if self._ends(version):
                raise _Ended
