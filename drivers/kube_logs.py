"""A Pod's log from the Kubernetes API (``pods/{name}/log``), for the Kubernetes driver's Pods.

The apiserver fetches a container's log from the kubelet of the Pod's node. Where no kubelet
serves it (a kwok node, as in the local cluster, runs no containers and serves no logs), the
apiserver answers an error and the read raises LogsUnavailable saying so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from drivers.kube_objects import api_error_message, pod_name
from drivers.kubernetes import KubeConfig, api_client
from drivers.logs import LogLine, LogsUnavailable, backend_since, backend_tail


def parse_line(raw: bytes) -> LogLine:
    """``<RFC 3339 time> <text>`` (``timestamps=true``); the kubelet does not tell the stream
    apart: every line is reported as stdout."""
    stamp, _, text = raw.partition(b" ")
    try:
        at = datetime.fromisoformat(stamp.decode().replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        at, text = datetime.now(UTC), raw
    return LogLine(at, "stdout", text.decode(errors="replace").removesuffix("\n"))


class KubeLogs:
    """The LogSource of the Kubernetes driver's Pods (``sandstream-<key>-g<generation>``)."""

    def __init__(self, cfg: KubeConfig) -> None:
        self.cfg = cfg
        self._api: client.ApiClient | None = None

    async def _core(self) -> client.CoreV1Api:
        if self._api is None:
            self._api = await api_client(self.cfg)
        return client.CoreV1Api(self._api)

    async def read(
        self,
        key: str,
        generation: int,
        *,
        tail: int | None = None,
        since: datetime | None = None,
        follow: bool = False,
    ) -> AsyncIterator[LogLine]:
        tail, since = backend_tail(tail), backend_since(since)
        args: dict[str, Any] = {"timestamps": True, "follow": follow, "_preload_content": False}
        if tail is not None:
            args["tail_lines"] = tail
        if since is not None:
            args["since_seconds"] = max(1, int((datetime.now(UTC) - since).total_seconds()))
        core = await self._core()
        name = pod_name(key, generation)
        status: int | None
        body: Any
        try:
            # Not preloaded: an aiohttp response whose body is read line by line. Its status
            # is not checked by the client: an error's Status object would read as a line.
            response: Any = await core.read_namespaced_pod_log(name, self.cfg.namespace, **args)
        except ApiException as exc:
            status, body = exc.status, exc.body
        else:
            if 200 <= response.status < 300:
                status, body = None, None
            else:
                status, body = response.status, await response.read()
                response.release()
        if status == 404:
            return  # no Pod of that generation: no lines
        if status is not None:
            raise LogsUnavailable(
                f"the cluster serves no log of Pod {name}: {status} {api_error_message(body)}"
            )
        try:
            async for raw in response.content:
                yield parse_line(raw)
        finally:
            response.release()

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
