"""Drivers built from the settings: the one place where ``Settings`` meet a driver's arguments."""

from __future__ import annotations

from typing import Any

from drivers.podman import PodmanDriver
from services.common.settings import Settings


def podman_driver(settings: Settings, **kwargs: Any) -> PodmanDriver:
    """A Podman driver for the configured API socket and default stop timeout."""
    kwargs.setdefault("stop_timeout", settings.stop_timeout_seconds)
    return PodmanDriver(settings.podman_url, **kwargs)
