"""Exec and files of the Kubernetes driver on a real node (kubelet, containerd, runc), through
the HTTP API, and logs and exec through OpenShell's door; a provider's rotation seen inside the
container: what tests/test_kube_exec.py and tests/test_kube_files.py prove only up to the
apiserver (kwok's node runs no containers). One sandbox on the real node serves the module.

Fails (never skips) when the node is missing (tests/test_kubernetes_real_node.py's fixture).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import apikit
import httpx
import pytest
import pytest_asyncio
from apikit import create_body, unique
from files_support import FILES, Sandbox, members_of, tar_of, tokens
from google.protobuf.timestamp_pb2 import Timestamp
from harness import eventually
from kube_support import (
    Admin,
    admin_fixture,  # noqa: F401  (the module's admin client)
    ns_fixture,  # noqa: F401  (the module's namespace)
)
from openshell_support import Gateway, auth, serving_door
from openshell_support import call as unary
from pydantic import SecretStr
from test_kubernetes_real_node import (
    IMAGE,
    logs_of,
    node_driver,
    node_fixture,  # noqa: F401  (the real node, once Ready)
    node_settings,
)

from drivers.kube_exec import EXEC_GRACE
from services.common.settings import Settings
from services.localstack.kube_node import PAUSE_IMAGE
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import served_pb2
from services.openshell.proto.openshell_pb2_grpc import OpenShellStub
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os0
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

# The box's agent: two lines of output (one on stderr), then `sleep` as the Pod's PID 1.
BOX_AGENT = ["sh", "-c", "echo box-out; echo box-err >&2; exec sleep 3600"]
CREDENTIALS_KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())


@pytest_asyncio.fixture(scope="module", loop_scope="session", name="box")
async def box_fixture(
    settings: Settings, admin: Admin, ns: str, node: str
) -> AsyncIterator[Sandbox]:
    """An API over the Kubernetes driver with one Ready sandbox on the real node."""
    driver = node_driver(admin, ns)
    update = node_settings(settings, admin, ns) | {
        "exec_output_max_bytes": 1 << 20,
        "credentials_key": CREDENTIALS_KEY,
    }
    name = unique("rx")
    service = {"metadata": {"name": "agentdb"}, "spec": {"ports": [{"port": 5432}]}}
    await admin.core.create_namespaced_service(ns, service)  # see the service-links test
    try:
        async with apikit.running_api(
            driver, settings_update=update, token_store=tokens()
        ) as running:
            body = create_body(name, image=IMAGE, command=BOX_AGENT)
            async with running.client() as c:
                r = await c.post("/v1/sandboxes", params={"wait": 60}, json=body)
                assert r.status_code == 201, r.text
            await running.wait_phase(name, "Ready", timeout=60)
            (pod,) = await admin.pods(ns, name)
            assert pod["spec"]["nodeName"] == node
            async with running.client() as c:  # its output written: the log tests read it
                await logs_of(c, name, lambda lines: len(lines) == 2)
            yield Sandbox(running, name)
    finally:
        await admin.remove_everything_of(ns, name)
        await driver.close()


async def run(box: Sandbox, command: list[str], **fields: Any) -> dict[str, Any]:
    async with box.api.client() as c:
        r = await c.post(f"/v1/sandboxes/{box.name}/exec", json={"command": command, **fields})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


# A zombie is gone too: the Pod's PID 1 (the agent, `sleep`) reaps no orphan it inherits.
_ALIVE = 'state=$(cut -d" " -f3 "/proc/$(cat "$1")/stat" 2>/dev/null) && [ "$state" != Z ]'


async def alive(box: Sandbox, pid_file: str) -> bool:
    """Whether the process whose PID ``pid_file`` holds still runs in the container."""
    answer = await run(box, ["sh", "-c", _ALIVE, "sh", pid_file])
    return bool(answer["exit_code"] == 0)


async def wait_gone(box: Sandbox, pid_file: str, what: str) -> None:
    """Wait for the process of ``pid_file`` (which must exist: the command started) to end."""
    assert (await run(box, ["cat", pid_file]))["exit_code"] == 0, "the command never started"

    def gone(running: bool) -> bool:
        return not running

    await eventually(lambda: alive(box, pid_file), gone, timeout=15, what=what)


async def test_exec_gives_the_exit_code_and_stdout_and_stderr_apart(box: Sandbox) -> None:
    answer = await run(box, ["sh", "-c", "echo out; echo err >&2; echo more; exit 3"])
    assert (answer["exit_code"], answer["timed_out"]) == (3, False)
    assert (answer["stdout"], answer["stderr"]) == ("out\nmore\n", "err\n")
    assert (await run(box, ["true"]))["exit_code"] == 0
    missing = await run(box, ["no-such-program"])  # as `podman exec` says it
    assert missing["exit_code"] == 127 and "no-such-program" in missing["stderr"], missing


async def test_the_namespaces_services_are_not_in_the_sandboxs_environment(box: Sandbox) -> None:
    # The kubelet gives a Pod <SERVICE>_PORT=tcp://<ip>:<port> for every Service of its
    # namespace unless told not to: addresses of the namespace's services, and values an agent
    # reading its own AGENTDB_PORT would take for a port number.
    env = (await run(box, ["env"]))["stdout"]
    assert "AGENTDB_" not in env, env
    assert "KUBERNETES_SERVICE_HOST=" in env  # the cluster's own, which the kubelet always gives


async def test_exec_takes_stdin_env_and_workdir(box: Sandbox) -> None:
    answer = await run(box, ["cat"], stdin="line one\nline two\n")
    assert (answer["exit_code"], answer["stdout"]) == (0, "line one\nline two\n")
    answer = await run(
        box,
        ["sh", "-c", 'echo "$GREETING|$(pwd)"'],
        env={"GREETING": "hello world"},
        workdir="/tmp",
    )
    assert (answer["exit_code"], answer["stdout"]) == (0, "hello world|/tmp\n")
    answer = await run(box, ["pwd"], workdir="/no/such/dir")
    assert answer["exit_code"] == 127 and "/no/such/dir" in answer["stderr"], answer
    without = await run(box, ["cat"])  # no stdin: an immediate end of input
    assert (without["exit_code"], without["stdout"]) == (0, "")


async def test_exec_streams_output_as_server_sent_events(box: Sandbox) -> None:
    command = ["sh", "-c", "echo one; echo two >&2; exit 4"]
    async with box.api.client() as c:
        r = await c.post(
            f"/v1/sandboxes/{box.name}/exec", params={"stream": "true"}, json={"command": command}
        )
    assert r.status_code == 200, r.text
    events = [
        (block.split("\n")[0].removeprefix("event: "), json.loads(block.split("\n")[1][6:]))
        for block in r.text.strip().split("\n\n")
    ]
    assert ("stdout", {"data": "one\n"}) in events and ("stderr", {"data": "two\n"}) in events
    assert events[-1] == ("exit", {"exit_code": 4, "timed_out": False})


async def test_the_timeout_ends_the_command_and_its_children_in_the_container(
    box: Sandbox,
) -> None:
    """Kubernetes cannot end an exec (closing its websocket leaves the command running, as
    this test saw on the old code): the driver signals the command's process group."""
    pid_file = f"/tmp/timed-{uuid.uuid4().hex[:8]}"
    command = ["sh", "-c", 'sleep 301 & echo $! > "$1"; wait', "sh", pid_file]
    started = time.monotonic()
    answer = await run(box, command, timeout=2)
    took = time.monotonic() - started
    assert (answer["exit_code"], answer["timed_out"]) == (None, True)
    # Both end at SIGTERM: no grace is waited out for the child, a zombie (the Pod's PID 1,
    # `sleep`, does not reap the orphan it inherits).
    assert took < 2 + EXEC_GRACE, took
    await wait_gone(box, pid_file, "the timed-out command's child gone")


async def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(box: Sandbox) -> None:
    pid_file = f"/tmp/stubborn-{uuid.uuid4().hex[:8]}"
    command = ["sh", "-c", "trap '' TERM; echo $$ > \"$1\"; while :; do sleep 0.2; done",
               "sh", pid_file]  # fmt: skip
    started = time.monotonic()
    answer = await run(box, command, timeout=1)
    took = time.monotonic() - started
    assert answer["timed_out"] is True
    assert EXEC_GRACE <= took < EXEC_GRACE + 20, took  # the answer waits for the ending
    assert not await alive(box, pid_file)


async def test_a_client_that_leaves_ends_the_command_in_the_container(box: Sandbox) -> None:
    pid_file = f"/tmp/left-{uuid.uuid4().hex[:8]}"
    command = ["sh", "-c", 'echo $$ > "$1"; echo started; exec sleep 300', "sh", pid_file]
    async with box.api.client() as c:
        request = c.build_request(
            "POST", f"/v1/sandboxes/{box.name}/exec", params={"stream": "true"},
            json={"command": command},
        )  # fmt: skip
        response = await c.send(request, stream=True)
        assert response.status_code == 200
        lines = response.aiter_lines()
        async with asyncio.timeout(30):
            async for line in lines:
                if "started" in line:
                    break
        assert await alive(box, pid_file)
        await response.aclose()  # the client leaves
    await wait_gone(box, pid_file, "the left command gone")


async def test_a_client_that_leaves_the_json_form_ends_the_command(box: Sandbox) -> None:
    pid_file = f"/tmp/left-json-{uuid.uuid4().hex[:8]}"
    command = ["sh", "-c", 'echo $$ > "$1"; exec sleep 300', "sh", pid_file]
    async with box.api.client() as c:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and goes
            await c.post(f"/v1/sandboxes/{box.name}/exec", json={"command": command},
                         timeout=httpx.Timeout(60, read=3))  # fmt: skip
    await wait_gone(box, pid_file, "the command of the client that left gone")


async def test_files_go_both_ways_as_files_and_tars(box: Sandbox) -> None:
    data = bytes(range(256)) * 64
    archive = tar_of(
        [
            ("tree", "dir", ""),
            ("tree/a.txt", "file", "alpha"),
            ("tree/sub", "dir", ""),
            ("tree/sub/b.txt", "file", "beta"),
            ("tree/link", "symlink", "a.txt"),
        ]
    )
    async with box.api.client(FILES) as c:
        r = await c.put(box.url("/content"), params={"path": "up/deep/blob.bin"}, content=data)
        assert r.status_code == 201, r.text
        assert (r.json()["path"], r.json()["size"]) == ("/workspace/up/deep/blob.bin", len(data))
        r = await c.get(box.url("/content"), params={"path": "up/deep/blob.bin"})
        assert (r.status_code, r.content) == (200, data)
        r = await c.put(box.url("/content"), params={"path": "up/deep/blob.bin"}, content=b"new")
        assert r.status_code == 200, r.text  # replaced
        r = await c.get(box.url("/content"), params={"path": "up/deep/blob.bin"})
        assert r.content == b"new"

        r = await c.put(box.url("/content"), params={"path": "t1", "format": "tar"},
                        content=archive)  # fmt: skip
        assert (r.status_code, r.json()["type"]) == (201, "dir"), r.text
        r = await c.get(box.url("/content"), params={"path": "t1/tree", "format": "tar"})
        assert r.status_code == 200, r.text
        got = members_of(r.content)
        assert (got["tree/a.txt"], got["tree/sub/b.txt"], got["tree/link"]) == (
            b"alpha", b"beta", "a.txt",
        )  # fmt: skip
        r = await c.get(box.url("/content"), params={"path": "t1/tree/a.txt", "format": "tar"})
        assert members_of(r.content) == {"a.txt": b"alpha"}


async def test_list_stat_mkdir_move_and_remove(box: Sandbox) -> None:
    async with box.api.client(FILES) as c:
        r = await c.post(box.url("/mkdir"), json={"path": "ops/x/y", "parents": True})
        assert (r.status_code, r.json()["type"]) == (201, "dir"), r.text
        r = await c.post(box.url("/mkdir"), json={"path": "ops/x", "parents": False})
        assert (r.status_code, r.json()["code"]) == (409, "ALREADY_EXISTS"), r.text
        r = await c.put(box.url("/content"), params={"path": "ops/f.txt"}, content=b"12345")
        assert r.status_code == 201, r.text
        r = await c.get(box.url(), params={"path": "ops"})
        entries = {e["name"]: e for e in r.json()["entries"]}
        assert sorted(entries) == ["f.txt", "x"]
        assert (entries["f.txt"]["type"], entries["f.txt"]["size"]) == ("file", 5)
        assert entries["x"]["type"] == "dir"
        r = await c.get(box.url("/stat"), params={"path": "ops/f.txt"})
        assert (r.status_code, r.json()["type"], r.json()["size"]) == (200, "file", 5), r.text
        r = await c.post(box.url("/move"), json={"source": "ops/f.txt", "destination": "ops/g"})
        assert (r.status_code, r.json()["name"]) == (200, "g"), r.text
        r = await c.get(box.url("/stat"), params={"path": "ops/f.txt"})
        assert (r.status_code, r.json()["code"]) == (404, "NOT_FOUND"), r.text
        r = await c.delete(box.url(), params={"path": "ops/x"})
        assert (r.status_code, r.json()["code"]) == (409, "PATH_CONFLICT"), r.text
        r = await c.delete(box.url(), params={"path": "ops/x", "recursive": True})
        assert r.status_code == 204, r.text
        r = await c.delete(box.url(), params={"path": "ops/g"})
        assert r.status_code == 204, r.text
        r = await c.get(box.url(), params={"path": "ops"})
        assert r.json()["entries"] == []


async def test_a_path_that_does_not_exist_is_not_found(box: Sandbox) -> None:
    async with box.api.client(FILES) as c:
        for answer in (
            await c.get(box.url("/content"), params={"path": "nothing/here"}),
            await c.get(box.url("/content"), params={"path": "nothing", "format": "tar"}),
            await c.get(box.url(), params={"path": "nothing"}),
            await c.get(box.url("/stat"), params={"path": "nothing"}),
            await c.delete(box.url(), params={"path": "nothing"}),
            await c.post(box.url("/move"), json={"source": "nothing", "destination": "b"}),
        ):
            assert (answer.status_code, answer.json()["code"]) == (404, "NOT_FOUND"), answer.text
            assert "/workspace/nothing" in answer.json()["message"], answer.text


async def test_a_large_file_is_streamed_both_ways(box: Sandbox) -> None:
    size = 32 << 20
    block = bytes(range(256)) * 4096  # 1 MiB

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(size // len(block)):
            yield block

    async with box.api.client(FILES) as c:
        c.timeout = httpx.Timeout(120)
        r = await c.put(box.url("/content"), params={"path": "large.bin"}, content=chunks(),
                        headers={"Content-Length": str(size)})  # fmt: skip
        assert r.status_code == 201, r.text
        assert r.json()["size"] == size, r.text
        got, digest = 0, hashlib.sha256()
        async with c.stream("GET", box.url("/content"), params={"path": "large.bin"}) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_bytes():
                got += len(chunk)
                digest.update(chunk)
        assert (got, digest.digest()) == (
            size,
            hashlib.sha256(block * (size // len(block))).digest(),
        )
        r = await c.delete(box.url(), params={"path": "large.bin"})
        assert r.status_code == 204, r.text


async def test_the_root_outside_the_workspace_is_writable_as_the_pod_has_no_read_only_root(
    box: Sandbox,
) -> None:
    async with box.api.client(FILES) as c:
        r = await c.put(box.url("/content"), params={"path": "/opt/outside.txt"}, content=b"o")
        assert (r.status_code, r.json()["path"]) == (201, "/opt/outside.txt"), r.text
        r = await c.delete(box.url(), params={"path": "/opt/outside.txt"})
        assert r.status_code == 204, r.text


async def test_an_image_without_sh_runs_the_command_as_given(
    box: Sandbox, admin: Admin, ns: str
) -> None:
    """The pause image holds nothing but catatonit: the command cannot start under ``sh``, so
    it runs as given; a program missing there is exit 127 with the runtime's message."""
    name = unique("rn")
    try:
        async with box.api.client() as c:
            body = create_body(name, image=PAUSE_IMAGE, command=["/catatonit", "-P"])
            r = await c.post("/v1/sandboxes", params={"wait": 60}, json=body)
            assert r.status_code == 201, r.text
            await box.api.wait_phase(name, "Ready", timeout=60)
            r = await c.post(f"/v1/sandboxes/{name}/exec", json={"command": ["/nope"]})
        assert r.status_code == 200, r.text
        assert r.json()["exit_code"] == 127 and "/nope" in r.json()["stderr"], r.text
        assert '"sh"' not in r.json()["stderr"], r.text
    finally:
        await admin.remove_everything_of(ns, name)


# -- providers and OpenShell's door on the real node -----------------------------------------


async def test_a_rotation_restarts_the_agent_onto_the_new_value_read_in_the_container(
    box: Sandbox, admin: Admin, ns: str, node: str
) -> None:
    """The whole provider pipeline: a provider attached to a Ready sandbox, its credential
    updated through the API; the rotation restarts the agent (AgentRestarted), whose Pod's
    env holds the new value (the kubelet resolves the new generation's Secret): `printenv`
    through the exec route reads it, and the agent printed it to its log."""
    name, provider = unique("rp"), unique("rp-p")
    first, second = f"one-{secrets.token_hex(6)}", f"two-{secrets.token_hex(6)}"
    show = ["sh", "-c", 'echo "key=$API_KEY"; exec sleep 3600']
    echo_key = ["sh", "-c", 'echo "$API_KEY"']  # the image (busybox) has no printenv
    try:
        async with box.api.client() as c:
            r = await c.post(
                "/v1/providers", json={"name": provider, "credentials": {"API_KEY": first}}
            )
            assert r.status_code == 201, r.text
            body = create_body(name, image=IMAGE, command=show)
            body["providers"] = [provider]
            r = await c.post("/v1/sandboxes", params={"wait": 60}, json=body)
            assert r.status_code == 201, r.text
            await box.api.wait_phase(name, "Ready", timeout=60)
            sandbox = Sandbox(box.api, name)
            assert (await run(sandbox, echo_key))["stdout"] == f"{first}\n"

            r = await c.put(
                f"/v1/providers/{provider}/credentials", json={"credentials": {"API_KEY": second}}
            )
            assert r.status_code == 200, r.text
            await eventually(
                lambda: c.get(f"/v1/sandboxes/{name}"),
                lambda resp: (resp.json()["phase"], resp.json()["generation"]) == ("Ready", 2),
                timeout=60, what=f"{name} restarted at generation 2",
            )  # fmt: skip
            history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
            assert [e for h in history for e in h["events"]].count("AgentRestarted") == 1
            (pod,) = await admin.pods(ns, name)
            assert (pod["metadata"]["name"].endswith("-g2"), pod["spec"]["nodeName"]) == (
                True, node,
            )  # fmt: skip
            assert (await run(sandbox, echo_key))["stdout"] == f"{second}\n"
            r = await c.get(f"/v1/sandboxes/{name}/logs")
            assert r.status_code == 200, r.text
            assert [json.loads(line)["text"] for line in r.text.splitlines()] == [f"key={second}"]
    finally:
        await admin.remove_everything_of(ns, name)


@pytest_asyncio.fixture(scope="module", loop_scope="session", name="door")
async def door_fixture(box: Sandbox) -> AsyncIterator[Gateway]:
    """OpenShell's door beside the box's API, as `sandstream up` serves it: the API's exec
    driver (the Kubernetes driver's, from the settings) for both doors."""
    execs = box.api.app.state.api.exec_driver
    async with serving_door(box.api.env, execs) as (channel, server, commands):
        stub = OpenShellStub(channel)
        yield Gateway(stub, channel, server, None, [], box.api.env, commands)


async def box_id(box: Sandbox) -> str:
    async with box.api.client() as c:
        found: str = (await c.get(f"/v1/sandboxes/{box.name}")).json()["id"]
    return found


async def test_openshell_get_sandbox_logs_reads_the_containers_output(
    box: Sandbox, door: Gateway
) -> None:
    """Both generations' GetSandboxLogs (by id, by name): the lines the agent wrote on the
    node, stdout's and stderr's (both with the target stdout); ``since`` before the epoch
    answers them all; ``lines`` is a tail."""
    sandbox_id = await box_id(box)
    scope = dm1.WorkspaceSelector(workspace="default")
    asks = [
        os0.GetSandboxLogsRequest(sandbox_id=sandbox_id),
        os0.GetSandboxLogsRequest(sandbox_id=sandbox_id, since_ms=-86_400_000),
        os1.GetSandboxLogsRequest(sandbox=box.name, workspace_scope=scope),
        os1.GetSandboxLogsRequest(
            sandbox=box.name, workspace_scope=scope, since_time=Timestamp(seconds=-86_400)
        ),
    ]
    for request in asks:
        answer = await unary(door, "GetSandboxLogs", request, served_pb2.GetSandboxLogsResponse)
        assert sorted(line.message for line in answer.logs) == ["box-err", "box-out"], request
        assert {line.sandbox_id for line in answer.logs} == {sandbox_id}
        # The kubelet does not tell the streams apart: every line's target is stdout.
        assert {line.target for line in answer.logs} == {"stdout"}
    last = os0.GetSandboxLogsRequest(sandbox_id=sandbox_id, lines=1)
    answer = await unary(door, "GetSandboxLogs", last, served_pb2.GetSandboxLogsResponse)
    assert [line.message for line in answer.logs] in (["box-out"], ["box-err"]), answer


async def test_openshell_exec_sandbox_runs_in_the_container(box: Sandbox, door: Gateway) -> None:
    """ExecSandbox on the real node: stdin, environment and workdir reach the command; its
    stdout and stderr come apart, then its exit code; a missing program is exit 127."""
    sandbox_id = await box_id(box)
    script = 'cat; printf "|$GREETING|$(pwd)"; printf err >&2; exit 7'
    request = pb.ExecSandboxRequest(
        sandbox_id=sandbox_id, command=["sh", "-c", script], stdin=b"fed",
        environment={"GREETING": "hello world"}, workdir="/tmp",
    )  # fmt: skip
    events = [e async for e in door.stub.ExecSandbox(request, metadata=auth(), timeout=60)]
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds[-1] == "exit" and kinds.count("exit") == 1, kinds
    assert events[-1].exit.exit_code == 7
    assert b"".join(e.stdout.data for e in events if e.HasField("stdout")) == (
        b"fed|hello world|/tmp"
    )
    assert b"".join(e.stderr.data for e in events if e.HasField("stderr")) == b"err"
    missing = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=["no-such-program"])
    events = [e async for e in door.stub.ExecSandbox(missing, metadata=auth(), timeout=60)]
    assert events[-1].exit.exit_code == 127, events
