"""OpenShell's official Python SDK, both lines, against `sandstream up` on real Podman.

Each version runs in its own virtualenv (services/openshell/sdk.py: made from PyPI on the
first run, then cached) and drives its own ``SandboxClient`` through health, create, wait until
ready, exec, stop, start, list (a page of one at a time), get, logs, delete and wait until
deleted, against a `sandstream up --no-stack` in an isolated environment
(tests/openshell_sdk_lifecycle.py is the script it runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor_pb2 import FileDescriptorProto

from services.common.settings import Settings
from services.openshell.conformance import running_up
from services.openshell.proto import vendor
from services.openshell.sdk import VERSIONS, sdk_python

SCRIPT = Path(__file__).with_name("openshell_sdk_lifecycle.py")


def run_sdk(
    python: Path, endpoint: str, name: str, script: Path = SCRIPT
) -> dict[str, list[dict[str, Any]]]:
    host = endpoint.removeprefix("http://")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    result = subprocess.run(
        [str(python), str(script), host, name],
        capture_output=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-4000:]
    steps: dict[str, list[dict[str, Any]]] = {}
    for line in result.stdout.decode().splitlines():
        record = json.loads(line)
        steps.setdefault(record.pop("step"), []).append(record)
    return steps


@pytest.mark.parametrize("version", VERSIONS)
async def test_the_official_sdk_runs_a_whole_lifecycle(
    version: str, settings: Settings, tmp_path: Path
) -> None:
    python = await asyncio.to_thread(sdk_python, settings.cache_dir, version)
    # A name of this run's own: the worker's pid comes again in a later run (pids wrap), and
    # a runtime a killed run left under the name (generation 2: the lifecycle restarts it)
    # makes the launch of generation 1 "superseded", an Error before Ready.
    name = f"sdk-{version.replace('.', '-')}-{uuid.uuid4().hex[:8]}"
    async with running_up(settings, tmp_path) as up:
        steps = await asyncio.to_thread(run_sdk, python, up.endpoint, name)
    assert steps["health"][0]["status"] == 1  # SERVICE_STATUS_HEALTHY
    sandbox_id = steps["create"][0]["id"]
    assert steps["wait_ready"][0]["phase"] == 2  # READY
    assert steps["exec"][0] == {"exit_code": 3, "stdout": "exec-ok\n"}
    assert steps["stop"][0]["id"] == sandbox_id
    assert steps["start"][0] == {"id": sandbox_id, "phase": 2}
    listed = steps["list"][0]
    assert sorted(listed["names"]) == [name, f"{name}-b"] and listed["pages"] >= 2
    assert steps["get"][0]["id"] == sandbox_id
    lines = steps["logs"][0]["lines"]
    assert "sdk-line-one" in lines and "sdk-line-two" in lines
    if version.startswith("0.0."):
        assert [d["outcome"] for d in steps["delete"]] == [True, True]
    else:
        assert [d["outcome"] for d in steps["delete"]] == ["ACCEPTED", "ACCEPTED"]
        assert steps["delete_missing"][0]["outcome"] == "ALREADY_ABSENT"
    assert steps["wait_deleted"][0]["gone"] is True


@pytest.mark.parametrize("version", VERSIONS)
def test_the_vendored_protocol_is_the_installed_sdks(version: str, settings: Settings) -> None:
    """vendored/openshell-<version>.binpb is exactly what the SDK's wheel compiled (up to the
    documented renames: file names, packages, options.proto left out)."""
    python = sdk_python(settings.cache_dir, version)
    found = subprocess.run(
        [str(python), "-c", "import openshell, os; print(os.path.dirname(openshell.__file__))"],
        capture_output=True,
        check=True,
        text=True,
    )
    proto_dir = Path(found.stdout.strip()) / "_proto"
    files = [
        FileDescriptorProto.FromString(
            vendor.serialized_file((proto_dir / f"{stem}_pb2.py").read_text())
        )
        for stem in ("datamodel", "sandbox", "openshell")
    ]
    expected = vendor.rename(files, version).SerializeToString(deterministic=True)
    assert (vendor.VENDORED_DIR / f"openshell-{version}.binpb").read_bytes() == expected
