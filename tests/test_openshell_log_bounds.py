"""The bounds of the OpenShell door's log reads, both generations, on real Kafka, PostgreSQL and
Podman: WatchSandbox's ``log_tail_lines`` is held to GetSandboxLogs' bound, and a start before
the epoch answers every line.

Between the door and Podman's log source stands a guard that records each tail the door asks for
and never passes one above the bound on: before the fix, a watch's tail of 2**32-1 reached
Podman as asked, which allocated a channel of that many entries and died out of memory (the
shared service, with every test on it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from openshell_support import (
    Gateway,
    Phase,
    create,
    running_gateway,
    stream,
    wait_phase,
)
from openshell_support import (
    call as unary,
)
from podman import PodmanClient

from drivers.logs import MAX_TAIL, LogLine, LogSource, LogsUnavailable
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import served_pb2
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os0
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

MAIN = ["sh", "-c", "echo line-one; echo line-two >&2; exec sleep 3600"]


@dataclass
class Guard:
    """A LogSource in front of another: records the tails asked, refuses one above the bound."""

    inner: LogSource
    tails: list[int | None] = field(default_factory=list)

    def read(
        self,
        key: str,
        generation: int,
        *,
        tail: int | None = None,
        since: datetime | None = None,
        follow: bool = False,
    ) -> AsyncIterator[LogLine]:
        self.tails.append(tail)
        if tail is not None and tail > MAX_TAIL:
            raise LogsUnavailable(f"the guard kept a tail of {tail} from Podman")
        return self.inner.read(key, generation, tail=tail, since=since, follow=follow)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Guarded:
    gateway: Gateway
    guard: Guard


@pytest.fixture(scope="module")
async def guarded(podman: PodmanClient) -> AsyncIterator[Guarded]:
    guards: list[Guard] = []

    def wrap(source: LogSource) -> LogSource:
        guards.append(Guard(source))
        return guards[-1]

    async with running_gateway(podman, "oslogs", wrap_logs=wrap) as gateway:
        yield Guarded(gateway, guards[0])


@pytest.fixture(scope="module")
async def printing(guarded: Guarded) -> tuple[str, str]:
    """A Ready sandbox whose main process wrote two lines: its name and id."""
    name = guarded.gateway.new_name()
    sandbox_id = (
        await create(guarded.gateway, name, spec=pb.SandboxSpec(command=MAIN))
    ).metadata.id
    await wait_phase(guarded.gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    return name, sandbox_id


async def first_log(gw: Gateway, request: os0.WatchSandboxRequest | os1.WatchSandboxRequest) -> str:
    """The first log line a logs-only watch sends (a warning fails the test)."""
    watch = stream(gw, "WatchSandbox", request, served_pb2.SandboxStreamEvent)
    try:
        async for event in watch:
            assert not event.HasField("warning"), event.warning.message
            if event.HasField("log"):
                return str(event.log.message)
    finally:
        watch.cancel()
    raise AssertionError("the watch ended without a log line")


@pytest.mark.parametrize("tail", [MAX_TAIL + 1, 2**32 - 1])
@pytest.mark.parametrize("generation", ["0.0", "0.1"])
async def test_a_watchs_log_tail_above_the_bound_is_read_as_the_bound(
    guarded: Guarded, printing: tuple[str, str], generation: str, tail: int
) -> None:
    """Before, the tail went to the log source (and so to Podman) as asked."""
    name, sandbox_id = printing
    request: os0.WatchSandboxRequest | os1.WatchSandboxRequest
    if generation == "0.0":
        request = os0.WatchSandboxRequest(id=sandbox_id, follow_logs=True, log_tail_lines=tail)
    else:
        scope = dm1.WorkspaceSelector(workspace="default")
        request = os1.WatchSandboxRequest(
            sandbox=name, workspace_scope=scope, follow_logs=True, log_tail_lines=tail
        )
    before = len(guarded.guard.tails)
    assert await first_log(guarded.gateway, request) == "line-one"
    assert guarded.guard.tails[before:] == [MAX_TAIL]


async def test_get_sandbox_logs_since_before_the_epoch_answers_every_line(
    guarded: Guarded, printing: tuple[str, str]
) -> None:
    """Both generations: a start before the epoch is the start (HTTP's ``since`` likewise)."""
    name, sandbox_id = printing
    old = await unary(
        guarded.gateway,
        "GetSandboxLogs",
        os0.GetSandboxLogsRequest(sandbox_id=sandbox_id, since_ms=-86_400_000),
        os0.GetSandboxLogsResponse,
    )
    new = await unary(
        guarded.gateway,
        "GetSandboxLogs",
        os1.GetSandboxLogsRequest(
            sandbox=name,
            workspace_scope=dm1.WorkspaceSelector(workspace="default"),
            since_time=Timestamp(seconds=-86_400),
        ),
        os1.GetSandboxLogsResponse,
    )
    for answer in (old, new):
        assert sorted(line.message for line in answer.logs) == ["line-one", "line-two"]
