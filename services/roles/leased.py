"""Readiness of a single-active role: the holder is active, the others standbys."""

from __future__ import annotations

from typing import Any

from services.common.health import Readiness
from services.common.lease import Lease


def lease_readiness(lease: Lease | None, active_detail: dict[str, Any]) -> Readiness:
    """Ready when active, or a standby that can reach PostgreSQL to take the lease over."""
    if lease is None:
        return Readiness(False, "starting")
    detail: dict[str, Any] = {"lease": lease.name, "active": lease.held,
                              "acquisitions": lease.acquisitions}  # fmt: skip
    if lease.held:
        return Readiness(True, "", {**detail, **active_detail})
    if lease.last_error is not None:
        return Readiness(False, f"cannot try the lease: {lease.last_error}", detail)
    return Readiness(True, "", detail)
