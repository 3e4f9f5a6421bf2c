"""The runtime log readers of the configured backends, built from the settings like the
drivers (backends.py): Podman's API, the Kubernetes API, or both behind the routing prefix.

The API processes read logs through these (``GET /v1/sandboxes/{name}/logs``, OpenShell's
``GetSandboxLogs``): a read-only capability of the backend, never a lifecycle call.
"""

from __future__ import annotations

from drivers.logs import LogSource, NoLogs, RoutedLogs
from drivers.podman_logs import PodmanLogs
from services.common.settings import Settings
from services.executor.backends import kube_config


def log_source(settings: Settings) -> LogSource:
    """The log source of ``settings``' driver (with its routing prefix, if any)."""
    default = _backend(settings, settings.driver)
    if settings.driver_route_prefix is None:
        return default
    routed = _backend(settings, settings.driver_route)
    return RoutedLogs(default, routed, settings.driver_route_prefix)


def _backend(settings: Settings, name: str) -> LogSource:
    if name == "kubernetes":
        from drivers.kube_logs import KubeLogs  # kubernetes-asyncio only when used

        return KubeLogs(kube_config(settings))
    if name == "fake":
        return NoLogs("the fake driver keeps no logs")
    return PodmanLogs(settings.podman_url)
