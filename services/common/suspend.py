"""Whether the configured driver can keep a sandbox's workspace through a suspend.

The API refuses a suspend it cannot honour before accepting it (412 naming why), and the
Kubernetes driver refuses it as well, so both doors and an executor configured apart agree.
The API refuses an idle timeout it could not act on the same way: on a sandbox, and on a warm
pool's template (its members, once claimed, are suspended when idle).
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


def members_suspend_refusal(settings: Settings, pool: str) -> str | None:
    """Why a member of warm pool ``pool`` may not be suspendable under ``settings`` (None:
    every member can be). Members are named ``<pool>-<8 random>``: when the route prefix is
    longer than ``<pool>-`` some of them are routed and some not, so both backends count."""
    stem = f"{pool}-"
    prefix = settings.driver_route_prefix
    names = [stem, prefix] if prefix and prefix.startswith(stem) else [stem]
    return next((why for n in names if (why := suspend_refusal(settings, n)) is not None), None)
