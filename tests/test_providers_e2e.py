"""Providers end to end on the real stack: Kafka, PostgreSQL, Podman, the processor, executor,
watcher and the HTTP API.

Three sandboxes attached to P (Ready, Stopped, Deleting) and one Ready sandbox attached to P
and Q: rotating P and Q in one update restarts the two Ready ones exactly once each, skips the
others with their reasons, and the restarted agents see the new values; a baseline restarts
nothing; a redelivered restart command restarts nothing; ``no_restart`` restarts nothing and
the next start sees the new value. Afterwards every topic, every table, the logs, every API
answer and ``podman inspect`` of the containers and secrets are searched for the values.

A rotation in a separate update while a restart is pending restarts nothing more when the
pending launch reads after it (one restart, both new values), and once more when the launch
had already read the older value (it ends on the newest).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
from typing import Any

import apikit
import pytest
from apikit import create_body, unique
from harness import eventually
from pipeline_support import IGNORE_TERM
from podman import PodmanClient
from pydantic import SecretStr

from events.commands import ProviderRotation, RotateCredentials
from events.publisher import now
from projections.lifecycle import RESTART_PENDING
from services.common.settings import load_settings
from services.executor.backends import podman_driver

KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())


def value(tag: str) -> str:
    return f"sekrit-{tag}-{secrets.token_hex(8)}"


async def history(c: Any, name: str) -> list[dict[str, Any]]:
    page = await c.get(f"/v1/sandboxes/{name}/history", params={"limit": 1000})
    assert page.status_code == 200, page.text
    items: list[dict[str, Any]] = page.json()["items"]
    return items


def events_of(entries: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [h for h in entries if kind in (h.get("events") or [])]


# The agent records the environment it was started with (exec sessions have their own).
AGENT = ["sh", "-c", "env > /tmp/agent.env; exec sleep 3600"]


async def env_in(driver: Any, name: str, generation: int, var: str) -> str:
    code, out = await asyncio.wait_for(driver.exec(name, generation, ["cat", "/tmp/agent.env"]), 30)
    assert code == 0, out
    seen = dict(line.split("=", 1) for line in str(out).splitlines() if "=" in line)
    return seen.get(var, "")


async def test_rotation_restarts_exactly_the_running_attached_and_no_value_leaks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = load_settings()
    driver = podman_driver(settings, stop_timeout=5)
    podman = PodmanClient(base_url=settings.podman_url)
    p, q = unique("prov-p"), unique("prov-q")
    ready1, ready2, stopped, deleting = (unique(n) for n in ("ready", "both", "stopped", "del"))
    names = (ready1, ready2, stopped, deleting)
    values = {"p1": value("p1"), "q1": value("q1"), "p2": value("p2"), "q2": value("q2"),
              "p3": value("p3"), "extra": value("extra")}  # fmt: skip
    answers: list[str] = []
    inspected: list[str] = []
    try:
        async with apikit.running_api(driver, settings_update={"credentials_key": KEY}) as api:
            async with api.client() as c:

                async def call(method: str, path: str, **kw: Any) -> Any:
                    response = await c.request(method, path, **kw)
                    answers.append(response.text)
                    return response

                # Providers: their first values are a baseline.
                for name, key, v in ((p, "API_KEY", values["p1"]), (q, "TOKEN", values["q1"])):
                    r = await call("POST", "/v1/providers",
                                   json={"name": name, "credentials": {key: v}})  # fmt: skip
                    assert r.status_code == 201, r.text
                    assert r.json()["keys"][0]["fingerprint"].startswith("hmac-sha256:")

                def body(name: str, providers: list[str], **spec: Any) -> dict[str, Any]:
                    b = create_body(name, **spec)
                    b["spec"]["image"] = api.env.settings.sandbox_image
                    b["providers"] = providers
                    return b

                for name, provs in ((ready1, [p]), (ready2, [p, q]), (stopped, [p])):
                    r = await call("POST", "/v1/sandboxes", params={"wait": 30},
                                   json=body(name, provs, command=AGENT))  # fmt: skip
                    assert r.status_code == 201, r.text
                r = await call("POST", "/v1/sandboxes", params={"wait": 30},
                               json=body(deleting, [p], command=IGNORE_TERM,
                                         stop_timeout_seconds=20))  # fmt: skip
                assert r.status_code == 201, r.text
                for name in names:
                    await api.wait_phase(name, "Ready")
                assert await env_in(driver, ready2, 1, "API_KEY") == values["p1"]
                assert await env_in(driver, ready2, 1, "TOKEN") == values["q1"]

                r = await call("POST", f"/v1/sandboxes/{stopped}:stop", params={"wait": 30})
                await api.wait_phase(stopped, "Stopped")
                r = await call("DELETE", f"/v1/sandboxes/{deleting}", params={"wait": 30})
                assert r.json()["phase"] == "Deleting", r.text

                # A new key is a baseline; the same value again changes nothing.
                r = await call("POST", "/v1/providers:update", json={"providers": [
                    {"name": p, "credentials": {"API_KEY": values["p1"], "EXTRA": values["extra"]}},
                    {"name": q, "credentials": {"TOKEN": values["q1"]}},
                ]})  # fmt: skip
                assert r.status_code == 200, r.text
                assert r.json()["sandboxes"] == []
                changes = {x["name"]: x for x in r.json()["providers"]}
                assert changes[p]["baseline"] == ["EXTRA"] and changes[q]["unchanged"] == ["TOKEN"]

                # P and Q rotate together.
                r = await call("POST", "/v1/providers:update", json={"providers": [
                    {"name": p, "credentials": {"API_KEY": values["p2"], "EXTRA": values["extra"]}},
                    {"name": q, "credentials": {"TOKEN": values["q2"]}},
                ]})  # fmt: skip
                assert r.status_code == 200, r.text
                receipt = {line["sandbox"]: line for line in r.json()["sandboxes"]}
                assert set(receipt) == set(names)
                assert receipt[ready1]["action"] == receipt[ready2]["action"] == "restart"
                assert receipt[ready2]["providers"] == sorted([p, q])
                assert receipt[stopped]["action"] == "skip"
                assert receipt[stopped]["reason"].startswith("stopped")
                assert receipt[deleting]["reason"] == "being deleted"

                for name in (ready1, ready2):
                    await eventually(
                        lambda n=name: c.get(f"/v1/sandboxes/{n}"),
                        lambda resp: (
                            resp.json()["phase"] == "Ready" and resp.json()["generation"] == 2
                        ),
                        what=f"{name} restarted at generation 2",
                    )
                assert await env_in(driver, ready2, 2, "API_KEY") == values["p2"]
                assert await env_in(driver, ready2, 2, "TOKEN") == values["q2"]
                assert await env_in(driver, ready1, 2, "API_KEY") == values["p2"]

                # A redelivered restart command (same id) restarts nothing.
                async with await api.env.publisher() as publisher:
                    await publisher.publish(RotateCredentials(
                        type="RotateCredentials", command_id=receipt[ready2]["command_id"],
                        key=ready2, occurred_at=now(), actor="test",
                        rotations=[ProviderRotation(provider=p, revision=3)],
                    ))  # fmt: skip
                await eventually(
                    lambda: history(c, ready2),
                    lambda hs: any(h["disposition"] == "duplicate" for h in hs),
                    what="the redelivered restart recorded as a duplicate",
                )

                entries = {n: await history(c, n) for n in names}
                assert len(events_of(entries[ready1], "AgentRestarted")) == 1
                assert len(events_of(entries[ready2], "AgentRestarted")) == 1
                for name in (stopped, deleting):
                    assert events_of(entries[name], "AgentRestarted") == []
                    assert len(events_of(entries[name], "AgentRestartSkipped")) == 1

                # Inspect every container and secret while they exist.
                for name in (ready1, ready2, stopped):
                    for ctr in podman.containers.list(
                        all=True, filters={"label": f"io.sandstream.key={name}"}
                    ):
                        inspected.append(json.dumps(ctr.attrs))
                for secret in podman.secrets.list():
                    inspected.append(
                        json.dumps(podman.api.get(f"/secrets/{secret.id}/json").json())
                    )
                assert any("TOKEN" in s for s in inspected)  # the secrets were there to inspect

                # no_restart: nothing restarts; the next start sees the new value.
                r = await call("PUT", f"/v1/providers/{p}/credentials", json={
                    "credentials": {"API_KEY": values["p3"]}, "no_restart": True})  # fmt: skip
                assert r.status_code == 200, r.text
                assert {line["action"] for line in r.json()["sandboxes"]} == {"skip"}
                r = await call("POST", f"/v1/sandboxes/{stopped}:start", params={"wait": 30})
                await eventually(
                    lambda: c.get(f"/v1/sandboxes/{stopped}"),
                    lambda resp: resp.json()["phase"] == "Ready",
                    what=f"{stopped} Ready again",
                )
                generation = (await c.get(f"/v1/sandboxes/{stopped}")).json()["generation"]
                assert await env_in(driver, stopped, generation, "API_KEY") == values["p3"]
                assert (await c.get(f"/v1/sandboxes/{ready1}")).json()["generation"] == 2

                # Delete everything; then no value is anywhere.
                r = await call("DELETE", f"/v1/providers/{p}")
                assert r.status_code == 412, r.text
                for name in names:
                    await call("DELETE", f"/v1/sandboxes/{name}", params={"wait": 30})
                for name in names:
                    await api.wait_phase(name, "Deleted", timeout=60)
                leftover = [
                    s.name for s in podman.secrets.list() if any(n in str(s.name) for n in names)
                ]
                assert leftover == []
                for path in (
                    f"/v1/providers/{p}",
                    "/v1/providers",
                    *(f"/v1/sandboxes/{n}" for n in names),
                ):
                    await call("GET", path)
                for name in names:
                    answers.append(json.dumps(await history(c, name)))

            env = api.env
            topics = []
            for topic in env.settings.topics:
                topics.extend(r.value or b"" for r in await env.read_topic(topic))
            tables = await env.fetch(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = $1",
                env.settings.pg_schema,
            )
            rows = []
            for t in tables:
                rows.extend(
                    str(r[0]) for r in await env.fetch(f'SELECT t::text FROM "{t["table_name"]}" t')
                )
    finally:
        for name in names:
            await driver.delete(name)
        await driver.close()
        podman.close()

    logs = "\n".join(
        r.getMessage() + (str(r.exc_info) if r.exc_info else "") for r in caplog.records
    )
    assert topics and rows and answers and inspected and logs
    blobs = b"\n".join(topics)
    for secret in values.values():
        assert secret.encode() not in blobs, "a value on a topic"
        assert not [r for r in rows if secret in r], "a value in a table"
        assert not [a for a in answers if secret in a], "a value in an API answer"
        assert not [i for i in inspected if secret in i], "a value in podman inspect"
        assert secret not in logs, "a value in the logs"


class LaunchGate:
    """Holds the launch reads of chosen sandboxes (a deterministic race, around the real
    credential source): ``before`` ones wait before reading the values, ``after`` ones read
    them and then wait, so a rotation can be stored while the launch is pending either way."""

    def __init__(self, source: Any, before: str, after: str) -> None:
        self.source, self.before, self.after = source, before, after
        self.entered: set[str] = set()
        self.release = asyncio.Event()

    async def __call__(self, key: str) -> Any:
        if key == self.before and key not in self.entered:
            self.entered.add(key)
            await self.release.wait()
            return await self.source(key)
        values = await self.source(key)
        if key == self.after and key not in self.entered:
            self.entered.add(key)
            await self.release.wait()
        return values


async def test_a_rotation_while_a_restart_is_pending_restarts_once_onto_the_newest() -> None:
    settings = load_settings()
    driver = podman_driver(settings, stop_timeout=5)
    p, q = unique("prov-p"), unique("prov-q")
    unread, read = unique("unread"), unique("read")
    values = {"p1": value("p1"), "q1": value("q1"), "p2": value("p2"), "q2": value("q2")}
    try:
        settings_update = {"credentials_key": KEY}
        async with (
            apikit.running_api(driver, settings_update=settings_update) as api,
            api.client() as c,
        ):
            for name, key, v in ((p, "API_KEY", values["p1"]), (q, "TOKEN", values["q1"])):
                r = await c.post("/v1/providers", json={"name": name, "credentials": {key: v}})
                assert r.status_code == 201, r.text
            for name in (unread, read):
                b = create_body(name, command=AGENT)
                b["spec"]["image"] = api.env.settings.sandbox_image
                b["providers"] = [p, q]
                r = await c.post("/v1/sandboxes", params={"wait": 30}, json=b)
                assert r.status_code == 201, r.text
            for name in (unread, read):
                await api.wait_phase(name, "Ready")
            executor = api.plane.executor if api.plane else None
            assert executor is not None and executor.credentials is not None
            gate = LaunchGate(executor.credentials, before=unread, after=read)
            executor.credentials = gate

            # P rotates: both restart; their launches are held (one before, one after
            # reading the values).
            r = await c.put(f"/v1/providers/{p}/credentials",
                            json={"credentials": {"API_KEY": values["p2"]}})  # fmt: skip
            assert r.status_code == 200, r.text
            assert {line["action"] for line in r.json()["sandboxes"]} == {"restart"}
            await eventually(lambda: set(gate.entered), lambda s: s == {unread, read},
                             what="both restart launches pending")  # fmt: skip

            # Q rotates in a separate update while both restarts are pending.
            r = await c.put(f"/v1/providers/{q}/credentials",
                            json={"credentials": {"TOKEN": values["q2"]}})  # fmt: skip
            assert r.status_code == 200, r.text
            for line in r.json()["sandboxes"]:
                assert (line["action"], line["reason"]) == ("skip", RESTART_PENDING)
            for name in (unread, read):
                await eventually(
                    lambda n=name: history(c, n),
                    lambda hs: any("AgentRestartSkipped" in (h.get("events") or [])
                                   for h in hs),
                    what=f"{name}: the second rotation recorded as awaited",
                )  # fmt: skip
            gate.release.set()

            # The launch that read after Q was stored runs both new values: one restart.
            # The one that had read Q's old value restarts once more, onto the newest.
            for name, generation in ((unread, 2), (read, 3)):
                await eventually(
                    lambda n=name: c.get(f"/v1/sandboxes/{n}"),
                    lambda resp, g=generation: (
                        (resp.json()["phase"], resp.json()["generation"]) == ("Ready", g)
                    ),
                    what=f"{name} Ready at generation {generation}",
                )
                assert await env_in(driver, name, generation, "API_KEY") == values["p2"]
                assert await env_in(driver, name, generation, "TOKEN") == values["q2"]
            unread_restarts = events_of(await history(c, unread), "AgentRestarted")
            read_restarts = events_of(await history(c, read), "AgentRestarted")
            assert (len(unread_restarts), len(read_restarts)) == (1, 2)
            assert (await c.get(f"/v1/sandboxes/{unread}")).json()["generation"] == 2
    finally:
        for name in (unread, read):
            await driver.delete(name)
        await driver.close()


async def test_a_provider_deleted_and_created_again_restarts_its_sandboxes_on_rotation() -> None:
    """A provider deleted (forced) and created again starts at revision 1 again. Rotation
    command ids once derived from (sandbox, provider, revision) alone, so the new provider's
    first rotation repeated the id of the old one's: the receipt said `restart`, the processor
    took the command for a duplicate, and the agent kept the old value."""
    settings = load_settings()
    driver = podman_driver(settings, stop_timeout=5)
    p, name = unique("again"), unique("again")
    values = {tag: value(tag) for tag in ("old1", "old2", "new1", "new2")}
    try:
        async with (
            apikit.running_api(driver, settings_update={"credentials_key": KEY}) as api,
            api.client() as c,
        ):

            async def rotate(v: str) -> dict[str, Any]:
                r = await c.put(f"/v1/providers/{p}/credentials",
                                json={"credentials": {"API_KEY": v}})  # fmt: skip
                assert r.status_code == 200, r.text
                (line,) = r.json()["sandboxes"]
                assert line["action"] == "restart", line
                return dict(line)

            async def create_provider(v: str) -> None:
                r = await c.post("/v1/providers", json={"name": p, "credentials": {"API_KEY": v}})
                assert r.status_code == 201, r.text

            async def ready_at(generation: int) -> None:
                await eventually(
                    lambda: c.get(f"/v1/sandboxes/{name}"),
                    lambda r: (r.json()["phase"], r.json()["generation"]) == ("Ready", generation),
                    what=f"{name} Ready at generation {generation}",
                )

            await create_provider(values["old1"])
            body = create_body(name, command=AGENT) | {"providers": [p]}
            body["spec"]["image"] = api.env.settings.sandbox_image
            assert (
                await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            ).status_code == 201
            await api.wait_phase(name, "Ready")
            first = await rotate(values["old2"])  # revision 2 of the first provider
            await ready_at(2)

            r = await c.delete(f"/v1/providers/{p}", params={"force": "true"})
            assert r.status_code == 200 and r.json()["detached"] == [name], r.text
            detached = await eventually(
                lambda: c.get(f"/v1/sandboxes/{name}"),
                lambda r: r.json()["providers"] == [] and r.json()["phase"] == "Ready",
                what=f"{name} Ready without {p}",
            )
            await create_provider(values["new1"])
            r = await c.post(f"/v1/sandboxes/{name}:attach", params={"wait": 30},
                             json={"provider": p})  # fmt: skip
            assert r.status_code == 200 and r.json()["status"] == "accepted", r.text

            generation = detached.json()["generation"]
            again = await rotate(values["new2"])  # revision 2 again, of the new provider
            await ready_at(generation + 1)
            assert await env_in(driver, name, generation + 1, "API_KEY") == values["new2"]
            assert again["command_id"] != first["command_id"]
    finally:
        await driver.delete(name)
        await driver.close()


async def test_a_provider_detached_from_a_ready_sandbox_leaves_its_running_agent() -> None:
    """A Ready sandbox that loses a provider restarts without its values: the new agent no
    longer sees them (a detach once left them in the running agent, out of reach of every
    later rotation). With no_restart it keeps running; the values leave at its next start."""
    settings = load_settings()
    driver = podman_driver(settings, stop_timeout=5)
    p, q, name = unique("gone-p"), unique("gone-q"), unique("detached")
    values = {"p": value("p"), "q": value("q")}
    try:
        async with (
            apikit.running_api(driver, settings_update={"credentials_key": KEY}) as api,
            api.client() as c,
        ):
            for provider, key, v in ((p, "P_KEY", values["p"]), (q, "Q_KEY", values["q"])):
                r = await c.post("/v1/providers",
                                 json={"name": provider, "credentials": {key: v}})  # fmt: skip
                assert r.status_code == 201, r.text
            body = create_body(name, command=AGENT) | {"providers": [p, q]}
            body["spec"]["image"] = api.env.settings.sandbox_image
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await api.wait_phase(name, "Ready")
            assert await env_in(driver, name, 1, "P_KEY") == values["p"]

            r = await c.post(f"/v1/sandboxes/{name}:detach", params={"wait": 30},
                             json={"provider": p})  # fmt: skip
            assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
            await eventually(
                lambda: c.get(f"/v1/sandboxes/{name}"),
                lambda r: (r.json()["phase"], r.json()["generation"]) == ("Ready", 2),
                what=f"{name} restarted without {p}",
            )
            assert await env_in(driver, name, 2, "P_KEY") == ""
            assert await env_in(driver, name, 2, "Q_KEY") == values["q"]
            (restart,) = events_of(await history(c, name), "AgentRestarted")
            assert "without" in restart["reason"]

            r = await c.post(f"/v1/sandboxes/{name}:detach", params={"wait": 30},
                             json={"provider": q, "no_restart": True})  # fmt: skip
            assert r.status_code == 200 and "no-restart" in r.json()["message"], r.text
            row = (await c.get(f"/v1/sandboxes/{name}")).json()
            assert (row["phase"], row["generation"], row["providers"]) == ("Ready", 2, [])
    finally:
        await driver.delete(name)
        await driver.close()
