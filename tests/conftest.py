"""Shared fixtures. The tests use the real local stack (`make stack` brings it up)."""

from __future__ import annotations

import pytest

from services.settings import Settings, load_settings


@pytest.fixture(scope="session")
def settings() -> Settings:
    return load_settings()
