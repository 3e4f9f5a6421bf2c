"""A 0.1 client's watch resumes after `sandstream up` was restarted: with the cursor of the last
event it saw, it gets the changes after it and nothing twice (real Kafka, PostgreSQL, Podman;
one isolated environment, two `up` processes one after the other)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from services.common.settings import Settings
from services.openshell.conformance import isolated_up_settings, up_process
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

SCOPE = dm1.WorkspaceSelector(workspace="default")
WAIT = 90.0


def rpc(channel: grpc.aio.Channel, method: str, answer: Any, streaming: bool = False) -> Any:
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(
        f"/openshell.v1.OpenShell/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=answer.FromString,
    )


async def next_phase(stream: Any, phase: int) -> Any:
    """Events until a snapshot in ``phase``; returns the events read."""
    seen = []
    while True:
        event = await stream.read()
        assert event is not grpc.aio.EOF, f"the watch ended before phase {phase}: {seen}"
        seen.append(event)
        if event.WhichOneof("payload") == "sandbox" and event.sandbox.status.phase == phase:
            return seen


async def test_a_resumed_watch_gets_every_change_after_its_cursor_across_a_restart(
    settings: Settings, tmp_path: Path
) -> None:
    name = "resume-watch"
    async with isolated_up_settings(settings, tmp_path) as up_settings:
        address = f"127.0.0.1:{up_settings.openshell_port}"
        async with (
            up_process(up_settings, tmp_path / "up.log"),
            grpc.aio.insecure_channel(address) as channel,
        ):
            create = os1.CreateSandboxRequest(
                name=name, workspace_scope=SCOPE, spec=os1.SandboxSpec()
            )
            await rpc(channel, "CreateSandbox", os1.SandboxResponse)(create, timeout=WAIT)
            watch = os1.WatchSandboxRequest(sandbox=name, workspace_scope=SCOPE, follow_status=True)
            stream = rpc(channel, "WatchSandbox", os1.SandboxStreamEvent, True)(watch, timeout=WAIT)
            seen = await next_phase(stream, os1.SANDBOX_PHASE_READY)
            stream.cancel()
        cursor = seen[-1].cursor
        ready_version = seen[-1].sandbox.metadata.resource_version
        assert cursor
        # A new `up` on the same database: the cursor is the read model's, not the process's.
        async with (
            up_process(up_settings, tmp_path / "up.log"),
            grpc.aio.insecure_channel(address) as channel,
        ):
            # A change while no watch is connected, then the resume: it must arrive.
            stop = os1.StopSandboxRequest(name=name, workspace_scope=SCOPE)
            await rpc(channel, "StopSandbox", os1.SandboxResponse)(stop, timeout=WAIT)
            resume = os1.WatchSandboxRequest(
                sandbox=name,
                workspace_scope=SCOPE,
                follow_status=True,
                resume_after_cursor=cursor,
            )
            stream = rpc(channel, "WatchSandbox", os1.SandboxStreamEvent, True)(
                resume, timeout=WAIT
            )
            after = await next_phase(stream, os1.SANDBOX_PHASE_STOPPED)
            stream.cancel()
            delete = os1.DeleteSandboxRequest(name=name, workspace_scope=SCOPE)
            await rpc(channel, "DeleteSandbox", os1.DeleteSandboxResponse)(delete, timeout=WAIT)
    snapshots = [e.sandbox for e in after if e.WhichOneof("payload") == "sandbox"]
    versions = [s.metadata.resource_version for s in snapshots]
    # Nothing twice: not the Ready snapshot seen before the restart, no version repeated.
    assert versions and min(versions) > ready_version
    assert versions == sorted(set(versions))
    assert all(e.cursor for e in after if e.WhichOneof("payload") == "sandbox")
