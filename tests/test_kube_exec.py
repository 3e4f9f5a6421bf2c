"""The Kubernetes driver's exec (drivers/kube_exec.py) through the HTTP API, on the local
cluster. Its nodes are kwok's: they run no containers and serve no exec, so no command runs in
a Pod here. What is proven: the argv that carries an environment and a working directory, and,
through the API on the real apiserver, that an exec request reaches the apiserver for the
sandbox's Pod and its refusal (no kubelet listens) comes back as a clear 409/503 naming the Pod
and the reason, in both forms, with the session released — never a 500 or a hang.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import apikit
import grpc
import pytest_asyncio
from apikit import Api, create_body, unique
from kube_support import (
    Admin,
    admin_fixture,  # noqa: F401  (the module's admin client)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
)

from drivers.kube_exec import PidLine, _start_failure, reporting_pid, wrapped
from drivers.kube_files import exec_refusal
from services.api.routes.exec import driver_error
from services.openshell.exec_rpc import exec_failure_code

UNAVAILABLE, FAILED_PRECONDITION = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION


def test_the_environment_and_working_directory_ride_on_env_and_sh() -> None:
    assert wrapped(["ls", "-l"], None, None) == ["ls", "-l"]
    assert wrapped(["ls"], {"A": "1", "B": "x y"}, None) == ["env", "A=1", "B=x y", "ls"]
    assert wrapped(["ls"], {"A": "1"}, "/w") == [
        "sh", "-c", 'cd -- "$1" || exit 127; shift; exec "$@"', "sh", "/w", "env", "A=1", "ls",
    ]  # fmt: skip


def test_the_wrappers_pid_line_is_taken_out_of_stderr_across_frames() -> None:
    assert reporting_pid(["ls"]) == ["sh", "-c", 'echo "$$" >&2; exec "$@"', "sh", "ls"]
    head = PidLine()
    assert (head.feed(b"12"), head.pending) == (b"", True)
    assert head.feed(b"34\nfirst") == b"first"
    assert (head.pid, head.feed(b"more")) == (1234, b"more")


def test_a_program_the_runtime_cannot_start_is_126_or_127() -> None:
    start = "OCI runtime exec failed: exec failed: unable to start container process: "
    assert _start_failure(start + 'exec: "/nope": stat /nope: no such file or directory') == 127
    assert _start_failure(start + 'exec: "/etc": permission denied') == 126
    assert _start_failure("error dialing backend: dial tcp 10.0.0.1:10250: refused") is None


def test_the_clusters_refusal_of_an_exec_is_a_503_naming_the_rbac_not_a_409() -> None:
    """A 403 on pods/exec is the deployment's RBAC, not the caller's doing: 503 UNAVAILABLE
    saying so; the apiserver's other refusals stay 409 FAILED_PRECONDITION."""
    forbidden = 'pods "sandstream-a-g1" is forbidden: cannot create resource "pods/exec"'
    refused = driver_error(exec_refusal("sandstream-a-g1", 403, forbidden))
    assert (refused.status, refused.code) == (503, "UNAVAILABLE")
    assert "the cluster refused the exec" in refused.message
    assert "pods/exec" in refused.message and forbidden in refused.message
    missing = driver_error(exec_refusal("sandstream-a-g1", 404, "no such container"))
    assert (missing.status, missing.code) == (409, "FAILED_PRECONDITION")
    assert missing.message == "exec: exec in Pod sandstream-a-g1: 404 no such container"
    # OpenShell's ExecSandbox answers alike (it answered FAILED_PRECONDITION before).
    assert exec_failure_code(exec_refusal("sandstream-a-g1", 403, forbidden)) is UNAVAILABLE
    assert exec_failure_code(exec_refusal("sandstream-a-g1", 404, "gone")) is FAILED_PRECONDITION


@pytest_asyncio.fixture(loop_scope="session")
async def api(admin: Admin, ns: str) -> AsyncIterator[Api]:
    driver = new_driver(admin, ns)
    update = {"driver": "kubernetes", "kube_namespace": ns, "kube_config": admin.kubeconfig}
    try:
        async with apikit.running_api(driver, settings_update=update) as running:
            yield running
    finally:
        await driver.close()


async def test_exec_on_a_kwok_pod_reaches_the_apiserver_and_says_why_it_cannot_run(
    api: Api,
) -> None:
    name = unique("kexec")
    async with api.client() as c:
        body = create_body(name, command=["sleep", "3600"])
        assert (await c.post("/v1/sandboxes", json=body, params={"wait": 30})).status_code == 201
        await api.wait_phase(name, "Ready", timeout=60)
        path = f"/v1/sandboxes/{name}/exec"
        r = await c.post(path, json={"command": ["true"], "env": {"A": "1"}, "workdir": "/w"})
        assert r.status_code in (409, 503), r.text
        assert r.json()["code"] in ("FAILED_PRECONDITION", "UNAVAILABLE")
        message = r.json()["message"]
        assert f"exec in Pod sandstream-{name}-g1:" in message and "10250" in message, message

        events: list[tuple[str, Any]] = []
        async with c.stream("POST", path, json={"command": ["true"]},
                            params={"stream": "true"}) as streamed:  # fmt: skip
            assert streamed.status_code == 200
            kind = ""
            async for line in streamed.aiter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    events.append((kind, json.loads(line[6:])))
        assert [kind for kind, _ in events] == ["error"], events
        assert "10250" in events[0][1]["message"]
        assert api.app.state.api.exec_limits.open_in[name] == 0
        await c.delete(f"/v1/sandboxes/{name}")
