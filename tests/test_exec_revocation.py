"""A running exec ends when its token lapses, through both doors (real Kafka, PostgreSQL and
Podman): revoked or stripped of sandbox:exec, the command is ended inside the sandbox and the
caller told why — the HTTP stream with ``event: denied``, the JSON form with 401/403,
OpenShell's ExecSandbox with UNAUTHENTICATED/PERMISSION_DENIED. Before, a session went on for
as long as its command ran (an hour by default) with a revoked token, while watches and
followed logs of the same token already ended."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import apikit
import grpc
import openshell_support as oss
import pytest
from apikit import create_body, unique
from exec_support import running_with
from harness import eventually
from podman import PodmanClient
from test_watch_revocation import LAPSES, drop_scope
from upkit import SANDSTREAM, running_up

from drivers.podman_objects import container_name
from services.common import tokens as auth
from services.common.settings import PROJECT_ROOT, load_settings
from services.executor.backends import podman_driver
from services.openshell.proto import openshell_pb2 as pb

ENDS_WITHIN = 10.0  # seconds: a session checks its token every second
IMAGE = load_settings().sandbox_image
EXEC_LAPSES: dict[str, tuple[Callable[[Path, str], None], int, str, str]] = {
    "revoked": LAPSES["revoked"],
    "scope dropped": (
        lambda path, name: drop_scope(path, name, auth.EXEC),
        403,
        "PERMISSION_DENIED",
        "token 'watcher' lacks the scope sandbox:exec",
    ),
}


def sleeper(marker: str) -> list[str]:
    return ["sh", "-c", f"echo started; sleep {marker}"]


def new_marker() -> str:
    return str(uuid.uuid4().int % 100_000 + 400_000)  # a sleep no other test runs


async def sse(response: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    kind = "message"
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            yield kind, json.loads(line[6:])


@pytest.fixture(scope="module")
def podman() -> PodmanClient:
    return PodmanClient(base_url=load_settings().podman_url)


@pytest.mark.parametrize("lapse", sorted(EXEC_LAPSES))
async def test_an_http_exec_ends_and_its_command_too_once_its_token_lapses(
    tmp_path: Path, podman: PodmanClient, lapse: str
) -> None:
    tokens_file = tmp_path / "tokens.json"
    admin = auth.add_token(tokens_file, "admin", auth.SCOPES)
    change, status, code, message = EXEC_LAPSES[lapse]
    driver = podman_driver(load_settings())
    try:
        async with apikit.running_api(
            driver, token_store=auth.TokenStore.from_file(tokens_file)
        ) as api:
            name = unique("xrevoke")
            async with api.client(admin) as c:
                body = create_body(name, image=IMAGE, command=["sleep", "3600"])
                r = await c.post("/v1/sandboxes", json=body, params={"wait": 60})
                assert r.status_code == 201, r.text
            await api.wait_phase(name, "Ready", timeout=60)
            container = container_name(name, 1)
            path = f"/v1/sandboxes/{name}/exec"

            # The stream: output, then `denied` once the token lapses, and the command gone.
            watcher = auth.add_token(tokens_file, "watcher", (auth.EXEC,))
            marker = new_marker()
            events: list[tuple[str, dict[str, Any]]] = []
            opened = float("inf")
            async with asyncio.timeout(ENDS_WITHIN + 30), api.client(watcher) as c:
                request = {"command": sleeper(marker)}
                async with c.stream("POST", path, json=request, params={"stream": "true"}) as s:
                    assert s.status_code == 200
                    async for event in sse(s):
                        events.append(event)
                        if event == ("stdout", {"data": "started\n"}):
                            change(tokens_file, "watcher")
                            opened = time.monotonic()
            assert [kind for kind, _ in events] == ["stdout", "denied"], events
            assert time.monotonic() - opened < ENDS_WITHIN
            denied = events[-1][1]
            assert (denied["status"], denied["code"]) == (status, code)
            assert denied["message"].startswith("exec ended: " + message), denied
            assert running_with(podman, container, f"sleep {marker}") == []  # ended before

            # The JSON form: the answer is the refusal, not the result of a finished command.
            if lapse != "revoked":  # the name is free again once its token is revoked
                auth.revoke_token(tokens_file, "watcher")
            watcher = auth.add_token(tokens_file, "watcher", (auth.EXEC,))
            marker = new_marker()
            async with api.client(watcher) as c:
                answer = asyncio.ensure_future(
                    c.post(path, json={"command": sleeper(marker)}, timeout=ENDS_WITHIN + 30)
                )
                await eventually(lambda: running_with(podman, container, f"sleep {marker}"),
                                 bool, what="the command to run")  # fmt: skip
                change(tokens_file, "watcher")
                r = await answer
            assert r.status_code == status, r.text
            assert r.json()["code"] == code
            assert r.json()["message"].startswith("exec ended: " + message), r.text
            assert running_with(podman, container, f"sleep {marker}") == []
    finally:
        await driver.close()


async def test_an_openshell_exec_ends_and_its_command_too_once_its_token_lapses(
    tmp_path: Path, podman: PodmanClient
) -> None:
    tokens_file = tmp_path / "tokens.json"
    admin = auth.add_token(tokens_file, "admin", auth.SCOPES)
    keeper = auth.add_token(tokens_file, "keeper", (auth.EXEC,))
    store = auth.TokenStore.from_file(tokens_file)
    async with oss.running_gateway(
        podman, "osxrevoke", token_store=store, openshell_exec_timeout_seconds=600
    ) as gw:
        name = gw.new_name()
        created = await gw.stub.CreateSandbox(
            pb.CreateSandboxRequest(name=name, spec=pb.SandboxSpec()), metadata=oss.auth(admin)
        )
        sandbox_id = created.sandbox.metadata.id
        request = pb.WatchSandboxRequest(id=sandbox_id, follow_status=True)
        async for event in gw.stub.WatchSandbox(request, metadata=oss.auth(admin), timeout=60):
            if event.sandbox.status.phase == pb.SANDBOX_PHASE_READY:
                break
        container = container_name(name, 1)
        expected = {
            "revoked": grpc.StatusCode.UNAUTHENTICATED,
            "scope dropped": grpc.StatusCode.PERMISSION_DENIED,
        }
        for lapse, (change, _, _, message) in sorted(EXEC_LAPSES.items()):
            watcher = auth.add_token(tokens_file, "watcher", (auth.EXEC,))
            marker, kept_marker = new_marker(), new_marker()
            lapsing = gw.stub.ExecSandbox(
                pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=sleeper(marker)),
                metadata=oss.auth(watcher), timeout=60,
            )  # fmt: skip
            kept = gw.stub.ExecSandbox(
                pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=sleeper(kept_marker)),
                metadata=oss.auth(keeper), timeout=60,
            )  # fmt: skip
            assert (await lapsing.read()).stdout.data == b"started\n"
            assert (await kept.read()).stdout.data == b"started\n"
            change(tokens_file, "watcher")
            opened = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while (await lapsing.read()) is not grpc.aio.EOF:
                    pass
            assert time.monotonic() - opened < ENDS_WITHIN
            assert ended.value.code() == expected[lapse], ended.value
            assert (ended.value.details() or "").startswith("exec ended: " + message)
            # Ended before the status went out; the other token's command runs on.
            assert running_with(podman, container, f"sleep {marker}") == []
            assert running_with(podman, container, f"sleep {kept_marker}") != []
            assert not kept.done()
            kept.cancel()


async def test_the_cli_and_the_sdk_say_why_an_exec_ended_when_its_token_lapsed(
    tmp_path: Path, podman: PodmanClient
) -> None:
    """Through a real `sandstream up`: `sandstream sandbox exec` exits 1 and the SDK's streamed
    ``commands.run`` raises AuthenticationError, both with the server's "exec ended: …"
    (before, neither knew the `denied` event: "the stream ended without the command's exit")."""
    sys.path.insert(0, str(PROJECT_ROOT / "sdk" / "python"))
    import sandstream_sdk as ss

    async with running_up(tmp_path) as up:
        name = up.name("xrevoke")
        r = await up.cli("sandbox", "create", name, "--image", IMAGE, "--", "sleep", "3600")
        assert r.code == 0, r.err
        container = container_name(name, 1)

        async def new_token(token: str) -> str:
            r = await up.cli("token", "create", token, "--scope", auth.READ, "--scope", auth.EXEC)
            assert r.code == 0, r.err
            return r.out.strip()

        async def revoke_when_running(token: str, marker: str) -> None:
            await eventually(lambda: running_with(podman, container, f"sleep {marker}"),
                             bool, what="the command to run")  # fmt: skip
            r = await up.cli("token", "revoke", token)
            assert r.code == 0, r.err

        # The CLI.
        marker = new_marker()
        env = {**up.env, "SANDSTREAM_API_URL": up.url, "SANDSTREAM_TOKEN": await new_token("cli")}
        proc = await asyncio.create_subprocess_exec(
            SANDSTREAM, "sandbox", "exec", name, "--", *sleeper(marker), env=env,
            cwd=PROJECT_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with asyncio.timeout(60):
                await revoke_when_running("cli", marker)
                out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert out == b"started\n"
        assert proc.returncode == 1, err
        assert "exec ended: token 'cli' was revoked at " in err.decode(), err

        # The SDK, streamed to a callback (the JSON form is a 401, mapped as any answer is).
        marker = new_marker()
        sandbox = ss.Sandbox.connect(name, api_url=up.url, token=await new_token("sdk"))
        seen: list[str] = []
        running = asyncio.ensure_future(
            asyncio.to_thread(sandbox.commands.run, sleeper(marker), on_stdout=seen.append,
                              timeout=None)
        )  # fmt: skip
        async with asyncio.timeout(60):
            await revoke_when_running("sdk", marker)
            with pytest.raises(ss.AuthenticationError) as raised:
                await running
        assert seen == ["started\n"]
        assert "exec ended: token 'sdk' was revoked at " in str(raised.value)
        assert running_with(podman, container, f"sleep {marker}") == []
