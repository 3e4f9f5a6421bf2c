"""OpenShell's template RPCs through the official SDK 0.1.5 (the yardstick) against `sandstream
up` on real Podman: create, get, list with a label selector, delete (allow_missing), the
refusals, and a sandbox created from a template (its provenance, its environment in an exec).
tests/openshell_sdk_templates.py is the script the SDK's Python runs."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from test_openshell_sdk import run_sdk

from services.common.settings import Settings
from services.openshell.conformance import running_up
from services.openshell.sdk import sdk_python

SCRIPT = Path(__file__).with_name("openshell_sdk_templates.py")


async def test_the_official_sdk_0_1_5_drives_templates_and_creates_from_one(
    settings: Settings, tmp_path: Path
) -> None:
    python = await asyncio.to_thread(sdk_python, settings.cache_dir, "0.1.5")
    name = f"sdk-tpl-{uuid.uuid4().hex[:8]}"
    tpl = f"{name}-tpl"
    async with running_up(settings, tmp_path) as up:
        steps = await asyncio.to_thread(run_sdk, python, up.endpoint, name, SCRIPT)
    made = steps["create"][0]
    assert made == {"name": tpl, "revision": 1, "labels": {"team": "research"},
                    "image": settings.sandbox_image, "environment": {"MODE": "base", "KEEP": "1"},
                    "cpu": "500m", "memory": "256Mi"}  # fmt: skip
    assert steps["get"][0] == made
    listed = steps["list"][0]
    assert (listed["names"], listed["selected"], listed["unselected"]) == ([tpl], [tpl], [])
    assert steps["create_again"][0]["code"] == "ALREADY_EXISTS"
    assert steps["create_gpu"][0]["code"] == "INVALID_ARGUMENT"
    created = steps["create_from_template"][0]
    assert created == {"labels": {"team": "research", "who": "sdk"}, "template": [tpl, "1"]}
    assert steps["exec"][0] == {"exit_code": 0, "stdout": "sdk 1\n"}
    assert steps["from_missing"][0]["code"] == "NOT_FOUND"
    assert steps["from_with_workload"][0]["code"] == "INVALID_ARGUMENT"
    assert steps["delete"][0]["outcome"] == "COMPLETED"
    assert steps["delete_missing"][0] == {"outcome": "ALREADY_ABSENT", "get": "NOT_FOUND"}
    assert steps["sandbox_after_delete"][0]["template"] == [tpl, "1"]
