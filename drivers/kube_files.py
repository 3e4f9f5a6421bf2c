"""A Pod's files through the exec subresource (``pods/{name}/exec``), as ``kubectl cp`` does:
a download is ``tar -c`` read from stdout, an upload ``tar -x`` fed on stdin; the rest runs
the commands of drivers/files_exec.py. The websocket speaks ``v5.channel.k8s.io``, whose
channel 255 closes stdin, so that ``tar -x`` sees the archive end (the v4 protocol cannot).

Every byte passes through the apiserver and the kubelet; the commands run in the Pod's
container with the image's ``tar`` (a download of a symlink gives the link itself, unlike
Podman's archive, which follows it). Where no kubelet serves exec (a kwok node, as in the local
cluster, runs no containers), the exec fails and the calls answer ``not_running`` or
``unavailable`` with the apiserver's reason.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import posixpath
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Final

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.stream import WsApiClient

from drivers.files import FilesError
from drivers.files_exec import ExecFiles
from drivers.kube_config import KubeConfig, api_client
from drivers.kube_objects import CONTAINER, api_error_message, pod_name
from drivers.protocol import BackendRefused, DriverError, ExecEvent, ExecExit, ExecOutput

PROTOCOL: Final = "v5.channel.k8s.io"
STDIN, STDOUT, STDERR, ERROR, CLOSE = 0, 1, 2, 3, 255
_EXTRACT: Final = 'mkdir -p -- "$1" && exec tar -x -f - -C "$1"'


def exit_of(status: bytes) -> int | str:
    """The exit code in the error channel's Status (0 for Success), or why the exec failed."""
    try:
        parsed: dict[str, Any] = json.loads(status)
    except ValueError:
        return status.decode(errors="replace")[:1000]
    if parsed.get("status") == "Success":
        return 0
    if parsed.get("reason") == "NonZeroExitCode":
        for cause in parsed.get("details", {}).get("causes", []):
            if cause.get("reason") == "ExitCode" and str(cause.get("message", "")).isdigit():
                return int(cause["message"])
    return str(parsed.get("message") or parsed)[:1000]


def exec_refusal(pod: str, status: int | None, reason: str) -> DriverError:
    """The apiserver's refusal of an exec: a 403 (sandstream's account may not create
    ``pods/exec``) is BackendRefused, naming the permission; the rest a plain DriverError."""
    if status == 403:
        return BackendRefused(
            f"exec in Pod {pod}: the cluster refused the exec (403 {reason}); the deployment's "
            "RBAC must allow create on pods/exec"
        )
    return DriverError(f"exec in Pod {pod}: {status} {reason}", retryable=False)


class KubeFiles(ExecFiles):
    """The FileSource of the Kubernetes driver's Pods (``sandstream-<key>-g<generation>``)."""

    def __init__(self, cfg: KubeConfig) -> None:
        self.cfg = cfg
        self._ws: WsApiClient | None = None

    async def _core(self) -> client.CoreV1Api:
        if self._ws is None:
            plain = await api_client(self.cfg)
            self._ws = WsApiClient(configuration=plain.configuration)
            await plain.close()
        return client.CoreV1Api(self._ws)

    async def _events(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        stdin: AsyncIterator[bytes] | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        core = await self._core()
        name = pod_name(key, generation)
        try:
            exec_call: Any = core.connect_get_namespaced_pod_exec  # typed without _headers
            connecting: Any = await exec_call(
                name, self.cfg.namespace, command=command, container=CONTAINER,
                stdin=stdin is not None, stdout=True, stderr=True, tty=False,
                _preload_content=False, _headers={"sec-websocket-protocol": PROTOCOL},
            )  # fmt: skip
            async with connecting as socket:
                async for event in _exchange(socket, stdin):
                    yield event
        except DriverError as exc:
            raise DriverError(f"exec in Pod {name}: {exc.reason}", retryable=False) from exc
        except ApiException as exc:
            raise exec_refusal(name, exc.status, api_error_message(exc.body)) from exc
        except aiohttp.WSServerHandshakeError as exc:
            reason = "no such container" if exc.status == 404 else exc.message
            raise exec_refusal(name, exc.status, reason) from exc
        except aiohttp.ClientError as exc:
            raise DriverError(f"exec in Pod {name}: {type(exc).__name__}: {exc}",
                              retryable=True) from exc  # fmt: skip

    async def read_tar(self, key: str, generation: int, path: str) -> AsyncIterator[bytes]:
        parent, name = posixpath.split(path) if path != "/" else ("/", ".")
        command = ["tar", "-c", "-f", "-", "-C", parent or "/", "--", name]
        # A tar that fails (no such path) still writes the archive's end, zeros; held back
        # until a member shows, so that the failure comes first, never a broken archive.
        held: bytearray | None = bytearray()
        try:
            async for chunk in self._run(key, generation, command):
                if held is not None:
                    held += chunk
                    if not held.strip(b"\0"):
                        continue
                    chunk, held = bytes(held), None
                yield chunk
        except FilesError as exc:
            if held is None:
                raise
            raise FilesError(exc.kind, f"{path!r}: {exc.message}") from exc  # as Podman's says
        if held:
            yield bytes(held)

    async def write_tar(
        self, key: str, generation: int, path: str, archive: AsyncIterator[bytes]
    ) -> None:
        await self._call(key, generation, ["sh", "-c", _EXTRACT, "sh", path], stdin=archive)

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()


async def _exchange(socket: Any, stdin: AsyncIterator[bytes] | None) -> AsyncIterator[ExecEvent]:
    """The output of one exec websocket, while ``stdin`` (if any) is sent on channel 0 and then
    closed; a failure of ``stdin`` (the caller's upload) ends the exec and is raised."""
    sending: asyncio.Task[None] | None = None
    if stdin is not None:
        sending = asyncio.create_task(_send(socket, stdin))
    exit_code: int | str | None = None
    cut: BaseException | None = None  # the socket closed under the sender, or under the reader
    try:
        async for message in socket:
            if message.type == aiohttp.WSMsgType.ERROR:  # the iteration ends on the next read
                cut = socket.exception() or ConnectionError("the stream failed")
                continue
            if message.type != aiohttp.WSMsgType.BINARY or not message.data:
                continue
            channel, data = message.data[0], bytes(message.data[1:])
            if channel == STDOUT and data:
                yield ExecOutput("stdout", data)
            elif channel == STDERR and data:
                yield ExecOutput("stderr", data)
            elif channel == ERROR:
                exit_code = exit_of(data)
        if sending is not None:
            try:
                await sending  # the upload's own failure (too large, a bad member) is raised
            except (aiohttp.ClientError, ConnectionError) as exc:
                cut = cut or exc
    finally:
        if sending is not None and not sending.done():
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
    if isinstance(exit_code, str):  # the exec failed: its reason, not the sender's
        raise DriverError(exit_code, retryable=False)
    if cut is not None:
        raise DriverError(f"the stream was cut off: {type(cut).__name__}: {cut}", retryable=True)
    if exit_code is None:
        # v4 and v5 always end with a status, Success included: a stream without one was
        # closed early (a reset that discarded the status unread), so the exit is unknown.
        raise DriverError("the stream ended before the command's exit status", retryable=True)
    yield ExecExit(exit_code)


async def _send(socket: Any, stdin: AsyncIterator[bytes]) -> None:
    try:
        async for chunk in stdin:
            await socket.send_bytes(bytes([STDIN]) + chunk)
        await socket.send_bytes(bytes([CLOSE, STDIN]))
    except BaseException:
        await socket.close()  # the command sees its input cut off and stops
        raise
