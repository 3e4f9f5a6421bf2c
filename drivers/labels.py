"""The labels every driver stamps on a runtime and its workspace, and how it reads them back:
one definition for Podman containers, Kubernetes Pods and their volumes, claims and Secrets.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final
from uuid import UUID

from drivers.protocol import (
    LABEL_GENERATION,
    LABEL_IDENTITY,
    LABEL_KEY,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    LABEL_STOP_TIMEOUT,
    MANAGED_BY,
    LaunchSpec,
)
from events.common import SANDBOX_NAME_PATTERN

# Reserved for sandstream's own labels: a sandbox's labels under it are never stamped.
LABEL_PREFIX: Final = "io.sandstream."
_KEY = re.compile(SANDBOX_NAME_PATTERN)


def workspace_labels(key: str, sandbox_id: UUID) -> dict[str, str]:
    """The labels of an incarnation's objects (its workspace): marker, key, sandbox id."""
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_KEY: key, LABEL_SANDBOX_ID: str(sandbox_id)}


def incarnation_of(labels: Mapping[str, object] | None) -> tuple[str, UUID] | None:
    """(key, sandbox id) from an object's labels if sandstream made it for an incarnation
    (a runtime, a workspace, a Secret); None for anything else."""
    if not labels or labels.get(LABEL_MANAGED_BY) != MANAGED_BY:
        return None
    key = str(labels.get(LABEL_KEY, ""))
    try:
        sandbox_id = UUID(str(labels.get(LABEL_SANDBOX_ID, "")))
    except ValueError:
        return None
    return (key, sandbox_id) if _KEY.fullmatch(key) else None


def generation_labels(key: str, sandbox_id: UUID, generation: int) -> dict[str, str]:
    """The labels of a generation's objects besides its runtime (its provider values)."""
    return {**workspace_labels(key, sandbox_id), LABEL_GENERATION: str(generation)}


def runtime_labels(
    spec: LaunchSpec, *, valid: Callable[[str, str], bool] = lambda _k, _v: True
) -> dict[str, str]:
    """The sandbox's own labels (those ``valid`` for the backend), then ours. Ours win: the
    sandbox's labels under our prefix are dropped, so a spec cannot forge a marker or a stop
    timeout."""
    labels = {
        k: v for k, v in spec.spec.labels.items() if not k.startswith(LABEL_PREFIX) and valid(k, v)
    }
    labels.update(generation_labels(spec.key, spec.sandbox_id, spec.generation))
    labels[LABEL_IDENTITY] = spec.identity
    if spec.spec.stop_timeout_seconds is not None:
        labels[LABEL_STOP_TIMEOUT] = str(spec.spec.stop_timeout_seconds)
    return labels


@dataclass(frozen=True, slots=True)
class RuntimeLabels:
    """Our labels of a runtime, as read back."""

    key: str
    sandbox_id: UUID | None  # None: missing or not a UUID
    generation: int
    identity: str | None
    stop_timeout: int | None = None  # the sandbox's own grace period, if its spec set one


def parse_labels(labels: Mapping[str, object] | None) -> RuntimeLabels | None:
    """Our labels of a runtime, or None if it is not a (valid) sandstream runtime."""
    if not labels or labels.get(LABEL_MANAGED_BY) != MANAGED_BY:
        return None
    key = str(labels.get(LABEL_KEY, ""))
    try:
        generation = int(str(labels.get(LABEL_GENERATION, "")))
    except ValueError:
        return None
    if not _KEY.fullmatch(key) or generation < 1:
        return None
    try:
        sandbox_id: UUID | None = UUID(str(labels.get(LABEL_SANDBOX_ID, "")))
    except ValueError:
        sandbox_id = None
    identity = labels.get(LABEL_IDENTITY)
    return RuntimeLabels(
        key,
        sandbox_id,
        generation,
        str(identity) if identity is not None else None,
        _stop_timeout(labels.get(LABEL_STOP_TIMEOUT)),
    )


def _stop_timeout(value: object) -> int | None:
    try:
        seconds = int(str(value)) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None
