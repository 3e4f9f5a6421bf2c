"""The driver the exec doors run commands through (the HTTP API's exec, OpenShell's
ExecSandbox), built from the settings like the log sources: Podman's, when the sandboxes run
on Podman; none otherwise (the Kubernetes driver has no exec yet, so both doors answer that
the driver cannot exec, rather than with a Podman socket's error).
"""

from __future__ import annotations

from drivers.podman import PodmanDriver
from services.common.settings import Settings
from services.executor.backends import podman_driver


def exec_source(settings: Settings) -> PodmanDriver | None:
    """The exec-capable driver of ``settings``' driver, or None; the caller closes it."""
    return podman_driver(settings) if settings.driver == "podman" else None
