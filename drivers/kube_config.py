"""The Kubernetes driver's configuration: which cluster and namespace, how sandbox Pods are made
there (``KubeConfig``), and the API client it connects with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes_asyncio import client, config

from drivers.kube_objects import PodSettings


@dataclass(frozen=True)
class KubeConfig:
    """Where the cluster is and how sandbox Pods are made there.

    ``kubeconfig`` None: ``$KUBECONFIG`` or ``~/.kube/config``, and inside a cluster the Pod's
    service account. ``storage_class`` None: the workspace is an emptyDir, which lives with
    the Pod and so does not survive a stop (docs/drivers.md).
    """

    namespace: str = "sandstream"
    kubeconfig: Path | None = None
    context: str | None = None
    service_account: str | None = None
    image_pull_policy: str = "IfNotPresent"
    cpu_limit: str | None = None
    memory_limit: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, str]] = ()
    storage_class: str | None = None
    workspace_size: str = "1Gi"
    stop_timeout: float = 10.0  # grace period when neither caller nor sandbox sets one
    launch_timeout: float = 120.0  # how long a launch waits for its Pod to run
    removal_margin: float = 30.0  # how long past the grace period a Pod may take to go
    request_timeout: float = 30.0
    watch_timeout_seconds: int = 240  # the server ends each watch after this; resumed at once
    reconnect_delay: float = 0.2
    max_reconnect_delay: float = 5.0
    max_connections: int = 256

    @property
    def pod_settings(self) -> PodSettings:
        return PodSettings(
            stop_timeout=self.stop_timeout,
            service_account=self.service_account,
            image_pull_policy=self.image_pull_policy,
            cpu_limit=self.cpu_limit,
            memory_limit=self.memory_limit,
            node_selector=dict(self.node_selector),
            tolerations=tuple(dict(t) for t in self.tolerations),
            storage_class=self.storage_class,
            workspace_size=self.workspace_size,
        )


async def api_client(cfg: KubeConfig) -> client.ApiClient:
    """A client of the cluster ``cfg`` names (the kubeconfig, else the in-cluster account)."""
    configuration = client.Configuration()
    try:
        await config.load_kube_config(
            config_file=str(cfg.kubeconfig) if cfg.kubeconfig else None,
            context=cfg.context,
            client_configuration=configuration,
            persist_config=False,
        )
    except config.ConfigException:
        if cfg.kubeconfig is not None:
            raise
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    # One connection per call in flight: many slow stops must not starve the others.
    configuration.connection_pool_maxsize = cfg.max_connections
    api = client.ApiClient(configuration)
    if not environment_proxies_or_netrc(os.environ):
        # kubernetes-asyncio opens its session with trust_env=True: aiohttp then looks up the
        # proxy variables and ~/.netrc in a thread-pool thread at every request (a thread hop
        # and ~160 µs of CPU each). With neither present that lookup finds nothing.
        api.rest_client.pool_manager._trust_env = False
    return api


def environment_proxies_or_netrc(environ: Mapping[str, str]) -> bool:
    """Whether aiohttp's ``trust_env`` could find anything here: a proxy variable (any
    ``*_proxy`` but ``no_proxy``, as urllib reads them, either case) or a netrc file
    (``$NETRC``, else ``~/.netrc``). Read once, when a client connects."""
    if any(
        value and name.lower().endswith("_proxy") and name.lower() != "no_proxy"
        for name, value in environ.items()
    ):
        return True
    netrc = environ.get("NETRC") or os.path.expanduser("~/.netrc")
    return os.path.exists(netrc)


def parse_node_selector(text: str) -> dict[str, str]:
    """``"disk=ssd,zone=a"`` -> ``{"disk": "ssd", "zone": "a"}``; ValueError names a bad part."""
    selector = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"node selector: expected KEY=VALUE, got {part!r}")
        selector[name.strip()] = value.strip()
    return selector


_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def parse_tolerations(text: str) -> list[dict[str, str]]:
    """``"dedicated=agents:NoSchedule,gpu:NoExecute"`` -> Kubernetes tolerations (a key without
    a value tolerates every value: operator Exists); ValueError names a bad part."""
    tolerations = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        taint, sep, effect = part.rpartition(":")
        key, has_value, value = taint.partition("=")
        if not sep or not key.strip() or effect not in _EFFECTS:
            raise ValueError(
                f"tolerations: expected KEY[=VALUE]:EFFECT with EFFECT one of "
                f"{', '.join(_EFFECTS)}, got {part!r}"
            )
        toleration = {"key": key.strip(), "effect": effect}
        if has_value:
            toleration |= {"operator": "Equal", "value": value.strip()}
        else:
            toleration["operator"] = "Exists"
        tolerations.append(toleration)
    return tolerations
