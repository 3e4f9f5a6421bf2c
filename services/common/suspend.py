"""Whether the configured driver can keep a sandbox's workspace through a suspend.

The API refuses a suspend it cannot honour before accepting it (409 naming why), and the
Kubernetes driver refuses it as well, so both doors and an executor configured apart agree.
"""

from __future__ import annotations

from drivers.kube_objects import WORKSPACE_DIES_WITH_POD
from services.common.settings import Settings


def suspend_refusal(settings: Settings, key: str) -> str | None:
    """Why sandbox ``key`` cannot be suspended under ``settings`` (None: it can)."""
    prefix = settings.driver_route_prefix
    routed = bool(prefix) and key.startswith(prefix or "")
    backend = settings.driver_route if routed else settings.driver
    if backend == "kubernetes" and settings.kube_storage_class is None:
        return WORKSPACE_DIES_WITH_POD
    return None
