"""Drives the template calls of OpenShell's official Python SDK 0.1.5 against a gateway.

Run by tests/test_openshell_templates.py with the Python of the 0.1.5 SDK virtualenv
(services/openshell/sdk.py): ``python openshell_sdk_templates.py ENDPOINT NAME``. Uses only the
SDK's own clients (``SandboxClient``, ``SandboxTemplateClient``). Prints one JSON object per
step on stdout; any unexpected failure raises (non-zero exit).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import grpc
from openshell import SandboxClient
from openshell._proto import openshell_pb2

WORKSPACE = "default"


def step(what: str, **facts: Any) -> None:
    print(json.dumps({"step": what, **facts}), flush=True)


def refused(call: Callable[[], Any]) -> str:
    """The status code name a call that must fail ended with."""
    try:
        call()
    except grpc.RpcError as exc:
        return str(exc.code().name)
    raise AssertionError("the call succeeded")


def shown(template: Any) -> dict[str, Any]:
    workload = template.spec.workload
    return {
        "name": template.metadata.name,
        "revision": int(template.metadata.resource_version),
        "labels": dict(template.metadata.labels),
        "image": workload.image,
        "environment": dict(workload.environment),
        "cpu": workload.resources.cpu,
        "memory": workload.resources.memory,
    }


def main(endpoint: str, name: str) -> None:
    client = SandboxClient(endpoint, timeout=60)
    templates = client.sandbox_templates()
    tpl = f"{name}-tpl"
    made = templates.create(workspace=WORKSPACE, name=tpl, labels={"team": "research"},
                            environment={"MODE": "base", "KEEP": "1"}, cpu="500m",
                            memory="256Mi")  # fmt: skip
    step("create", **shown(made))
    step("get", **shown(templates.get(tpl, workspace=WORKSPACE)))
    step("list", names=[t.metadata.name for t in templates.list_all(workspace=WORKSPACE)],
         selected=[t.metadata.name for t in templates.list_all(
             workspace=WORKSPACE, label_selector="team=research")],
         unselected=[t.metadata.name for t in templates.list_all(
             workspace=WORKSPACE, label_selector="team=other")])  # fmt: skip
    step("create_again", code=refused(lambda: templates.create(workspace=WORKSPACE, name=tpl)))
    step("create_gpu", code=refused(
        lambda: templates.create(workspace=WORKSPACE, name=f"{tpl}-gpu", gpu=True)))  # fmt: skip
    spec = openshell_pb2.SandboxSpec(environment={"MODE": "sdk"}, command=["sleep", "infinity"])
    ref = client.create_from_template(workspace=WORKSPACE, workload_template=tpl, name=name,
                                      labels={"who": "sdk"}, spec=spec)  # fmt: skip
    made_from = ref.created_from_workload_template
    origin = [made_from.name, made_from.resource_version] if made_from else None
    step("create_from_template", labels=dict(ref.labels), template=origin)
    client.wait_ready(name, workspace=WORKSPACE, timeout_seconds=120)
    result = client.exec(name, ["sh", "-c", "echo $MODE $KEEP"], workspace=WORKSPACE,
                         timeout_seconds=30)  # fmt: skip
    step("exec", exit_code=result.exit_code, stdout=result.stdout)
    step("from_missing", code=refused(lambda: client.create_from_template(
        workspace=WORKSPACE, workload_template=f"{tpl}-none", name=f"{name}-x")))  # fmt: skip
    workload = openshell_pb2.SandboxSpec(template=openshell_pb2.SandboxTemplate(image="x"))
    step("from_with_workload", code=refused(lambda: client.create_from_template(
        workspace=WORKSPACE, workload_template=tpl, name=f"{name}-y", spec=workload)))  # fmt: skip
    deleted = templates.delete(tpl, workspace=WORKSPACE)
    step("delete", outcome=deleted.outcome.name)
    again = templates.delete(tpl, workspace=WORKSPACE, allow_missing=True)
    step("delete_missing", outcome=again.outcome.name,
         get=refused(lambda: templates.get(tpl, workspace=WORKSPACE)))  # fmt: skip
    still = client.get(name, workspace=WORKSPACE).created_from_workload_template
    step("sandbox_after_delete", template=[still.name, still.resource_version] if still else None)
    client.delete(name, workspace=WORKSPACE)
    client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
