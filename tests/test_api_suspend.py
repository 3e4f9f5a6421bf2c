"""Suspend and resume over HTTP: on the real stack with the fake driver (the doors: wait,
expected_version, command_id, the phase filter, the refusal without a workspace that outlives
the runtime), and on real Podman (files written before a suspend are there after ten
suspend/resume cycles; a rotation while suspended restarts nothing and the resume reads it)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import apikit
import pytest_asyncio
from apikit import Api, create_body, phase_is, row, unique
from harness import eventually
from pipeline_support import history
from podman import PodmanClient
from pydantic import SecretStr
from test_driver_podman import containers_of, volumes_of

from drivers.fake import FakeDriver
from drivers.kube_objects import WORKSPACE_DIES_WITH_POD
from drivers.podman import PodmanDriver
from services.common.settings import Settings
from services.common.tokens import AUDIT, FILES_READ, READ, SCOPES, TokenStore

# The agent records the value its environment was launched with.
AGENT = ["sh", "-c", "echo $TOKEN > /tmp/token; exec sleep 3600"]
KUBE = "kube-"  # names routed to a Kubernetes backend without a storage class (the API's view)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    update = {"driver_route_prefix": KUBE, "driver_route": "kubernetes"}
    async with apikit.running_api(FakeDriver(), settings_update=update) as running:
        yield running


async def created(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
        assert r.status_code == 201, r.text
    return await phase_is(api, body["name"], "Ready", 1)


async def test_suspend_and_resume_over_http_with_version_id_and_the_phase_filter(
    api: Api,
) -> None:
    name = unique("susp")
    ready = await created(api, create_body(name))
    async with api.client() as c:
        r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
        assert r.json()["phase"] == "Suspending"
        suspended = await phase_is(api, name, "Suspended", 1)
        assert suspended["id"] == ready["id"]
        listed = await c.get("/v1/sandboxes", params={"phase": "Suspended", "limit": 500})
        assert name in [s["name"] for s in listed.json()["items"]], listed.text
        ready_list = await c.get("/v1/sandboxes", params={"phase": "Ready", "limit": 500})
        assert name not in [s["name"] for s in ready_list.json()["items"]]
        stale = {"expected_version": suspended["version"] - 1}
        r = await c.post(f"/v1/sandboxes/{name}:resume", params={"wait": 30}, json=stale)
        assert r.status_code == 409 and r.json()["code"] == "ABORTED", r.text
        body = {"expected_version": suspended["version"], "command_id": f"resume-{name}"}
        first = await c.post(f"/v1/sandboxes/{name}:resume", params={"wait": 30}, json=body)
        assert first.status_code == 200 and first.json()["status"] == "accepted", first.text
        again = await c.post(f"/v1/sandboxes/{name}:resume", params={"wait": 30}, json=body)
        assert again.json() == first.json()
    resumed = await phase_is(api, name, "Ready", 2)
    assert resumed["id"] == ready["id"]


async def test_resume_of_a_sandbox_that_is_not_suspended_names_the_phase_it_needs(
    api: Api,
) -> None:
    name = unique("nsusp")
    await created(api, create_body(name))
    async with api.client() as c:
        await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30})
        await phase_is(api, name, "Stopped", 1)
        r = await c.post(f"/v1/sandboxes/{name}:resume", params={"wait": 30})
    assert r.status_code == 412, r.text
    assert r.json()["message"] == "sandbox must be Suspended to resume (current phase: Stopped)"


async def test_suspend_without_a_workspace_that_outlives_the_pod_is_refused_with_words(
    api: Api,
) -> None:
    name = unique(KUBE + "x")
    before = await created(api, create_body(name))
    async with api.client() as c:
        r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
    assert r.status_code == 412, r.text
    assert r.json() == {
        "code": "FAILED_PRECONDITION",
        "message": f"cannot suspend {name!r}: {WORKSPACE_DIES_WITH_POD}",
    }
    # Nothing was sent: the row and its history are as they were.
    assert await row(api, name) == before
    assert "SuspendSandbox" not in [h["message_type"] for h in await history(api.env, name)]


async def test_an_idle_timeout_for_a_sandbox_that_cannot_be_suspended_is_refused_naming_the_field(
    api: Api,
) -> None:
    """Each idle suspend of it would fail and leave it Ready, to be found idle again for as
    long as it lived: the API refuses the timeout itself, wherever it comes from."""
    name = unique(KUBE + "idle")
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", json=create_body(name, idle_suspend_seconds=60))
        assert r.status_code == 422, r.text
        message = r.json()["message"]
        assert message.startswith("field 'spec.idle_suspend_seconds': ") and (
            WORKSPACE_DIES_WITH_POD in message
        ), message
        template = unique("tpl")
        spec = {"image": "registry.example/agent:1", "idle_suspend_seconds": 60}
        made = await c.post("/v1/templates", json={"name": template, "spec": spec})
        assert made.status_code == 201, made.text
        r = await c.post("/v1/sandboxes", json={"name": name, "template": {"name": template}})
        assert r.status_code == 422 and r.json()["message"].startswith("field 'template': ")
        assert (await c.get(f"/v1/sandboxes/{name}")).status_code == 404  # nothing was sent

        await created(api, create_body(name))
        r = await c.post(f"/v1/sandboxes/{name}:idle-suspend", json={"idle_suspend_seconds": 60})
        assert r.status_code == 422, r.text
        assert r.json()["message"].startswith("field 'idle_suspend_seconds': "), r.text
        r = await c.post(f"/v1/sandboxes/{name}:idle-suspend", json={"idle_suspend_seconds": None})
        assert r.status_code < 300, r.text  # clearing one is no suspend

        other = unique("idle")  # a name the backend can suspend takes one
        r = await c.post("/v1/sandboxes", json={"name": other, "template": {"name": template}})
        assert r.status_code < 300, r.text


async def unsized() -> AsyncIterator[bytes]:
    """A body sent chunked: no Content-Length."""
    yield b"x"


async def test_a_call_refused_for_its_own_input_wakes_no_suspended_sandbox(api: Api) -> None:
    """A files call with a path refused (NUL, too long, the root removed or moved; a raw
    upload onto the workspace directory or without a Content-Length) and an exec refused for
    the token's session limit: 4xx, and the sandbox stays Suspended with no resume on its
    history (they were checked only after the wake had resumed it)."""
    name = unique("refused")
    await created(api, create_body(name))
    async with api.client() as c:
        r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
        assert r.status_code == 200, r.text
        suspended = await phase_is(api, name, "Suspended", 1)
        files = f"/v1/sandboxes/{name}/files"
        bad = {"path": "a\0b"}
        calls = [
            c.get(f"{files}/content", params=bad),
            c.get(f"{files}/stat", params=bad),
            c.get(files, params=bad),
            c.put(f"{files}/content", params=bad, content=b"x"),
            c.post(f"{files}/mkdir", json={"path": "x" * 5000}),
            c.delete(files, params={"path": "/", "recursive": "true"}),
            c.post(f"{files}/move", json={"source": "/workspace", "destination": "/tmp/w"}),
            c.put(f"{files}/content", params={"path": "/workspace"}, content=b"x"),
            c.put(f"{files}/content", params={"path": "/workspace/f"}, content=unsized()),
        ]
        for call in calls:
            r = await call
            assert r.status_code in (400, 411, 422), r.text
        limits = api.app.state.api.exec_limits
        with contextlib.ExitStack() as sessions:  # the token's sessions all open elsewhere
            for _ in range(limits.per_token):
                sessions.enter_context(limits.session("admin"))
            r = await c.post(f"/v1/sandboxes/{name}/exec", json={"command": ["true"]})
        assert r.status_code == 429, r.text
    assert await row(api, name) == suspended
    assert "ResumeSandbox" not in [h["message_type"] for h in await history(api.env, name)]


FILES_ONLY = "sst_test-files-only"  # files:read and nothing else


async def test_a_files_read_token_wakes_a_suspended_sandbox_a_sandbox_read_token_does_not() -> None:
    """The decision (docs/security.md): waking belongs to the scopes that reach the running
    sandbox (exec, files); a sandbox:read token's logs, row and list wake nothing."""
    store = TokenStore.of(
        admin=(apikit.ADMIN, *(s for s in SCOPES if s != AUDIT)),
        reader=(apikit.READER, READ),
        filesonly=(FILES_ONLY, FILES_READ),
    )
    async with apikit.running_api(FakeDriver(), token_store=store) as api:
        name = unique("scope")
        await created(api, create_body(name))
        async with api.client() as c:
            r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
            assert r.status_code == 200, r.text
        suspended = await phase_is(api, name, "Suspended", 1)
        async with api.client(apikit.READER) as reader:
            for path in (f"/v1/sandboxes/{name}/logs", f"/v1/sandboxes/{name}", "/v1/sandboxes"):
                assert (await reader.get(path)).status_code < 500
            r = await reader.get(f"/v1/sandboxes/{name}/files", params={"path": "/workspace"})
            assert r.status_code == 403, r.text
        assert await row(api, name) == suspended
        # A hold keeps it suspended against them (the wake's resume is refused), until released.
        base = f"/v1/sandboxes/{name}"
        async with api.client() as c:
            r = await c.post(f"{base}:hold", params={"wait": 30}, json={"reason": "keep"})
            assert r.status_code == 200, r.text
            async with api.client(FILES_ONLY) as files:
                r = await files.get(f"{base}/files/stat", params={"path": "/workspace"})
                assert r.status_code == 409 and "refused" in r.json()["message"], r.text
                assert (await row(api, name))["phase"] == "Suspended"
                r = await c.post(f"{base}:release", params={"wait": 30})
                assert r.status_code == 200, r.text
                await files.get(f"{base}/files/stat", params={"path": "/workspace"})
        await phase_is(api, name, "Ready", 2)
        resumes = [h for h in await history(api.env, name) if h["message_type"] == "ResumeSandbox"]
        assert [(h["disposition"], h["message"]["actor"]) for h in resumes] == [
            ("rejected", "filesonly"),
            ("applied", "filesonly"),
        ]


async def test_two_tokens_calling_one_suspended_sandbox_at_once_are_both_answered() -> None:
    """Each caller's wake sends a resume of its own: calls of two tokens that found the same
    suspended row sent one command id, and the second was refused as a reuse of another's
    id (a 500). Three rounds, both calls sent at once in each."""
    store = TokenStore.of(
        admin=(apikit.ADMIN, *(s for s in SCOPES if s != AUDIT)), filesonly=(FILES_ONLY, FILES_READ)
    )
    async with apikit.running_api(FakeDriver(), token_store=store) as api:
        name = unique("two")
        await created(api, create_body(name))
        stat = (f"/v1/sandboxes/{name}/files/stat", {"path": "/workspace"})
        async with api.client() as admin, api.client(FILES_ONLY) as files:
            for generation in (1, 2, 3):
                r = await admin.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
                assert r.status_code == 200, r.text
                await phase_is(api, name, "Suspended", generation)
                answers = await asyncio.gather(
                    admin.get(stat[0], params=stat[1]), files.get(stat[0], params=stat[1])
                )
                # Both got past the wake to the runtime (the fake driver's sandboxes have none
                # for the API's files door to reach).
                assert [(a.status_code, "runtime is not running" in a.text) for a in answers] == [
                    (409, True),
                    (409, True),
                ], [a.text for a in answers]
                await phase_is(api, name, "Ready", generation + 1)
        resumes = [h for h in await history(api.env, name) if h["message_type"] == "ResumeSandbox"]
        assert {h["disposition"] for h in resumes} <= {"applied", "idempotent", "duplicate"}
        assert {h["message"]["actor"] for h in resumes} == {"admin", "filesonly"}


async def test_a_call_that_finds_a_sandbox_resuming_waits_for_it_like_the_call_that_woke_it(
    api: Api,
) -> None:
    """A call a moment after the one that woke the sandbox found it Starting (the resume
    decided, its launch under way) and was answered 409 "Starting, not Ready" at once; it now
    waits for the resumed generation, as the waking call does."""
    name = unique("inflight")
    await created(api, create_body(name))
    driver = api.plane.driver if api.plane is not None else None
    assert isinstance(driver, FakeDriver)
    launches = driver.block("launch", name)
    stat = (f"/v1/sandboxes/{name}/files/stat", {"path": "/workspace"})
    async with api.client() as c:
        r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
        assert r.status_code == 200, r.text
        await phase_is(api, name, "Suspended", 1)
        waking = asyncio.create_task(c.get(stat[0], params=stat[1]))
        await launches.entered(timeout=30)  # resumed: generation 2 Starting, its launch held
        assert (await row(api, name))["phase"] == "Starting"
        later = asyncio.create_task(c.get(stat[0], params=stat[1]))
        # While the launch is held the later call has no answer to give (the old code's 409
        # came at once); two seconds bound the look.
        done, _ = await asyncio.wait({later}, timeout=2)
        assert not done, later.result().text
        launches.release()
        for answer in (await waking, await later):
            # Past the wake to the runtime (none for the API's files door on the fake driver).
            assert answer.status_code == 409 and "runtime is not running" in answer.text, (
                answer.text
            )
    await phase_is(api, name, "Ready", 2)


async def test_no_call_wakes_a_sandbox_whose_time_to_live_ended_while_suspended() -> None:
    """An expiry (on_expiry stop) finds the sandbox Suspended: an exec or a files call is
    refused (409, saying so) and resumes nothing, as for a sandbox its expiry stopped; an
    extend lets the next call wake it. It used to run on, without a time to live."""
    update = {"scheduler_poll_seconds": 0.5}
    async with apikit.running_api(FakeDriver(), settings_update=update, with_scheduler=True) as api:
        name = unique("expired")
        base = f"/v1/sandboxes/{name}"
        await created(api, {"name": name, "spec": {"image": "registry.example/agent:1"},
                            "ttl_seconds": 3600})  # fmt: skip
        async with api.client() as c:
            assert (await c.post(f"{base}:suspend", params={"wait": 30})).status_code == 200
            await phase_is(api, name, "Suspended", 1)
            r = await c.post(f"{base}:extend", params={"wait": 30}, json={"ttl_seconds": 1})
            assert r.status_code == 200, r.text
            expired = await eventually(
                lambda: row(api, name),
                lambda v: (v["reason"] or "").startswith("Expired"),
                what="expired",
                timeout=30,
            )
            assert (expired["phase"], expired["expires_at"]) == ("Suspended", None)
            calls = [
                c.get(f"{base}/files/stat", params={"path": "/workspace"}),
                c.post(f"{base}/exec", json={"command": ["true"]}),
            ]
            for call in calls:
                r = await call
                assert r.status_code == 409, r.text
                assert "time to live has ended" in r.json()["message"], r.text
            assert await row(api, name) == expired
            entries = await history(api.env, name)
            assert "ResumeSandbox" not in [h["message_type"] for h in entries]
            r = await c.post(f"{base}:extend", params={"wait": 30}, json={"ttl_seconds": 3600})
            assert r.status_code == 200, r.text
            await c.get(f"{base}/files/stat", params={"path": "/workspace"})
            await phase_is(api, name, "Ready", 2)


# -- real Podman ----------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def podman_api(settings: Settings) -> AsyncIterator[tuple[Api, PodmanDriver]]:
    driver = PodmanDriver(settings.podman_url, stop_timeout=10)
    key = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
    try:
        async with apikit.running_api(driver, settings_update={"credentials_key": key}) as api:
            yield api, driver
    finally:
        await driver.close()


async def test_on_podman_files_survive_ten_cycles_and_a_rotation_waits_for_the_resume(
    podman_api: tuple[Api, PodmanDriver], settings: Settings, podman: PodmanClient
) -> None:
    api, driver = podman_api
    name, provider = unique("psusp"), unique("ptok")
    async with api.client() as c:
        r = await c.post("/v1/providers", json={"name": provider, "credentials": {"TOKEN": "one"}})
        assert r.status_code == 201, r.text
        body = create_body(name, image=settings.sandbox_image, command=AGENT)
        await created(api, body | {"providers": [provider]})
        try:
            assert await driver.exec(name, 1, ["cat", "/tmp/token"]) == (0, "one\n")
            volumes = volumes_of(podman, name)
            for generation in range(1, 11):
                line = f"written by generation {generation}"
                write = f"echo '{line}' >> /workspace/f"
                assert (await driver.exec(name, generation, ["sh", "-c", write]))[0] == 0
                r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
                assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
                await phase_is(api, name, "Suspended", generation)
                assert containers_of(podman, name) == []
                assert volumes_of(podman, name) == volumes
                if generation == 10:
                    await rotate_while_suspended(api, c, name, provider)
                r = await c.post(f"/v1/sandboxes/{name}:resume", params={"wait": 30})
                assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
                await phase_is(api, name, "Ready", generation + 1)
                code, out = await driver.exec(name, generation + 1, ["cat", "/workspace/f"])
                assert code == 0
                assert out.splitlines() == [
                    f"written by generation {g}" for g in range(1, generation + 1)
                ]
            assert await driver.exec(name, 11, ["cat", "/tmp/token"]) == (0, "two\n")
        finally:
            await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})

            async def status() -> int:
                return int((await c.get(f"/v1/sandboxes/{name}")).status_code)

            await eventually(status, lambda code: code == 404, what="deleted", timeout=60)
    assert containers_of(podman, name) == [] and volumes_of(podman, name) == []


async def rotate_while_suspended(api: Api, c: Any, name: str, provider: str) -> None:
    """A rotation of the suspended sandbox's provider: decided as a skip, nothing started."""
    before = await row(api, name)
    r = await c.put(f"/v1/providers/{provider}/credentials", json={"credentials": {"TOKEN": "two"}})
    assert r.status_code == 200, r.text

    async def rotations() -> list[dict[str, Any]]:
        return [h for h in await history(api.env, name) if h["message_type"] == "RotateCredentials"]

    [decided] = await eventually(rotations, bool, what="the rotation decided", timeout=30)
    assert decided["disposition"] == "applied"
    assert "suspended: the new values apply when it resumes" in decided["reason"]
    after = await row(api, name)
    assert (after["phase"], after["generation"]) == ("Suspended", before["generation"])


async def test_on_podman_an_exec_or_a_file_call_wakes_a_suspended_sandbox_a_read_does_not(
    podman_api: tuple[Api, PodmanDriver], settings: Settings, podman: PodmanClient
) -> None:
    api, _ = podman_api
    name = unique("wake")
    async with api.client() as c:
        await created(api, create_body(name, image=settings.sandbox_image, command=AGENT))
        try:
            path = f"/v1/sandboxes/{name}/exec"
            r = await c.post(path, json={"command": ["sh", "-c", "echo kept > /workspace/f"]})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            for generation, call in ((1, "exec"), (2, "file")):
                await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
                suspended = await phase_is(api, name, "Suspended", generation)
                # Reads of the row (one, the list) wake nothing.
                assert (await row(api, name))["version"] == suspended["version"]
                await c.get("/v1/sandboxes", params={"phase": "Suspended"})
                assert containers_of(podman, name) == []
                if call == "exec":  # two at once: one resume, both run
                    both = await asyncio.gather(
                        *(c.post(path, json={"command": ["cat", "/workspace/f"]}) for _ in "ab")
                    )
                    for r in both:
                        assert r.status_code == 200, r.text
                        assert (r.json()["exit_code"], r.json()["stdout"]) == (0, "kept\n")
                else:
                    r = await c.get(
                        f"/v1/sandboxes/{name}/files/content", params={"path": "/workspace/f"}
                    )
                    assert (r.status_code, r.content) == (200, b"kept\n"), r.text
                woken = await row(api, name)
                assert (woken["phase"], woken["generation"]) == ("Ready", generation + 1)
            # One resume decided per wake: calls at once share its command id, so one sent
            # twice (both found it unpublished) is recorded as a duplicate.
            resumes = [
                h for h in await history(api.env, name) if h["message_type"] == "ResumeSandbox"
            ]
            assert [h["disposition"] for h in resumes if h["disposition"] != "duplicate"] == [
                "applied",
                "applied",
            ]
        finally:
            await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})


class GatedSuspend(PodmanDriver):
    """Real Podman whose suspends wait at ``gate`` first: a suspend in progress on demand."""

    def __init__(self, url: str) -> None:
        super().__init__(url, stop_timeout=10)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def suspend(self, key: str, generation: int, timeout: float | None = None) -> Any:
        self.entered.set()
        await self.gate.wait()
        return await super().suspend(key, generation, timeout)


async def test_on_podman_an_exec_and_a_file_call_during_a_suspend_wait_for_it_then_wake_it(
    settings: Settings,
) -> None:
    """Calls that meet the sandbox Suspending (an idle suspend just begun) wait for Suspended
    and resume it once, rather than a 409 for a phase that is about to pass."""
    driver = GatedSuspend(settings.podman_url)
    name = unique("wsusp")
    try:
        async with apikit.running_api(driver) as api, api.client() as c:
            await created(api, create_body(name, image=settings.sandbox_image, command=AGENT))
            try:
                r = await c.post(f"/v1/sandboxes/{name}:suspend", params={"wait": 30})
                assert r.json()["phase"] == "Suspending", r.text
                await asyncio.wait_for(driver.entered.wait(), 30)
                exec_calls = [
                    asyncio.ensure_future(
                        c.post(f"/v1/sandboxes/{name}/exec", json={"command": ["echo", "awake"]})
                    )
                    for _ in "ab"
                ]
                file_call = asyncio.ensure_future(
                    c.put(
                        f"/v1/sandboxes/{name}/files/content",
                        params={"path": "/workspace/g"},
                        content=b"put\n",
                    )
                )
                assert (await row(api, name))["phase"] == "Suspending"
                driver.gate.set()
                *ran, put = await asyncio.gather(*exec_calls, file_call)
                for each in ran:
                    assert (each.status_code, each.json()["stdout"]) == (200, "awake\n"), each.text
                assert put.status_code == 201, put.text
                woken = await row(api, name)
                assert (woken["phase"], woken["generation"]) == ("Ready", 2)
                resumes = [
                    h["disposition"]
                    for h in await history(api.env, name)
                    if h["message_type"] == "ResumeSandbox"
                ]
                assert [d for d in resumes if d != "duplicate"] == ["applied"]
            finally:
                driver.gate.set()
                await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
    finally:
        await driver.close()
