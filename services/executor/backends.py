"""Drivers built from the settings: the one place where ``Settings`` meet a driver's arguments.

``SANDSTREAM_DRIVER`` names the backend (``podman``, the default, ``kubernetes``, or ``fake``:
the in-memory fake, for tests and fault-injection runs of the executor process); the
Kubernetes driver's configuration comes from ``SANDSTREAM_KUBE_*``. kubernetes-asyncio is
imported only when that driver is used.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drivers.podman import PodmanDriver
from drivers.protocol import Driver
from drivers.routing import RoutingDriver
from services.common.settings import Settings

if TYPE_CHECKING:
    from drivers.kubernetes import KubeConfig, KubernetesDriver


def podman_driver(settings: Settings, **kwargs: Any) -> PodmanDriver:
    """A Podman driver for the configured API socket and default stop timeout."""
    kwargs.setdefault("stop_timeout", settings.stop_timeout_seconds)
    kwargs.setdefault("exec_mode", settings.podman_exec)
    kwargs.setdefault("runc_root", settings.podman_runc_root)
    if settings.podman_suspend_memory:
        kwargs.setdefault("checkpoint_dir", settings.podman_checkpoint_path)
    return PodmanDriver(settings.podman_url, **kwargs)


def kube_config(settings: Settings) -> KubeConfig:
    """The Kubernetes driver's configuration; ValueError names a malformed setting."""
    from drivers.kubernetes import KubeConfig, parse_node_selector, parse_tolerations

    return KubeConfig(
        namespace=settings.kube_namespace,
        kubeconfig=settings.kube_config,
        context=settings.kube_context,
        service_account=settings.kube_service_account,
        image_pull_policy=settings.kube_image_pull_policy,
        cpu_limit=settings.kube_cpu_limit,
        memory_limit=settings.kube_memory_limit,
        node_selector=parse_node_selector(settings.kube_node_selector),
        tolerations=parse_tolerations(settings.kube_tolerations),
        storage_class=settings.kube_storage_class,
        workspace_size=settings.kube_workspace_size,
        stop_timeout=float(settings.stop_timeout_seconds),
    )


def kubernetes_driver(settings: Settings) -> KubernetesDriver:
    from drivers.kubernetes import KubernetesDriver

    return KubernetesDriver(kube_config(settings))


def driver_from_settings(settings: Settings) -> Driver:
    """The driver ``settings.driver`` names, or, with ``driver_route_prefix``, a routing
    driver that runs the names with that prefix on ``driver_route`` instead (ValueError when
    both are one backend, or for a malformed Kubernetes setting)."""
    if settings.driver_route_prefix is None:
        return _backend(settings, settings.driver)
    if settings.driver_route == settings.driver:
        raise ValueError(f"SANDSTREAM_DRIVER_ROUTE names the default driver {settings.driver!r}")
    if not settings.driver_route_prefix:
        raise ValueError("SANDSTREAM_DRIVER_ROUTE_PREFIX is empty: it would route every name")
    default = _backend(settings, settings.driver)
    routed = _backend(settings, settings.driver_route)
    return RoutingDriver(default, routed, settings.driver_route_prefix)


def _backend(settings: Settings, name: str) -> Driver:
    if name == "kubernetes":
        return kubernetes_driver(settings)
    if name == "fake":
        return fake_driver(settings)
    return podman_driver(settings)


def fake_driver(settings: Settings) -> Driver:
    """The fake, timed by the wall clock: its runtimes in this process only, or in
    ``settings.fake_state_file``, shared by every process that names it."""
    from datetime import UTC, datetime

    from drivers.fake import FakeDriver
    from drivers.fake_shared import SharedFakeDriver

    options: dict[str, Any] = {
        "clock": lambda: datetime.now(UTC),
        "stop_timeout": float(settings.stop_timeout_seconds),
    }
    if settings.fake_state_file is not None:
        return SharedFakeDriver(settings.fake_state_file, **options)
    return FakeDriver(**options)


def describe_driver(settings: Settings, show: Callable[[Path], str] = str) -> str:
    """One line for banners: which backend, where (paths through ``show``)."""
    if settings.driver_route_prefix is not None:
        default = describe_driver(settings.model_copy(update={"driver_route_prefix": None}), show)
        routed = describe_driver(
            settings.model_copy(
                update={"driver": settings.driver_route, "driver_route_prefix": None}
            ),
            show,
        )
        return f"{default}; names starting {settings.driver_route_prefix!r}: {routed}"
    if settings.driver == "kubernetes":
        where = show(settings.kube_config) if settings.kube_config else "default kubeconfig"
        return f"kubernetes (namespace {settings.kube_namespace}, {where})"
    if settings.driver == "fake" and settings.fake_state_file is not None:
        return f"fake (shared through {show(settings.fake_state_file)})"
    if settings.driver == "fake":
        return "fake (in memory, this process only)"
    return f"podman ({show(settings.podman_socket_path)})"
