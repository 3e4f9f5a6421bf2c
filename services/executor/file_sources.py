"""The file sources of the configured backends, built from the settings like the log sources
(log_sources.py): Podman's archive and exec APIs, the Kubernetes exec subresource; the fake
driver serves none.

The API processes reach a Ready sandbox's files through these (``/v1/sandboxes/{name}/files``):
a capability of the backend beside the lifecycle, never a lifecycle call.
"""

from __future__ import annotations

from drivers.files import FilesBackend, FileSource, NoFiles, RoutedFiles
from drivers.podman_files import PodmanFiles
from services.common.settings import Settings
from services.executor.backends import kube_config


def file_source(settings: Settings) -> FilesBackend:
    """The file source of ``settings``' driver (with its routing prefix, if any)."""
    default = _backend(settings, settings.driver)
    if settings.driver_route_prefix is None:
        return default
    routed = _backend(settings, settings.driver_route)
    return RoutedFiles(default, routed, settings.driver_route_prefix)


def _backend(settings: Settings, name: str) -> FileSource:
    if name == "kubernetes":
        from drivers.kube_files import KubeFiles  # kubernetes-asyncio only when used

        return KubeFiles(kube_config(settings))
    if name == "fake":
        return NoFiles("the fake driver keeps no files")
    return PodmanFiles(settings.podman_url)
