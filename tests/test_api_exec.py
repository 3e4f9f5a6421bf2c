"""POST /v1/sandboxes/{name}/exec on the real stack: the API over Kafka and PostgreSQL, the
sandboxes and their commands in real Podman containers. Both forms (one JSON answer, server-
sent events), and the hostile side: scopes, huge outputs, the deadline, session limits, a
client that leaves, a sandbox deleted while its command runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import apikit
import httpx
import pytest
import pytest_asyncio
from apikit import ADMIN, READER, WRITER, Api, create_body, unique
from exec_support import running_with
from harness import eventually
from podman import PodmanClient

from drivers.podman_objects import container_name
from services.common.settings import load_settings
from services.common.tokens import EXEC, SCOPES, TokenStore
from services.executor.backends import podman_driver

EXECUTOR = "sst_test-executor"  # sandbox:exec alone
CAP = 4096  # exec_output_max_bytes here
PER_SANDBOX = 2
IMAGE = load_settings().sandbox_image


def token_store() -> TokenStore:
    return TokenStore.of(
        admin=(ADMIN, *SCOPES),
        reader=(READER, "sandbox:read"),
        writer=(WRITER, "sandbox:write"),
        executor=(EXECUTOR, EXEC),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    update = {"exec_output_max_bytes": CAP, "exec_sessions_per_sandbox": PER_SANDBOX}
    driver = podman_driver(load_settings())
    try:
        async with apikit.running_api(
            driver, settings_update=update, token_store=token_store()
        ) as running:
            yield running
    finally:
        await driver.close()


@pytest.fixture(scope="module")
def podman() -> PodmanClient:
    return PodmanClient(base_url=load_settings().podman_url)


async def ready_sandbox(api: Api) -> str:
    name = unique("exec")
    async with api.client() as c:
        body = create_body(name, image=IMAGE, command=["sleep", "3600"])
        r = await c.post("/v1/sandboxes", json=body, params={"wait": 60})
        assert r.status_code == 201, r.text
    await api.wait_phase(name, "Ready", timeout=60)
    return name


@pytest_asyncio.fixture(loop_scope="session")
async def sandbox(api: Api) -> AsyncIterator[str]:
    name = await ready_sandbox(api)
    yield name
    async with api.client() as c:
        await c.delete(f"/v1/sandboxes/{name}")


async def exec_json(api: Api, name: str, token: str = ADMIN, **body: Any) -> httpx.Response:
    async with api.client(token) as c:
        return await c.post(f"/v1/sandboxes/{name}/exec", json=body)


def streamed(
    c: httpx.AsyncClient, name: str, body: dict[str, Any]
) -> AbstractAsyncContextManager[httpx.Response]:
    return c.stream("POST", f"/v1/sandboxes/{name}/exec", json=body, params={"stream": "true"})


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    kind, data = "message", ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            yield kind, json.loads(data)
            kind, data = "message", ""


def container_of(name: str) -> str:
    return container_name(name, 1)


async def test_exec_answers_both_outputs_and_the_exit_code(api: Api, sandbox: str) -> None:
    script = 'printf "$GREETING $(pwd)"; printf err >&2; exit 3'
    r = await exec_json(api, sandbox, command=["sh", "-c", script], env={"GREETING": "hi"},
                        workdir="/tmp")  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json() == {
        "exit_code": 3, "stdout": "hi /tmp", "stderr": "err",
        "stdout_truncated": False, "stderr_truncated": False, "timed_out": False,
    }  # fmt: skip


async def test_stdin_reaches_the_command_then_its_end(api: Api, sandbox: str) -> None:
    r = await exec_json(api, sandbox, command=["sh", "-c", "cat; echo end"], stdin="fed\n")
    assert r.status_code == 200, r.text
    assert (r.json()["stdout"], r.json()["exit_code"]) == ("fed\nend\n", 0)


async def test_a_huge_output_is_cut_at_the_limit_and_says_so(api: Api, sandbox: str) -> None:
    """20 MB of output: the answer holds CAP bytes of it and says it was cut; the command still
    runs to its end (the rest is read and dropped, never held)."""
    r = await exec_json(api, sandbox, command=["sh", "-c", "head -c 20000000 /dev/zero | tr "
                                               "'\\0' x; echo done >&2"])  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stdout"] == "x" * CAP and body["stdout_truncated"] is True
    assert (body["stderr"], body["stderr_truncated"], body["exit_code"]) == ("done\n", False, 0)


async def test_the_stream_sends_output_as_it_comes_then_the_exit(api: Api, sandbox: str) -> None:
    marker = str(700 + uuid.uuid4().int % 100)
    body = {"command": ["sh", "-c", f"echo first; printf oops >&2; sleep 0.{marker}; exit 4"]}
    async with api.client() as c, streamed(c, sandbox, body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e async for e in sse_events(r)]
    # stdout and stderr are two pipes: which the stream reads first is not ordered (a CI run
    # had stderr's first); both come before the exit, each once.
    outputs = sorted(events[:-1], key=lambda e: e[0])
    assert outputs == [("stderr", {"data": "oops"}), ("stdout", {"data": "first\n"})], events
    assert events[-1] == ("exit", {"exit_code": 4, "timed_out": False})


async def test_a_command_past_its_timeout_is_ended_and_says_so(
    api: Api, sandbox: str, podman: PodmanClient
) -> None:
    marker = f"{1000 + uuid.uuid4().int % 1000}"
    r = await exec_json(api, sandbox, command=["sleep", marker], timeout=1)
    assert r.status_code == 200, r.text
    assert (r.json()["timed_out"], r.json()["exit_code"]) == (True, None)
    assert running_with(podman, container_of(sandbox), f"sleep {marker}") == []
    r = await exec_json(api, sandbox, command=["true"], timeout=10**6)
    assert r.status_code == 422 and r.json()["message"].startswith("timeout: at most")


async def test_exec_needs_sandbox_exec_not_read_or_write(api: Api, sandbox: str) -> None:
    """Regression: the front gate asked sandbox:write of every POST, so a token with
    sandbox:exec alone was refused before the route."""
    for token in (READER, WRITER):
        r = await exec_json(api, sandbox, token, command=["true"])
        assert r.status_code == 403, r.text
        assert "sandbox:exec" in r.json()["message"]
    r = await exec_json(api, sandbox, EXECUTOR, command=["echo", "ok"])
    assert (r.status_code, r.json()["stdout"]) == (200, "ok\n"), r.text
    r = await exec_json(api, sandbox, None, command=["true"])  # type: ignore[arg-type]
    assert r.status_code == 401


async def test_unknown_not_ready_and_malformed_are_clear(api: Api) -> None:
    r = await exec_json(api, unique("ghost"), command=["true"])
    assert (r.status_code, r.json()["code"]) == (404, "NOT_FOUND")
    name = await ready_sandbox(api)
    async with api.client() as c:
        assert (await c.post(f"/v1/sandboxes/{name}:stop")).status_code in (200, 202)
    await api.wait_phase(name, "Stopped", timeout=60)
    r = await exec_json(api, name, command=["true"])
    assert (r.status_code, r.json()["code"]) == (409, "FAILED_PRECONDITION")
    assert "is Stopped, not Ready" in r.json()["message"]
    bad: dict[str, Any]
    for bad in ({"command": []}, {"command": ["x"], "timeout": 0}, {"command": ["x"], "y": 1}):
        r = await exec_json(api, name, **bad)
        assert (r.status_code, r.json()["code"]) == (422, "INVALID_ARGUMENT"), r.text
    async with api.client() as c:
        await c.delete(f"/v1/sandboxes/{name}")


async def test_sessions_per_sandbox_are_limited(api: Api, sandbox: str) -> None:
    """PER_SANDBOX streams open on one sandbox: the next is refused (429) until one ends."""
    body = {"command": ["sleep", "600"], "timeout": 60}
    async with api.client() as c, contextlib.AsyncExitStack() as stack:
        for _ in range(PER_SANDBOX):
            r = await stack.enter_async_context(streamed(c, sandbox, body))
            assert r.status_code == 200
        await eventually(lambda: api.app.state.api.exec_limits.open_in[sandbox],
                         lambda n: n == PER_SANDBOX, what="the sessions")  # fmt: skip
        r = await c.post(f"/v1/sandboxes/{sandbox}/exec", json={"command": ["true"]})
        assert (r.status_code, r.json()["code"]) == (429, "RESOURCE_EXHAUSTED")
        assert f"sandbox {sandbox!r} has {PER_SANDBOX} exec sessions" in r.json()["message"]
    await eventually(lambda: api.app.state.api.exec_limits.open_in[sandbox],
                     lambda n: n == 0, what="the sessions to end")  # fmt: skip
    r = await exec_json(api, sandbox, command=["true"])
    assert r.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_ends_the_command(
    api: Api, sandbox: str, podman: PodmanClient, stream: bool
) -> None:
    """Regression (the JSON form): a client gone while a silent command ran left it running to
    its deadline (nothing was sent, so nothing noticed). Now the command ends either way."""
    marker = f"{2000 + uuid.uuid4().int % 1000}"
    body = {"command": ["sleep", marker]}
    container = container_of(sandbox)

    async def call() -> None:
        async with api.client() as c:
            await c.post(f"/v1/sandboxes/{sandbox}/exec", json=body, params={"stream": stream})

    task = asyncio.create_task(call())
    await eventually(lambda: running_with(podman, container, f"sleep {marker}"), bool,
                     what="the command")  # fmt: skip
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await eventually(lambda: running_with(podman, container, f"sleep {marker}"),
                     lambda found: found == [], what="the command ended")  # fmt: skip
    await eventually(lambda: api.app.state.api.exec_limits.open_in[sandbox],
                     lambda n: n == 0, what="the session to end")  # fmt: skip


async def test_a_sandbox_deleted_mid_command_ends_the_answer_cleanly(api: Api) -> None:
    """The sandbox goes while its command streams: the stream ends with an exit or an error
    event, never a broken answer; the JSON form answers with a 4xx/503 or an exit, never 500."""
    name = await ready_sandbox(api)
    body = {"command": ["sh", "-c", "echo first; sleep 600"]}
    async with api.client() as c, streamed(c, name, body) as r:
        events = sse_events(r)
        assert await anext(events) == ("stdout", {"data": "first\n"})
        deleting = await c.delete(f"/v1/sandboxes/{name}")
        assert deleting.status_code in (200, 202), deleting.text
        rest = [e async for e in events]
    assert rest and rest[-1][0] in ("exit", "error"), rest
    assert sum(kind in ("exit", "error") for kind, _ in rest) == 1


async def test_a_sandbox_deleted_mid_command_answers_the_json_form(
    api: Api, podman: PodmanClient
) -> None:
    """The JSON form of the above: an exit (the command was killed with its container) or a
    409/503 naming the failure, never a 5xx of the API's own; the session is released."""
    name = await ready_sandbox(api)
    marker = f"{3000 + uuid.uuid4().int % 1000}"
    call = asyncio.create_task(exec_json(api, name, command=["sleep", marker]))
    await eventually(lambda: running_with(podman, container_of(name), f"sleep {marker}"), bool,
                     what="the command")  # fmt: skip
    async with api.client() as c:
        assert (await c.delete(f"/v1/sandboxes/{name}")).status_code in (200, 202)
    r = await asyncio.wait_for(call, 60)
    assert r.status_code in (200, 409, 503), r.text
    if r.status_code == 200:
        assert r.json()["exit_code"] is not None and r.json()["exit_code"] != 0, r.text
    await eventually(lambda: api.app.state.api.exec_limits.open_in[name],
                     lambda n: n == 0, what="the session to end")  # fmt: skip


async def test_hostile_bodies_are_refused_naming_the_field_or_run(api: Api, sandbox: str) -> None:
    """Regression: NUL bytes, an empty or '='-holding environment name and a relative working
    directory reached Podman, whose error came back as the command's stderr with exit 125 or
    127; now each is a 422 naming the field. A missing program or directory still runs, with
    the runtime's exit code (127, as `podman exec` says), never a 5xx."""
    refused: list[tuple[dict[str, Any], str]] = [
        ({"command": ["echo", "a\x00b"]}, "command"),
        ({"command": ["\x00"]}, "command"),
        ({"command": ["true"], "env": {"": "x"}}, "env"),
        ({"command": ["true"], "env": {"A=B": "x"}}, "env"),
        ({"command": ["true"], "env": {"C": "\x00"}}, "env"),
        ({"command": ["true"], "workdir": "tmp"}, "workdir"),
        ({"command": ["true"], "workdir": "/\x00"}, "workdir"),
    ]
    for body, field in refused:
        r = await exec_json(api, sandbox, **body)
        assert (r.status_code, r.json()["code"]) == (422, "INVALID_ARGUMENT"), (body, r.text)
        assert f"'{field}" in r.json()["message"], (body, r.text)
    for body in ({"command": ["/no/such/program"]}, {"command": ["true"], "workdir": "/no/dir"}):
        r = await exec_json(api, sandbox, **body)
        assert (r.status_code, r.json()["exit_code"]) == (200, 127), (body, r.text)
    r = await exec_json(api, sandbox, command=["wc", "-c"], stdin="\x00" * 1000)
    assert (r.status_code, r.json()["stdout"].strip()) == (200, "1000"), r.text


async def test_a_stdin_that_is_no_utf8_is_422_and_holds_no_session(api: Api, sandbox: str) -> None:
    """Regression: a lone surrogate in stdin (a JSON escape can make one) failed to encode once
    the session was counted: 500, and each such request kept a place of the sandbox's
    sessions. Now a 422 naming the field, before any session."""
    raw = json.dumps({"command": ["cat"], "stdin": "\udc80"})  # sent as the escape \udc80
    async with api.client() as c:
        for _ in range(PER_SANDBOX + 1):
            r = await c.post(
                f"/v1/sandboxes/{sandbox}/exec",
                content=raw,
                headers={"Content-Type": "application/json"},
            )
            assert (r.status_code, r.json()["code"]) == (422, "INVALID_ARGUMENT"), r.text
            assert "'stdin" in r.json()["message"] and "surrogate" in r.text, r.text
    r = await exec_json(api, sandbox, command=["cat"], stdin="ok")
    assert (r.status_code, r.json()["stdout"]) == (200, "ok"), r.text


async def test_on_a_driver_without_exec_it_is_not_implemented() -> None:
    """With ``driver=fake`` the API has no exec-capable driver: a Ready sandbox's exec is 501,
    not a socket's error."""
    from drivers.fake import FakeDriver

    async with apikit.running_api(
        FakeDriver(), settings_update={"driver": "fake"}, token_store=token_store()
    ) as api:
        name = unique("fake")
        async with api.client() as c:
            r = await c.post("/v1/sandboxes", json=create_body(name), params={"wait": 30})
            assert r.status_code == 201, r.text
        await api.wait_phase(name, "Ready")
        r = await exec_json(api, name, command=["true"])
        assert (r.status_code, r.json()["code"]) == (501, "NOT_IMPLEMENTED"), r.text


def written_by(podman: PodmanClient, container: str, command: str) -> int | None:
    """Bytes written so far by the container's process whose command line begins with
    ``command`` (its /proc io counters, read from the host); None once it is gone."""
    top = podman.containers.get(container).top(ps_args="hpid,args")
    assert isinstance(top, dict)
    for hpid, args in top["Processes"]:
        if args.startswith(command):
            try:
                io = Path(f"/proc/{hpid}/io").read_text()
            except OSError:
                return None
            return int(re.search(r"^wchar: (\d+)", io, re.M).group(1))  # type: ignore[union-attr]
    return None


async def test_a_slow_reader_holds_the_command_not_the_apis_memory(
    api: Api, sandbox: str, podman: PodmanClient
) -> None:
    """A client that reads nothing of a 40 MB stream: the command is held at its writes far
    below 40 MB (the API reads a few chunks ahead, never the whole output), and once the
    client reads, every byte arrives and the exit follows."""
    total = 40_000_000
    marker = f"{total + uuid.uuid4().int % 1000}"
    body = {"command": ["sh", "-c", f"head -c {marker} /dev/zero | tr '\\0' x"]}
    container = container_of(sandbox)
    async with api.client() as c, streamed(c, sandbox, body) as r:
        assert r.status_code == 200
        samples: list[int | None] = []

        async def held() -> bool:
            # tr writes the output (the shell runs head as a builtin of a forked sh)
            samples.append(await asyncio.to_thread(written_by, podman, container, "tr "))
            return len(samples) > 4 and samples[-1] is not None and len(set(samples[-4:])) == 1

        await eventually(held, bool, interval=0.25, what="the writer to be held")
        assert samples[-1] is not None and samples[-1] < total // 4, samples
        received, others = 0, []
        async for kind, data in sse_events(r):
            if kind == "stdout":
                received += len(data["data"])
            else:
                others.append((kind, data))
    assert received == int(marker)
    assert others == [("exit", {"exit_code": 0, "timed_out": False})]
