"""The OpenShell door's connection deadlines (services/openshell/server.py): a handshake must end
within ``HANDSHAKE_SECONDS``, and a connection with no call open is closed after
``IDLE_SECONDS``. Before, a connection that sent nothing stayed open for grpc-core's 120 s, and
one that finished its handshake and then made no call (pings keep it alive) for ever. The door
runs here with both scaled down (0.5 s, 1 s), through the same options."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from openshell_support import Gateway, Phase, auth, create, running_gateway, wait_phase
from podman import PodmanClient

from services.openshell import server
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import openshell_pb2_grpc

HANDSHAKE, IDLE = 0.5, 1.0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(podman: PodmanClient) -> AsyncIterator[Gateway]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server, "SERVER_OPTIONS", server.server_options(HANDSHAKE, IDLE))
        async with running_gateway(podman, "osconn") as gateway:
            yield gateway


async def closed_within(address: str, sent: bytes, seconds: float) -> bool:
    """Whether the door closes a connection that sent ``sent`` and then nothing."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if sent:
            writer.write(sent)
            await writer.drain()
        async with asyncio.timeout(seconds):
            while await reader.read(4096):  # the server's SETTINGS, then its close
                pass
        return True
    except TimeoutError:
        return False
    finally:
        writer.close()


async def test_the_door_closes_a_connection_that_never_finishes_its_handshake(
    gateway: Gateway,
) -> None:
    address = gateway.server.address
    assert await closed_within(address, b"", 10 * HANDSHAKE)  # not even a byte
    assert await closed_within(address, PREFACE, 10 * HANDSHAKE)  # the preface, no SETTINGS


async def test_a_connection_without_calls_is_closed_and_one_with_a_watch_open_is_kept(
    gateway: Gateway,
) -> None:
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name)).metadata.id
    await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    # Each channel its own connection (grpc-core shares one between channels alike by default).
    options = [("grpc.keepalive_time_ms", 200), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0),
               ("grpc.use_local_subchannel_pool", 1)]  # fmt: skip
    async with (
        grpc.aio.insecure_channel(gateway.server.address, options=options) as watching,
        grpc.aio.insecure_channel(gateway.server.address, options=options) as idle,
    ):
        stream = openshell_pb2_grpc.OpenShellStub(watching).WatchSandbox(
            pb.WatchSandboxRequest(id=sandbox_id, follow_status=True), metadata=auth()
        )
        assert (await stream.read()).sandbox.status.phase == Phase.SANDBOX_PHASE_READY
        stub = openshell_pb2_grpc.OpenShellStub(idle)
        for _ in range(2):  # two idle deadlines pass, each seen closing the idle connection
            await stub.ListSandboxes(pb.ListSandboxesRequest(), metadata=auth())
            assert idle.get_state() is grpc.ChannelConnectivity.READY
            # Pinged every 0.2 s, it is still closed once a second passes without a call.
            async with asyncio.timeout(20 * IDLE):
                await idle.wait_for_state_change(grpc.ChannelConnectivity.READY)
            assert idle.get_state() is not grpc.ChannelConnectivity.READY
        # The watch's connection, open since before the idle one and quiet all along, stays.
        assert watching.get_state() is grpc.ChannelConnectivity.READY
        await gateway.stub.StopSandbox(pb.StopSandboxRequest(name=name), metadata=auth())
        nxt = await asyncio.wait_for(stream.read(), 60)
        assert nxt.sandbox.status.phase in (
            Phase.SANDBOX_PHASE_STOPPING,
            Phase.SANDBOX_PHASE_STOPPED,
        )
        stream.cancel()
    await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())


def test_the_door_serves_with_a_30_s_handshake_and_a_5_minute_idle_deadline() -> None:
    options = dict(server.SERVER_OPTIONS)
    assert server.HANDSHAKE_SECONDS == 30.0 and server.IDLE_SECONDS == 300.0
    assert options["grpc.server_handshake_timeout_ms"] == 30_000
    assert options["grpc.max_connection_idle_ms"] == 300_000
