"""The Kubernetes driver's exec capability: a command in the sandbox's Pod through the exec
subresource (the ``v5.channel.k8s.io`` websocket of drivers/kube_files.py: stdin sent and
closed, stdout and stderr apart, the exit from the error channel).

Kubernetes' exec takes no environment and no working directory: with either, the command runs
through the image's ``sh`` (``cd``, then ``exec``) and ``env``, which the image must have.
Leaving the stream closes the websocket; unlike Podman's exec, nothing then signals the
command (the kubelet does not): whether it ends is up to the container runtime.
Where no kubelet serves exec (a kwok node, as in the local cluster), the stream fails with a
DriverError that carries the apiserver's reason.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Final

from drivers.kube_config import KubeConfig
from drivers.kube_files import KubeFiles
from drivers.protocol import ExecEvent

_IN_WORKDIR: Final = 'cd -- "$1" || exit 127; shift; exec "$@"'


def wrapped(
    command: builtins.list[str], env: Mapping[str, str] | None, workdir: str | None
) -> builtins.list[str]:
    """The argv that gives ``command`` its environment and working directory."""
    argv = builtins.list(command)
    if env:
        argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    if workdir:
        argv = ["sh", "-c", _IN_WORKDIR, "sh", workdir, *argv]
    return argv


async def _once(data: bytes) -> AsyncIterator[bytes]:
    if data:
        yield data


class KubeExec:
    """The ExecDriver of the Kubernetes driver's Pods (``sandstream-<key>-g<generation>``)."""

    def __init__(self, cfg: KubeConfig) -> None:
        self._pods = KubeFiles(cfg)  # its exec websocket serves commands as it serves files

    async def exec_stream(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        stdin: bytes | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        feed = None if stdin is None else _once(stdin)
        events = self._pods._events(key, generation, wrapped(command, env, workdir), feed)
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def close(self) -> None:
        await self._pods.close()
