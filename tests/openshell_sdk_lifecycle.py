"""Drives OpenShell's official Python SDK through a sandbox's lifecycle against a gateway.

Run by tests/test_openshell_sdk.py with the Python of an SDK virtualenv (services/openshell/
sdk.py): ``python openshell_sdk_lifecycle.py ENDPOINT NAME``. Uses only the SDK's own client
(``SandboxClient``) and, for logs (no client method in either SDK), its generated stub and
messages. Prints one JSON object per step on stdout; any failure raises (non-zero exit).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import grpc
import openshell
from openshell import SandboxClient
from openshell._proto import openshell_pb2

WORKSPACE = "default"
MAIN = ["sh", "-c", "echo sdk-line-one; echo sdk-line-two >&2; exec sleep infinity"]
NEW = not openshell.__version__.startswith("0.0.")


def step(what: str, **facts: Any) -> None:
    print(json.dumps({"step": what, **facts}), flush=True)


def exec_output(client: SandboxClient, ref: Any, name: str) -> tuple[int, str]:
    command = ["sh", "-c", "echo exec-ok; exit 3"]
    if NEW:
        result = client.exec(name, command, workspace=WORKSPACE, timeout_seconds=30)
    else:
        result = client.exec(ref.id, command, timeout_seconds=30)
    return result.exit_code, result.stdout


def listed_names(client: SandboxClient) -> tuple[list[str], int]:
    """Every sandbox, a page (of one) at a time: the names and how many pages it took."""
    if NEW:
        pages = list(client.list(workspace=WORKSPACE, page_size=1))
        return [s.name for p in pages for s in p.items], len(pages)
    names: list[str] = []
    offset = 0
    while page := client.list(workspace=WORKSPACE, limit=1, offset=offset):
        names += [s.name for s in page]
        offset += 1
    return names, offset


def logs(client: SandboxClient, ref: Any, name: str) -> list[str]:
    stub = client._stub  # the SDK's own stub: neither SDK wraps GetSandboxLogs
    if NEW:
        from openshell._proto import datamodel_pb2

        request = openshell_pb2.GetSandboxLogsRequest(
            sandbox=name,
            lines=100,
            workspace_scope=datamodel_pb2.WorkspaceSelector(workspace=WORKSPACE),
        )
    else:
        request = openshell_pb2.GetSandboxLogsRequest(
            sandbox_id=ref.id, lines=100, workspace=WORKSPACE
        )
    answer = stub.GetSandboxLogs(request, timeout=30)
    return [line.message for line in answer.logs]


def main(endpoint: str, name: str) -> None:
    client = SandboxClient(endpoint, timeout=60)
    health = client.health()
    step("health", status=int(health.status), version=health.version)
    spec = openshell_pb2.SandboxSpec(command=MAIN)
    ref = client.create(workspace=WORKSPACE, name=name, spec=spec)
    other = client.create(workspace=WORKSPACE, name=name + "-b", spec=spec)
    step("create", id=ref.id, phase=int(ref.status.phase))
    ready = client.wait_ready(name, workspace=WORKSPACE, timeout_seconds=120)
    step("wait_ready", phase=int(ready.status.phase))
    code, out = exec_output(client, ref, name)
    step("exec", exit_code=code, stdout=out)
    stopped = client.stop(name, workspace=WORKSPACE)
    client.wait_stopped(name, workspace=WORKSPACE, timeout_seconds=120)
    step("stop", id=stopped.id)
    client.start(name, workspace=WORKSPACE)
    again = client.wait_ready(name, workspace=WORKSPACE, timeout_seconds=120)
    step("start", id=again.id, phase=int(again.status.phase))
    names, pages = listed_names(client)
    step("list", names=names, pages=pages)
    got = client.get(name, workspace=WORKSPACE)
    step("get", id=got.id, name=got.name, labels=dict(got.labels))
    step("logs", lines=logs(client, ref, name))
    for target in (name, other.name):
        deleted = client.delete(target, workspace=WORKSPACE)
        outcome = deleted.outcome.name if NEW else bool(deleted)
        step("delete", name=target, outcome=outcome)
    for target in (name, other.name):
        client.wait_deleted(target, workspace=WORKSPACE, timeout_seconds=120)
    try:
        client.get(name, workspace=WORKSPACE)
        gone = False
    except grpc.RpcError as exc:
        gone = exc.code() == grpc.StatusCode.NOT_FOUND
    step("wait_deleted", gone=gone)
    if NEW:
        missing = client.delete(name, workspace=WORKSPACE, allow_missing=True)
        step("delete_missing", outcome=missing.outcome.name)
    client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
