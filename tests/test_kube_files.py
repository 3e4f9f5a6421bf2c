"""The Kubernetes driver's files (drivers/kube_files.py): the exec websocket's channels (stdin
sent and closed, stdout and stderr told apart, the exit from the error channel) against a
stand-in socket, and, on the local cluster, what a kwok Pod answers.

The local cluster's nodes are kwok's: they run no containers and serve no exec, so a real
download or upload through a Pod cannot run here. What is proven on the cluster: the exec
request reaches the apiserver for the right Pod and container, and its refusal (no kubelet)
or a missing Pod comes back as a FilesError, which the API answers 409 or 503 (never a 500,
never a hang).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from kube_support import (
    Admin,
    Keys,
    admin_fixture,  # noqa: F401  (the module's admin client)
    driver_config,
    keys_fixture,  # noqa: F401  (the test's sandbox names)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
    wait_pods,
)

from drivers.files import FilesError
from drivers.kube_files import CLOSE, ERROR, STDERR, STDIN, STDOUT, KubeFiles, _exchange, exit_of
from drivers.protocol import DriverError, ExecExit, ExecOutput, LaunchSpec
from events.common import SandboxSpec


class Message:
    def __init__(self, channel: int, data: bytes) -> None:
        self.type = aiohttp.WSMsgType.BINARY
        self.data = bytes([channel]) + data


class StandInSocket:
    """Answers after stdin is closed: what a command reading its input to the end does."""

    def __init__(self, replies: list[Message]) -> None:
        self.sent: list[bytes] = []
        self.closed = False
        self._replies = replies
        self._input_closed = asyncio.Event()

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)
        if data == bytes([CLOSE, STDIN]):
            self._input_closed.set()

    async def close(self) -> None:
        self.closed = True
        self._input_closed.set()

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Message]:
        await self._input_closed.wait()
        if self.closed:
            return
        for reply in self._replies:
            yield reply


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


EXIT_2 = {"causes": [{"reason": "ExitCode", "message": "2"}]}
FAILED_WITH_2 = json.dumps({"status": "Failure", "reason": "NonZeroExitCode", "details": EXIT_2})


async def test_stdin_is_sent_on_channel_0_then_closed_and_the_output_is_told_apart() -> None:
    socket = StandInSocket([Message(STDOUT, b"out"), Message(STDERR, b"err"),
                            Message(ERROR, FAILED_WITH_2.encode())])  # fmt: skip
    events = [e async for e in _exchange(socket, chunks(b"ab", b"cd"))]
    assert socket.sent == [b"\0ab", b"\0cd", bytes([CLOSE, STDIN])]
    assert events == [ExecOutput("stdout", b"out"), ExecOutput("stderr", b"err"), ExecExit(2)]


async def test_a_failing_upload_closes_the_socket_and_is_raised() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"part"
        raise RuntimeError("client left")

    socket = StandInSocket([])
    with pytest.raises(RuntimeError, match="client left"):
        async for _ in _exchange(socket, failing()):
            pass
    assert socket.closed and bytes([CLOSE, STDIN]) not in socket.sent


class ResetSocket(StandInSocket):
    """A connection reset after the input: the status, if any was sent, discarded unread."""

    def __init__(self, replies: list[Message]) -> None:
        super().__init__(replies)
        self.reset = ConnectionResetError("Connection reset by peer")

    def exception(self) -> BaseException:
        return self.reset

    async def _messages(self) -> AsyncIterator[Message]:
        async for reply in super()._messages():
            yield reply
        failed = Message(0, b"")
        failed.type = aiohttp.WSMsgType.ERROR
        yield failed


async def test_a_stream_reset_before_its_status_is_an_error_not_exit_0() -> None:
    socket = ResetSocket([Message(STDOUT, b"partial")])
    events: list[object] = []
    with pytest.raises(DriverError, match="cut off: ConnectionResetError"):
        async for event in _exchange(socket, chunks(b"tar")):
            events.append(event)
    assert events == [ExecOutput("stdout", b"partial")]


async def test_a_stream_closed_without_a_status_is_an_error_not_exit_0() -> None:
    socket = StandInSocket([Message(STDOUT, b"out")])
    with pytest.raises(DriverError, match="ended before the command's exit status"):
        async for _ in _exchange(socket, chunks(b"x")):
            pass


def test_the_exit_of_a_status() -> None:
    assert exit_of(b'{"status": "Success"}') == 0
    assert exit_of(FAILED_WITH_2.encode()) == 2
    failure = b'{"status": "Failure", "message": "executable file not found in $PATH"}'
    assert exit_of(failure) == "executable file not found in $PATH"


@pytest_asyncio.fixture(loop_scope="session")
async def files(admin: Admin, ns: str) -> AsyncIterator[KubeFiles]:
    source = KubeFiles(driver_config(admin, ns))
    try:
        yield source
    finally:
        await source.close()


async def test_a_missing_pod_answers_not_running(files: KubeFiles) -> None:
    with pytest.raises(FilesError) as caught:
        await files.stat(f"absent-{uuid.uuid4().hex[:8]}", 1, "/workspace")
    assert caught.value.kind == "not_running", caught.value.message


async def test_a_kwok_pod_serves_no_exec_and_says_so(
    admin: Admin, ns: str, keys: Keys, files: KubeFiles
) -> None:
    driver = new_driver(admin, ns)
    key = keys()
    try:
        spec = SandboxSpec(image="registry.example/agent:1", command=["sleep", "3600"])
        await driver.launch(LaunchSpec(key, uuid.uuid4(), 1, f"rid-{key}", spec))
        await wait_pods(admin, ns, key, lambda pods: any(
            p["status"].get("phase") == "Running" for p in pods), "the Pod to run")  # fmt: skip
        calls: list[Any] = [
            files.stat(key, 1, "/workspace"),
            files.list(key, 1, "/workspace", 10),
            files.write_tar(key, 1, "/workspace/x", chunks(b"\0" * 1024)),
        ]
        for call in calls:
            with pytest.raises(FilesError) as caught:
                async with asyncio.timeout(30):
                    await call
            assert caught.value.kind in ("not_running", "unavailable"), caught.value.message
            assert f"exec in Pod sandstream-{key}-g1:" in caught.value.message
            # the kwok node's kubelet (nobody listens), or, for the call with input, a stream
            # the apiserver reset over the unread input, its status discarded: never a success
            said = caught.value.message
            assert "10250" in said or (call is calls[2] and "the stream" in said), said
        with pytest.raises(FilesError):
            async with asyncio.timeout(30):
                await anext(aiter(files.read_tar(key, 1, "/workspace")))
    finally:
        await driver.close()
