"""The driver the exec doors run commands through (the HTTP API's exec, OpenShell's
ExecSandbox), built from the settings like the log sources: Podman's driver, or the Kubernetes
driver's exec (drivers/kube_exec.py); none for the fake driver (the doors then answer that the
driver cannot exec, rather than with a socket's error).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.settings import Settings
from services.executor.backends import kube_config, podman_driver

if TYPE_CHECKING:
    from drivers.kube_exec import KubeExec
    from drivers.podman import PodmanDriver


def exec_source(settings: Settings) -> PodmanDriver | KubeExec | None:
    """The exec-capable driver of ``settings``' driver, or None; the caller closes it."""
    if settings.driver == "podman":
        return podman_driver(settings)
    if settings.driver == "kubernetes":
        from drivers.kube_exec import KubeExec  # kubernetes-asyncio only when used

        return KubeExec(kube_config(settings))
    return None
