"""A 0.1 client's watch resumes after `sandstream up` was restarted: with the cursor of the last
event it saw, it gets every change after it (each version of the row) in order and nothing
twice, also changes made while no watch was connected; where the changes are no longer kept it
is told so (RESOURCE_EXHAUSTED), never given a gap. Real Kafka, PostgreSQL, Podman; one
isolated environment, two `up` processes one after the other."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from apikit import unique

from services.common.database import connect_pool
from services.common.settings import Settings
from services.executor.backends import podman_driver
from services.openshell.conformance import isolated_up_settings, up_process
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

SCOPE = dm1.WorkspaceSelector(workspace="default")
WAIT = 90.0
P = os1.SandboxPhase


@contextlib.asynccontextmanager
async def removed_after(settings: Settings, prefix: str) -> AsyncIterator[str]:
    """A name of this run's own, its runtimes removed from Podman at the end (also when the
    test failed before deleting it). Podman is shared by every isolated environment: a fixed
    name meets the runtimes an earlier or concurrent run left under it, and a launch refuses
    a generation older than one it finds (the first watch then waits for a Ready that never
    comes)."""
    name = unique(prefix)
    try:
        yield name
    finally:
        driver = podman_driver(settings)
        try:
            await driver.delete(name)
        finally:
            await driver.close()


def rpc(channel: grpc.aio.Channel, method: str, answer: Any, streaming: bool = False) -> Any:
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(
        f"/openshell.v1.OpenShell/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=answer.FromString,
    )


def watch(channel: grpc.aio.Channel, name: str, cursor: str = "") -> Any:
    request = os1.WatchSandboxRequest(
        sandbox=name, workspace_scope=SCOPE, follow_status=True, resume_after_cursor=cursor
    )
    return rpc(channel, "WatchSandbox", os1.SandboxStreamEvent, True)(request, timeout=WAIT)


async def until_phase(stream: Any, phase: int) -> list[Any]:
    """The snapshots until one in ``phase`` (included); fails on a warning or an ended
    stream."""
    seen = []
    while True:
        event = await stream.read()
        assert event is not grpc.aio.EOF, f"the watch ended before {P.Name(phase)}: {seen}"
        assert event.WhichOneof("payload") == "sandbox", event
        seen.append(event)
        if event.sandbox.status.phase == phase:
            return seen


async def wait_for(channel: grpc.aio.Channel, name: str, phase: int) -> None:
    """A watch of its own (no cursor) until ``phase``."""
    stream = watch(channel, name)
    await until_phase(stream, phase)
    stream.cancel()


async def delete(channel: grpc.aio.Channel, name: str) -> None:
    """Delete, and wait until the runtime is gone (the watch ends after the tombstone)."""
    stream = watch(channel, name)
    request = os1.DeleteSandboxRequest(name=name, workspace_scope=SCOPE)
    await rpc(channel, "DeleteSandbox", os1.DeleteSandboxResponse)(request, timeout=WAIT)
    async for _ in stream:
        pass


def versions(events: list[Any]) -> list[int]:
    return [e.sandbox.metadata.resource_version for e in events]


def phases(events: list[Any]) -> list[int]:
    return [e.sandbox.status.phase for e in events]


async def test_a_resumed_watch_gets_every_change_after_its_cursor_across_a_restart(
    settings: Settings, tmp_path: Path
) -> None:
    async with (
        isolated_up_settings(settings, tmp_path) as up_settings,
        removed_after(up_settings, "resume") as name,
    ):
        address = f"127.0.0.1:{up_settings.openshell_port}"
        async with (
            up_process(up_settings, tmp_path / "up.log"),
            grpc.aio.insecure_channel(address) as channel,
        ):
            create = os1.CreateSandboxRequest(
                name=name, workspace_scope=SCOPE, spec=os1.SandboxSpec()
            )
            await rpc(channel, "CreateSandbox", os1.SandboxResponse)(create, timeout=WAIT)
            stream = watch(channel, name)
            first = await until_phase(stream, P.SANDBOX_PHASE_READY)
            stream.cancel()
        ready = first[-1]
        # A new `up` on the same database: the cursor is the read model's, not the process's.
        async with (
            up_process(up_settings, tmp_path / "up.log"),
            grpc.aio.insecure_channel(address) as channel,
        ):
            # Four changes while no watch that resumes is connected: stop, then start.
            stop = os1.StopSandboxRequest(name=name, workspace_scope=SCOPE)
            start = os1.StartSandboxRequest(name=name, workspace_scope=SCOPE)
            await rpc(channel, "StopSandbox", os1.SandboxResponse)(stop, timeout=WAIT)
            await wait_for(channel, name, P.SANDBOX_PHASE_STOPPED)
            await rpc(channel, "StartSandbox", os1.SandboxResponse)(start, timeout=WAIT)
            await wait_for(channel, name, P.SANDBOX_PHASE_READY)

            resumed = watch(channel, name, ready.cursor)
            missed = await until_phase(resumed, P.SANDBOX_PHASE_READY)
            # Then the live stream goes on from there: one more stop.
            await rpc(channel, "StopSandbox", os1.SandboxResponse)(stop, timeout=WAIT)
            live = await until_phase(resumed, P.SANDBOX_PHASE_STOPPED)
            resumed.cancel()

            # A cursor in the middle: the changes after it only.
            middle = watch(channel, name, missed[1].cursor)
            again = await until_phase(middle, P.SANDBOX_PHASE_STOPPED)
            middle.cancel()
            await delete(channel, name)

    v = ready.sandbox.metadata.resource_version
    assert phases(missed) == [
        P.SANDBOX_PHASE_STOPPING, P.SANDBOX_PHASE_STOPPED,
        P.SANDBOX_PHASE_STARTING, P.SANDBOX_PHASE_READY,
    ]  # fmt: skip
    assert versions(missed) == [v + 1, v + 2, v + 3, v + 4]  # each change once, in order
    assert phases(live) == [P.SANDBOX_PHASE_STOPPING, P.SANDBOX_PHASE_STOPPED]
    assert versions(live) == [v + 5, v + 6]
    assert versions(again) == [v + 3, v + 4, v + 5, v + 6]
    assert {e.sandbox.metadata.id for e in missed + live} == {ready.sandbox.metadata.id}
    assert all(e.cursor for e in missed + live + again)


async def test_a_resume_the_outbox_cannot_serve_is_resource_exhausted(
    settings: Settings, tmp_path: Path
) -> None:
    """The missed changes are rebuilt from the decided events the outbox keeps; once
    housekeeping deleted them the client is told, not given a gap. A cursor ahead of the
    sandbox is not one of its cursors."""
    async with (
        isolated_up_settings(settings, tmp_path) as up_settings,
        removed_after(up_settings, "resume-lost") as name,
        up_process(up_settings, tmp_path / "up.log"),
        grpc.aio.insecure_channel(f"127.0.0.1:{up_settings.openshell_port}") as channel,
    ):
        create = os1.CreateSandboxRequest(name=name, workspace_scope=SCOPE, spec=os1.SandboxSpec())
        await rpc(channel, "CreateSandbox", os1.SandboxResponse)(create, timeout=WAIT)
        stream = watch(channel, name)
        seen = await until_phase(stream, P.SANDBOX_PHASE_READY)
        stream.cancel()
        stop = os1.StopSandboxRequest(name=name, workspace_scope=SCOPE)
        await rpc(channel, "StopSandbox", os1.SandboxResponse)(stop, timeout=WAIT)
        await wait_for(channel, name, P.SANDBOX_PHASE_STOPPED)
        pool = await connect_pool(up_settings)
        try:
            await pool.execute("DELETE FROM outbox WHERE key = $1", name.encode())
        finally:
            await pool.close()
        lost = watch(channel, name, seen[0].cursor)
        try:
            await lost.read()
            raise AssertionError("the resume was answered")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert "watch again without a cursor" in (error.details() or "")
        # One change back needs no event: the row is that version.
        one_back = watch(channel, name, f"0.{versions(seen)[-1] + 1}")
        stopped = await until_phase(one_back, P.SANDBOX_PHASE_STOPPED)
        one_back.cancel()
        ahead = watch(channel, name, f"0.{versions(seen)[-1] + 99}")
        try:
            await ahead.read()
            raise AssertionError("a cursor ahead of the sandbox was taken")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        await delete(channel, name)
    assert phases(stopped) == [P.SANDBOX_PHASE_STOPPED]
