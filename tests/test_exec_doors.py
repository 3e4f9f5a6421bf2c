"""Both exec doors of one `sandstream up` (the HTTP API's and OpenShell's ExecSandbox) hold a
token to one count of sessions: a real `up` subprocess with one session per token, a command
streaming through the HTTP door, and the gRPC door refusing the token's second."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import httpx
from harness import eventually
from openshell_support import auth, status_of
from upkit import running_up

from services.common.settings import load_settings
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.openshell_pb2_grpc import OpenShellStub

IMAGE = load_settings().sandbox_image


async def test_the_two_exec_doors_of_up_share_one_count_of_sessions(tmp_path: Path) -> None:
    """Regression: each door counted its own sessions, so a token held to one session could
    run one through each door at once."""
    one = {"SANDSTREAM_OPENSHELL_EXEC_SESSIONS_PER_TOKEN": "1"}
    async with running_up(tmp_path, one) as up:
        name = up.name("doors")
        r = await up.cli("sandbox", "create", name, "--image", IMAGE, "--", "sleep", "3600")
        assert r.code == 0, r.err
        token = up.admin_token()
        target = re.search(r"OpenShell\s+grpc://(\S+)", up.banner)
        assert target, up.banner
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=up.url, headers=headers, timeout=60) as c:
            sandbox_id = (await c.get(f"/v1/sandboxes/{name}")).json()["id"]
            body = {"command": ["sleep", "600"]}
            path = f"/v1/sandboxes/{name}/exec"
            async with c.stream("POST", path, json=body, params={"stream": "true"}) as held:
                assert held.status_code == 200
                await eventually(lambda: c.post(path, json={"command": ["true"]}),
                                 lambda r: r.status_code == 429, what="the refusal")  # fmt: skip
                async with grpc.aio.insecure_channel(target.group(1)) as channel:
                    request = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=["true"])
                    call = OpenShellStub(channel).ExecSandbox(request, metadata=auth(token))
                    assert await status_of(call.read()) == grpc.StatusCode.RESOURCE_EXHAUSTED
            # The stream closed: its session ends, and the gRPC door runs the token's command.
            async with grpc.aio.insecure_channel(target.group(1)) as channel:
                request = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=["echo", "ok"])

                async def exec_once() -> list[pb.ExecSandboxEvent]:
                    call = OpenShellStub(channel).ExecSandbox(request, metadata=auth(token))
                    try:
                        return [event async for event in call]
                    except grpc.aio.AioRpcError:
                        return []

                events = await eventually(exec_once, bool, what="the session to be released")
                assert events[-1].exit.exit_code == 0
