"""The whole pipeline on Kubernetes: processor, executor, watcher and reconciler with the
Kubernetes driver against a real kube-apiserver (kwok as the node; `make k8s` starts it).

The lifecycle runs through the HTTP API of a real `sandstream up --driver kubernetes`
subprocess; the other tests drive an in-process control plane with commands and look behind
its back with an admin client. They fail (never skip) when the cluster is missing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import apikit
import factories as f
import httpx
from apikit import create_body, unique
from harness import Env, eventually, isolated_env
from kube_support import (
    Admin,
    HoldingDriver,
    Keys,
    OwnApiserver,
    admin_fixture,  # noqa: F401  (the module's admin client)
    env_of,
    keys_fixture,  # noqa: F401  (the test's sandbox names)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
    own_apiserver,
    wait_pods,
)
from pipeline_support import command, history, running_plane, wait_phase
from pydantic import SecretStr

from drivers.kube_objects import pod_name, secret_name
from drivers.kubernetes import KubernetesDriver
from drivers.protocol import IDENTITY_ENV
from events.common import SandboxSpec
from events.observations import RuntimeRemoved, RuntimeSnapshot
from events.publisher import CommandPublisher
from services.common.settings import PROJECT_ROOT, Settings
from services.localstack.kubernetes import STORAGE_CLASS

IMAGE = "registry.example/agent:1"
SPEC = SandboxSpec(image=IMAGE, command=["sleep", "3600"])
CREDENTIALS_KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())


@asynccontextmanager
async def pipeline(
    driver: KubernetesDriver | HoldingDriver, **plane_args: Any
) -> AsyncIterator[tuple[Env, CommandPublisher]]:
    plane_args.setdefault("reconcile_interval", 3600)
    try:
        async with (
            isolated_env() as env,
            running_plane(env, driver, **plane_args),
            await env.publisher() as pub,
        ):
            yield env, pub
    finally:
        await driver.close()


async def applied_phases(env: Env, key: str) -> list[str]:
    """The phase after each applied input of the key, in order (one per transition)."""
    return [h["phase"] for h in await history(env, key) if h["disposition"] == "applied"]


# -- the lifecycle through `sandstream up --driver kubernetes` ------------------------------------


@asynccontextmanager
async def sandstream_up(
    env: Env, admin: Admin, ns: str, run_dir: Path
) -> AsyncIterator[tuple[str, str]]:
    """`sandstream up --driver kubernetes` as a subprocess: (API url, banner)."""
    variables = {
        **env.env_vars(),
        "SANDSTREAM_RUN_DIR": str(run_dir),
        "SANDSTREAM_API_PORT": "0",
        "SANDSTREAM_KUBE_STORAGE_CLASS": STORAGE_CLASS,
        "SANDSTREAM_STOP_TIMEOUT_SECONDS": "5",
    }
    for inherited in ("SANDSTREAM_TOKEN", "SANDSTREAM_API_URL", "SANDSTREAM_DRIVER"):
        variables.pop(inherited, None)
    log = run_dir / "up.log"
    with log.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "up", "--no-stack", "--driver", "kubernetes",
            "--kubeconfig", str(admin.kubeconfig), "--namespace", ns,
            env=variables, cwd=PROJECT_ROOT, stdout=asyncio.subprocess.PIPE, stderr=log_file,
        )  # fmt: skip
    assert proc.stdout is not None
    banner: list[str] = []
    try:
        async with asyncio.timeout(120):
            while not banner or "Ctrl-C" not in banner[-1]:
                line = (await proc.stdout.readline()).decode()
                assert line, f"`sandstream up` ended early:\n{''.join(banner)}{log.read_text()}"
                banner.append(line)
        url = next(m.group(1) for b in banner if (m := re.match(r"^\s+API\s+(http://\S+)", b)))
        yield url, "".join(banner)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)


async def test_full_lifecycle_through_the_api_with_the_kubernetes_driver(
    admin: Admin, ns: str, keys: Keys, tmp_path: Path
) -> None:
    key = keys()
    async with isolated_env() as env, sandstream_up(env, admin, ns, tmp_path) as (url, banner):
        (line,) = [b for b in banner.splitlines() if b.strip().startswith("driver")]
        assert line.split(None, 1)[1].startswith(f"kubernetes (namespace {ns}, ")
        assert line.endswith("kubernetes/kubeconfig)")
        token = (tmp_path / "admin.token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as c:

            async def act(method: str, path: str, **kw: Any) -> dict[str, Any]:
                response = await c.request(method, path, params={"wait": 30}, **kw)
                assert response.status_code in (200, 201), response.text
                body: dict[str, Any] = response.json()
                return body

            # create → Ready: one Pod with the row's identity, one claim
            await act("POST", "/v1/sandboxes", json=create_body(key, command=["sleep", "3600"]))
            first = await wait_phase(env, key, "Ready", generation=1)
            (pod,) = await admin.pods(ns, key)
            assert pod["metadata"]["name"] == pod_name(key, 1)
            assert env_of(pod)[IDENTITY_ENV] == first["identity"]
            (claim,) = await admin.claims(ns, key)

            # stop → Stopped: the Pod is gone, the claim stays
            await act("POST", f"/v1/sandboxes/{key}:stop")
            await wait_phase(env, key, "Stopped", generation=1)
            assert await admin.pod_names(ns, key) == []
            assert await admin.claims(ns, key) == [claim]

            # start → Ready at generation 2, a new identity, the same claim
            await act("POST", f"/v1/sandboxes/{key}:start")
            second = await wait_phase(env, key, "Ready", generation=2)
            assert second["identity"] != first["identity"]
            (pod,) = await admin.pods(ns, key)
            assert pod["metadata"]["name"] == pod_name(key, 2)
            assert env_of(pod)[IDENTITY_ENV] == second["identity"]
            assert await admin.claims(ns, key) == [claim]

            # restart → Ready at generation 3, only its Pod left
            await act("POST", f"/v1/sandboxes/{key}:restart")
            await wait_phase(env, key, "Ready", generation=3)
            assert await admin.pod_names(ns, key) == [pod_name(key, 3)]

            # delete → gone: no Pod and no claim left, the name is free. (The row is tombstoned
            # as soon as the Pod's removal is seen; the claim goes right after.)
            await act("DELETE", f"/v1/sandboxes/{key}")
            await wait_phase(env, key, "Deleted")
            assert await admin.pod_names(ns, key) == []
            await eventually(lambda: admin.claims(ns, key), lambda c: c == [], what="no claim")
            assert (await c.get(f"/v1/sandboxes/{key}")).status_code == 404


# -- scenario 5: Stopped does not regress on Kubernetes ------------------------------------------


async def test_late_watch_events_of_the_stop_leave_stopped_alone(admin: Admin, ns: str) -> None:
    """The stop's own watch events (the terminating Pod, its deletion) are held back by the
    watch and delivered only after the row reached Stopped (through the executor's result)."""
    name = unique("s5")
    driver = HoldingDriver(new_driver(admin, ns))
    try:
        async with apikit.running_api(driver) as api, api.client() as c:
            body = create_body(name, command=["sleep", "3600"], stop_timeout_seconds=5)
            created = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert created.status_code == 201, created.text
            await api.wait_phase(name, "Ready")

            driver.hold(name)
            stop = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30})
            assert stop.status_code == 200 and stop.json()["phase"] == "Stopping"
            await api.wait_phase(name, "Stopped")
            stopped = (await c.get(f"/v1/sandboxes/{name}")).json()
            generation, version = stopped["generation"], stopped["version"]
            assert (stopped["phase"], generation) == ("Stopped", 1)

            # The watch saw the stop: the Pod terminating (stopping), then its deletion.
            await eventually(lambda: driver.held_of(name),
                             lambda held: any(isinstance(o, RuntimeRemoved) for o in held),
                             what="the held deletion")  # fmt: skip
            late = driver.release(name)
            assert all(o.generation == generation and o.source == "watch" for o in late)
            terminating = [o for o in late if o.observation_id.endswith(":stopping")]
            assert len(terminating) == 1 and isinstance(terminating[0], RuntimeSnapshot)
            assert terminating[0].state == "stopping"
            late_ids = {o.observation_id for o in late}

            async def recorded() -> list[dict[str, Any]]:
                page = await c.get(f"/v1/sandboxes/{name}/history", params={"limit": 1000})
                return [
                    h for h in page.json()["items"]
                    if h["message"] and h["message"].get("observation_id") in late_ids
                ]  # fmt: skip

            entries = await eventually(recorded, lambda hs: len(hs) == len(late),
                                       what="the late events in the history")  # fmt: skip
            assert {h["disposition"] for h in entries} == {"ignored"}
            assert all(h["phase"] == "Stopped" and h["version"] == version for h in entries)
            after = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert (after["phase"], after["version"], after["change_seq"]) == (
                "Stopped", version, stopped["change_seq"],
            )  # fmt: skip

            # A second stop is an idempotent success.
            again = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30})
            assert again.status_code == 200, again.text
            outcome = again.json()
            assert (outcome["status"], outcome["code"], outcome["phase"], outcome["version"]) == (
                "accepted", "OK", "Stopped", version,
            )  # fmt: skip

            # A genuine start recovers it, at the next generation.
            start = await c.post(f"/v1/sandboxes/{name}:start", params={"wait": 30})
            assert start.status_code == 200 and start.json()["generation"] == generation + 1
            await api.wait_phase(name, "Ready")
            runtimes = await driver.get(name)
            assert [(r.generation, r.state) for r in runtimes] == [(generation + 1, "running")]

            delete = await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
            assert delete.status_code == 200
            await api.wait_phase(name, "Deleted")
            assert await admin.pod_names(ns, name) == []
            await eventually(lambda: admin.claims(ns, name), lambda c: c == [], what="no claim")
    finally:
        await admin.remove_everything_of(ns, name)
        await driver.close()


# -- a broken watch, a 410, and reconcile --------------------------------------------------------


async def test_an_apiserver_restart_loses_and_repeats_no_transition(
    admin: Admin, ns: str, keys: Keys, settings: Settings, tmp_path: Path
) -> None:
    """The plane's driver talks to an apiserver of its own, which is killed and restarted; the
    cluster's own apiserver (every other client's) runs on untouched."""
    async with own_apiserver(settings, tmp_path) as server:
        driver = new_driver(admin, ns, kubeconfig=server.kubeconfig)
        async with pipeline(driver) as (env, pub):
            await _restart_loses_and_repeats_nothing(env, pub, driver, server, admin, ns, keys)


async def _restart_loses_and_repeats_nothing(
    env: Env,
    pub: CommandPublisher,
    driver: KubernetesDriver,
    server: OwnApiserver,
    admin: Admin,
    ns: str,
    keys: Keys,
) -> None:
    exits, stops, later = keys(), keys(), keys()
    for key in (exits, stops):
        await command(env, pub, f.create(key, sandbox_spec=SPEC))
        await wait_phase(env, key, "Ready")
    await eventually(lambda: driver.listings, lambda n: n == 1, what="the watch's listing")

    # Moves the store past the watch's version: the restarted server answers it with 410.
    await admin.core.create_namespaced_config_map(ns, {"metadata": {"name": unique("cm")}})
    await server.restart()
    await admin.exit_pod(ns, pod_name(exits, 1), 7)  # through the cluster's own apiserver
    await command(env, pub, f.stop(stops))
    await command(env, pub, f.create(later, sandbox_spec=SPEC))

    failed = await wait_phase(env, exits, "Error", timeout=90)
    assert failed["exit_code"] == 7
    await wait_phase(env, stops, "Stopped", timeout=90)
    await wait_phase(env, later, "Ready", timeout=90)
    await eventually(lambda: driver.listings, lambda n: n == 2, what="the relisting")

    # The relisting repeats what the watch had reported: ignored, no extra transition.
    assert await applied_phases(env, exits) == ["Provisioning", "Ready", "Error"]
    assert await applied_phases(env, stops) == ["Provisioning", "Ready", "Stopping", "Stopped"]
    assert await applied_phases(env, later) == ["Provisioning", "Ready"]


async def test_a_pod_deleted_behind_our_back_is_noticed_by_reconcile(
    admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    driver = HoldingDriver(new_driver(admin, ns))
    async with pipeline(driver, reconcile_interval=0.5) as (env, pub):
        await command(env, pub, f.create(key, sandbox_spec=SPEC))
        await wait_phase(env, key, "Ready")
        driver.hold(key)  # the watch's own report of the deletion never arrives
        await admin.delete_pod_now(ns, pod_name(key, 1))
        failed = await wait_phase(env, key, "Error")
        assert failed["reason"] == "runtime removed outside sandstream"
        removals = [
            h["message"] for h in await history(env, key)
            if h["message_type"] == "RuntimeRemoved" and h["disposition"] == "applied"
        ]  # fmt: skip
        assert [m["source"] for m in removals] == ["reconcile"]
        assert any(isinstance(o, RuntimeRemoved) for o in driver.held_of(key))


# -- head-of-line ----------------------------------------------------------------------------------


async def test_a_pod_that_never_terminates_does_not_delay_another_sandbox(
    admin: Admin, ns: str, keys: Keys
) -> None:
    stuck, free = keys(), keys()
    driver = new_driver(admin, ns, removal_margin=120.0)
    async with pipeline(driver) as (env, pub):
        for key in (stuck, free):
            await command(env, pub, f.create(key, sandbox_spec=SPEC))
            await wait_phase(env, key, "Ready")
        await admin.hold(ns, pod_name(stuck, 1))
        await command(env, pub, f.stop(stuck))
        await wait_pods(
            admin, ns, stuck, lambda p: bool(p and p[0]["metadata"].get("deletionTimestamp")),
            what="its deletion to begin",
        )  # fmt: skip

        # B's whole lifecycle while A's stop waits for a Pod that does not go away.
        await command(env, pub, f.stop(free))
        await wait_phase(env, free, "Stopped")
        await command(env, pub, f.start(free))
        await wait_phase(env, free, "Ready", generation=2)
        await command(env, pub, f.delete(free))
        await wait_phase(env, free, "Deleted")
        assert (await wait_phase(env, stuck, "Stopping"))["generation"] == 1
        assert await admin.pod_names(ns, stuck) == [pod_name(stuck, 1)]

        await admin.release(ns, pod_name(stuck, 1))
        await wait_phase(env, stuck, "Stopped")


# -- providers on Kubernetes ---------------------------------------------------------------------


async def test_a_rotation_restarts_the_pod_onto_a_new_secret_and_delete_removes_it(
    admin: Admin, ns: str, keys: Keys
) -> None:
    key = keys()
    provider = unique("kp")
    first, second = f"one-{secrets.token_hex(6)}", f"two-{secrets.token_hex(6)}"
    update = {"credentials_key": CREDENTIALS_KEY}
    driver = new_driver(admin, ns)
    try:
        async with (
            apikit.running_api(driver, settings_update=update) as api,
            api.client() as c,
        ):
            r = await c.post(
                "/v1/providers", json={"name": provider, "credentials": {"API_KEY": first}}
            )
            assert r.status_code == 201, r.text
            body = create_body(key, command=["sleep", "3600"])
            body["providers"] = [provider]
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await api.wait_phase(key, "Ready")

            async def values() -> dict[str, str]:
                return {
                    s["metadata"]["name"]: base64.b64decode(s["data"]["API_KEY"]).decode()
                    for s in await admin.secrets(ns, key)
                }

            assert await values() == {secret_name(key, 1): first}
            (pod,) = await admin.pods(ns, key)
            ref = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}["API_KEY"]
            assert ref["valueFrom"]["secretKeyRef"] == {
                "name": secret_name(key, 1),
                "key": "API_KEY",
            }

            r = await c.put(
                f"/v1/providers/{provider}/credentials", json={"credentials": {"API_KEY": second}}
            )
            assert r.status_code == 200, r.text
            await eventually(
                lambda: c.get(f"/v1/sandboxes/{key}"),
                lambda resp: (resp.json()["phase"], resp.json()["generation"]) == ("Ready", 2),
                what=f"{key} restarted at generation 2",
            )
            assert await values() == {secret_name(key, 2): second}
            seen = json.dumps(await admin.pods(ns, key)) + await admin.events_text(ns)
            assert first not in seen and second not in seen

            r = await c.delete(f"/v1/sandboxes/{key}", params={"wait": 30})
            await api.wait_phase(key, "Deleted", timeout=60)
            assert await admin.secrets(ns, key) == []
    finally:
        await driver.close()
