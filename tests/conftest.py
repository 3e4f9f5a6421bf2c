"""Shared fixtures. The tests use the real local stack (`make stack` brings it up)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from podman import PodmanClient

from services.common.settings import Settings, load_settings


@pytest.fixture(scope="session")
def settings() -> Settings:
    return load_settings()


@pytest.fixture(scope="session")
def podman(settings: Settings) -> Iterator[PodmanClient]:
    """A plain Podman client, for looking behind the driver's back. Fails (never skips) when
    the Podman service or the sandbox image is missing."""
    with PodmanClient(base_url=settings.podman_url, timeout=60) as client:
        try:
            client.ping()
        except Exception as exc:
            pytest.fail(f"no Podman API at {settings.podman_url} ({exc}): run `make stack`")
        if not client.images.exists(settings.sandbox_image):
            pytest.fail(f"sandbox image {settings.sandbox_image} missing: run `make stack`")
        yield client
