"""`sandstream up` takes commands only once its executor has joined its consumer group. A new
executor group starts at the end of the events topic, so a sandbox decided before the executor
joined is not its to launch: it waited for the reconcile pass to pick it up (two passes, a
minute by default), and under load a client's first watch ran out before the sandbox was
Ready. Real Kafka (its ACLs hold the executor back), PostgreSQL and Podman."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
from apikit import unique
from harness import eventually

from services.common.settings import Settings
from services.executor.backends import podman_driver
from services.localstack import kafka_auth
from services.openshell.conformance import isolated_up_settings, up_process
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import openshell_pb2_grpc

WAIT = 60.0
REFUSED = "driver side crashed: GroupAuthorizationFailedError"
WAITING = "waiting for the executor to join its consumer group"


async def granted_later(settings: Settings, log: Path, created: asyncio.Event) -> None:
    """Grant the executor's group once its join was refused and then either `up` says it
    waits for it or a sandbox was created (whichever comes first)."""

    def says(line: str) -> bool:
        return line in log.read_text(errors="replace") if log.exists() else False

    await eventually(lambda: says(REFUSED), bool, timeout=WAIT, what="the executor refused")
    await eventually(lambda: says(WAITING) or created.is_set(), bool, timeout=WAIT,
                     what="`up` waiting for its executor, or a sandbox created")  # fmt: skip
    await asyncio.to_thread(kafka_auth.grant, settings)


async def until_ready(stub: openshell_pb2_grpc.OpenShellStub, sandbox_id: str) -> None:
    request = pb.WatchSandboxRequest(id=sandbox_id, follow_status=True)
    async for event in stub.WatchSandbox(request, timeout=WAIT):
        phase = event.sandbox.status.phase
        assert phase != pb.SandboxPhase.SANDBOX_PHASE_ERROR, event
        if phase == pb.SandboxPhase.SANDBOX_PHASE_READY:
            return
    raise AssertionError("the watch ended before Ready")


async def test_a_sandbox_created_once_up_answers_is_launched_by_its_executor_that_joined_late(
    settings: Settings, tmp_path: Path
) -> None:
    async with isolated_up_settings(settings, tmp_path) as base:
        # A group without ACLs until the test grants them; no reconcile pass to pick it up.
        late = base.model_copy(
            update={"executor_group": f"{base.executor_group}-late",
                    "reconcile_interval_seconds": 3600}
        )  # fmt: skip
        log, created, name = tmp_path / "up.log", asyncio.Event(), unique("join")
        grant = asyncio.create_task(granted_later(late, log, created))
        try:
            async with (
                up_process(late, log),
                grpc.aio.insecure_channel(f"127.0.0.1:{late.openshell_port}") as channel,
            ):
                stub = openshell_pb2_grpc.OpenShellStub(channel)
                request = pb.CreateSandboxRequest(name=name, spec=pb.SandboxSpec())
                sandbox = (await stub.CreateSandbox(request, timeout=WAIT)).sandbox
                created.set()
                await until_ready(stub, sandbox.metadata.id)
            assert grant.done() and grant.exception() is None
        finally:
            grant.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await grant
            driver = podman_driver(late)
            try:
                await driver.delete(name)
            finally:
                await driver.close()
            await asyncio.to_thread(kafka_auth.revoke, late)
