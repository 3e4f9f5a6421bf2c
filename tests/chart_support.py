"""Helpers for the Helm chart's tests: the helm binary (built by `make helm`), rendering the
chart into manifests, and finding objects among them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.settings import PROJECT_ROOT, Settings
from services.localstack.helm_build import helm_path

CHART = PROJECT_ROOT / "deploy" / "helm" / "sandstream"
ROLES = ("api", "processor", "executor", "watcher", "scheduler", "provider-sync")


def helm_binary(settings: Settings) -> Path:
    """The helm binary; fails (never skips) with the command that builds it."""
    path = helm_path(settings)
    if not path.exists():
        pytest.fail(
            f"no helm at {path}: run `make helm` (python -m services.localstack.helm_build)"
        )
    return path


def flatten(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``--set-string``-free ``--set-json`` arguments for nested values."""
    import json

    return [f"--set-json={prefix}{k}={json.dumps(v)}" for k, v in values.items()]


def helm(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_binary(settings)), *args], capture_output=True, text=True, check=False
    )


def render(
    settings: Settings,
    values: Mapping[str, Any],
    release: str = "sst",
    namespace: str = "default",
    extra: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``values``: its objects, hooks included."""
    result = helm(
        settings, "template", release, str(CHART), "--namespace", namespace,
        *flatten(values), *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def of_kind(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def component(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"]["labels"]["app.kubernetes.io/component"])


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container's environment: plain values, and ``{"secret": name, "key": key}`` for a
    value from a Secret."""
    found: dict[str, Any] = {}
    for entry in container.get("env") or []:
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
        found[entry["name"]] = {"secret": ref["name"], "key": ref["key"]} if ref else entry["value"]
    return found
