"""Container backends behind one async protocol (see drivers/protocol.py and docs/drivers.md)."""

from drivers.protocol import (
    Driver,
    DriverError,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
    operation_result,
)

__all__ = [
    "Driver",
    "DriverError",
    "LaunchResult",
    "LaunchSpec",
    "OpResult",
    "RuntimeInfo",
    "WatchObservation",
    "operation_result",
]
