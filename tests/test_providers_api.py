"""The /v1/providers routes' answers to bad input and missing scopes (real PostgreSQL and Kafka;
the in-memory fake driver where a sandbox must be attached, none elsewhere)."""

from __future__ import annotations

import asyncio
import base64
import secrets

import apikit
import factories as f
from apikit import KEEPER, READER, WRITER, create_body, unique
from harness import eventually
from pydantic import SecretStr
from typer.testing import CliRunner

from drivers.fake import FakeDriver
from events.common import Phase
from events.decided import AgentRestarted, SandboxReady
from services.cli.main import app

KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())


async def test_bad_input_and_missing_scopes_get_clear_errors_and_change_nothing() -> None:
    name = unique("api-p")
    value = f"v-{secrets.token_hex(8)}"
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client() as c,
    ):
        created = await c.post("/v1/providers", json={"name": name, "credentials": {"K": value}})
        assert created.status_code == 201, created.text
        assert created.headers["location"] == f"/v1/providers/{name}"
        assert value not in created.text

        again = await c.post("/v1/providers", json={"name": name, "credentials": {}})
        assert (again.status_code, again.json()["code"]) == (409, "ALREADY_EXISTS")

        bad_key = await c.post("/v1/providers", json={"name": unique("x"),
                                                     "credentials": {"1BAD": "v"}})  # fmt: skip
        assert bad_key.status_code == 422 and "credentials" in bad_key.json()["message"]

        reserved = await c.put(f"/v1/providers/{name}/credentials",
                               json={"credentials": {"SANDSTREAM_IDENTITY": "x"}})  # fmt: skip
        assert reserved.status_code == 422
        assert "reserved" in reserved.json()["message"]

        missing = await c.put("/v1/providers/nope/credentials", json={"credentials": {"K": "v"}})
        assert (missing.status_code, missing.json()["code"]) == (404, "NOT_FOUND")
        twice = await c.post("/v1/providers:update", json={"providers": [
            {"name": name, "credentials": {}}, {"name": name, "credentials": {}}]})  # fmt: skip
        assert twice.status_code == 422 and "twice" in twice.json()["message"]

        got = await c.get(f"/v1/providers/{name}")
        assert got.json()["revision"] == 1 and [k["name"] for k in got.json()["keys"]] == ["K"]
        assert value not in got.text

        async with api.client(READER) as reader, api.client(WRITER) as writer:
            assert (await reader.get("/v1/providers")).status_code == 403
            denied = await writer.put(f"/v1/providers/{name}/credentials",
                                      json={"credentials": {"K": "other"}})  # fmt: skip
            assert denied.status_code == 403 and "provider:write" in denied.json()["message"]
            attach = await writer.post(f"/v1/sandboxes/{unique('sb')}:attach",
                                       json={"provider": name})  # fmt: skip
            assert attach.status_code == 403 and "provider:write" in attach.json()["message"]

        assert (await c.delete("/v1/providers/nope")).status_code == 404
        deleted = await c.delete(f"/v1/providers/{name}")
        assert deleted.status_code == 200
        assert deleted.json() == {"name": name, "detached": [], "unsent": []}
        assert (await c.get(f"/v1/providers/{name}")).status_code == 404


async def test_a_token_with_only_the_provider_scopes_manages_providers() -> None:
    """The API's front gate lets a request through on the scope its resource asks for, not
    on sandbox:read or sandbox:write for every path (it once refused such a token)."""
    name = unique("keeper")
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client(KEEPER) as keeper,
    ):
        created = await keeper.post("/v1/providers", json={"name": name, "credentials": {"K": "v"}})
        assert created.status_code == 201, created.text
        listed = await keeper.get("/v1/providers")
        assert listed.status_code == 200, listed.text
        assert name in listed.text
        refused = await keeper.get("/v1/sandboxes")
        assert refused.status_code == 403 and "sandbox:read" in refused.json()["message"]
        assert (await keeper.delete(f"/v1/providers/{name}")).status_code == 200


async def test_attach_with_an_expected_version_beyond_int64_is_422_naming_the_field() -> None:
    """Found by the fuzz run: the value passed the request model and failed the command's
    schema, a 500."""
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client() as c,
    ):
        for verb in ("attach", "detach"):
            answer = await c.post(
                f"/v1/sandboxes/{unique('sb')}:{verb}",
                json={"provider": "p", "expected_version": 2**63},
            )
            assert answer.status_code == 422, answer.text
            assert "expected_version" in answer.json()["message"]


async def test_a_malformed_provider_request_from_a_provider_token_is_422_not_403() -> None:
    """A malformed body is answered after authentication, with the scope of the resource: it
    once asked sandbox:write of every write and refused a provider-only token with a 403."""
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client(KEEPER) as keeper,
    ):
        answer = await keeper.post("/v1/providers", json={"name": 5, "credentials": {}})
        assert answer.status_code == 422, answer.text
        assert "name" in answer.json()["message"]


async def test_creating_a_sandbox_with_providers_needs_provider_write_as_attach_does() -> None:
    """A sandbox:write token once created a sandbox with a provider attached (201), handing
    the provider's values to an agent it controls: attaching at create needs provider:write,
    exactly as :attach does, and a refused create publishes nothing."""
    name = unique("p-create")
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client() as admin,
        api.client(WRITER) as writer,
    ):
        created = await admin.post("/v1/providers", json={"name": name, "credentials": {"K": "v"}})
        assert created.status_code == 201, created.text
        body = {**apikit.create_body(unique("sb")), "providers": [name]}
        refused = await writer.post("/v1/sandboxes", json=body)
        assert refused.status_code == 403, refused.text
        assert refused.json() == {
            "code": "PERMISSION_DENIED",
            "message": "token 'writer' lacks the scope provider:write "
            "(needed to attach providers at create)",
        }
        assert await api.commands_published() == 0
        # The CLI's create calls the same route: refused, with the reason, exit 1.
        argv = ["--url", api.url, "--token", WRITER, "sandbox", "create", unique("sb"),
                "--image", "registry.example/agent:1", "--provider", name, "--no-wait"]  # fmt: skip
        cli = await asyncio.to_thread(CliRunner().invoke, app, argv)
        assert cli.exit_code == 1
        assert "lacks the scope provider:write" in cli.output + str(cli.exception or "")
        assert await api.commands_published() == 0
        # Without providers the same token creates; with provider:write (admin) so can it.
        plain = await writer.post("/v1/sandboxes", json=apikit.create_body(unique("sb")))
        assert plain.status_code == 202, plain.text
        attached = await admin.post("/v1/sandboxes", json=body)
        assert attached.status_code == 202, attached.text
        assert await api.commands_published() == 2


async def test_a_forced_delete_detaches_so_it_needs_sandbox_write_as_well() -> None:
    """A forced delete detaches the provider from every sandbox, as a detach does: a token
    with only the provider scopes is refused before anything is sent (it used to publish a
    DetachProvider to every attached sandbox)."""
    p, sb = unique("forced"), unique("sb")
    async with (
        apikit.running_api(FakeDriver(), settings_update={"credentials_key": KEY}) as api,
        api.client() as admin,
        api.client(KEEPER) as keeper,
    ):
        created = await admin.post("/v1/providers", json={"name": p, "credentials": {"K": "v"}})
        assert created.status_code == 201, created.text
        body = create_body(sb) | {"providers": [p]}
        assert (await admin.post("/v1/sandboxes", json=body)).status_code in (201, 202)
        await api.wait_phase(sb, "Ready")
        published = await api.commands_published()

        denied = await keeper.delete(f"/v1/providers/{p}", params={"force": "true"})
        assert denied.status_code == 403, denied.text
        assert denied.json()["code"] == "PERMISSION_DENIED"
        assert "sandbox:write" in denied.json()["message"]
        assert await api.commands_published() == published  # no DetachProvider was sent
        assert (await admin.get(f"/v1/providers/{p}")).status_code == 200
        unforced = await keeper.delete(f"/v1/providers/{p}")
        assert (unforced.status_code, unforced.json()["code"]) == (412, "FAILED_PRECONDITION")

        forced = await admin.delete(f"/v1/providers/{p}", params={"force": "true"})
        assert forced.status_code == 200 and forced.json()["detached"] == [sb], forced.text
        await eventually(lambda: admin.get(f"/v1/sandboxes/{sb}"),
                         lambda r: r.json()["providers"] == [],
                         what=f"{p} detached from {sb}")  # fmt: skip


async def test_a_value_with_a_nul_is_422_naming_the_credentials_and_stores_nothing() -> None:
    """A hostile pass found a NUL accepted in a value (201) and then cut where the agent read
    it (on Podman it saw ``K=v``): an environment variable cannot hold one. It is refused as a
    NUL in a spec's env is, at create, at a credentials PUT and in a bulk update."""
    name = unique("api-nul")
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client() as c,
    ):
        made = await c.post("/v1/providers", json={"name": name, "credentials": {"K": "v\x00"}})
        assert made.status_code == 422, made.text
        assert "credentials" in made.json()["message"] and "NUL" in made.json()["message"]
        assert (await c.get(f"/v1/providers/{name}")).status_code == 404

        made = await c.post("/v1/providers", json={"name": name, "credentials": {"K": "v"}})
        assert made.status_code == 201, made.text
        put = await c.put(f"/v1/providers/{name}/credentials",
                          json={"credentials": {"K": "w\x00"}})  # fmt: skip
        bulk = await c.post("/v1/providers:update", json={"providers": [
            {"name": name, "credentials": {"K": "\x00"}}]})  # fmt: skip
        for answer in (put, bulk):
            assert answer.status_code == 422, answer.text
            assert "NUL" in answer.json()["message"]
        assert (await c.get(f"/v1/providers/{name}")).json()["revision"] == 1


async def test_creating_a_sandbox_with_a_missing_provider_is_404_as_attach_is() -> None:
    """It used to create a Ready sandbox attached to a provider that does not exist; the CLI's
    create calls the same route. Nothing is published."""
    missing, sb = unique("nope"), unique("sb")
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client() as admin,
    ):
        body = create_body(sb) | {"providers": [missing]}
        refused = await admin.post("/v1/sandboxes", json=body)
        assert refused.status_code == 404, refused.text
        assert refused.json() == {
            "code": "NOT_FOUND",
            "message": f"field 'providers': provider {missing!r} not found",
        }
        attach = await admin.post(f"/v1/sandboxes/{sb}:attach", json={"provider": missing})
        assert attach.status_code == 404, attach.text
        assert attach.json()["message"] == f"provider {missing!r} not found"
        assert await api.commands_published() == 0


async def test_a_retried_create_gets_its_first_answer_after_its_provider_was_deleted() -> None:
    """A retry with the same command_id is answered from the first request: the provider check
    of a create (above) runs only for an id not yet recorded. With the check first, the retry
    of a create whose provider was deleted in between was a 404."""
    provider, sb = unique("rp"), unique("sb")
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client() as admin,
    ):
        made = await admin.post("/v1/providers", json={"name": provider, "credentials": {"K": "v"}})
        assert made.status_code == 201, made.text
        body = create_body(sb) | {"providers": [provider], "command_id": "rp-" + sb}
        first = await admin.post("/v1/sandboxes", json=body)
        assert first.status_code == 202, first.text  # no processor here: published, pending
        assert (await admin.delete(f"/v1/providers/{provider}")).status_code == 200
        again = await admin.post("/v1/sandboxes", json=body)
        assert again.status_code == 202, again.text
        assert again.json()["command_id"] == "rp-" + sb
        assert await api.commands_published() == 1


async def test_a_provider_created_again_goes_on_from_its_last_revision() -> None:
    """Regression: a provider deleted and created again under its name started again at
    revision 1, while launches and rotations compare revisions as numbers. A launch that had
    read the deleted provider's revision 3 then counted as having read the new one's rotation
    to revision 2, and the agent stayed Ready on the deleted provider's values. Now the new
    incarnation goes on from 4, and that launch restarts once more."""
    name = unique("again")
    async with (
        apikit.running_api(None, settings_update={"credentials_key": KEY}) as api,
        api.client() as c,
    ):

        async def revision() -> int:
            got = await c.get(f"/v1/providers/{name}")
            assert got.status_code == 200, got.text
            return int(got.json()["revision"])

        made = await c.post("/v1/providers", json={"name": name, "credentials": {"K": "a1"}})
        assert made.status_code == 201, made.text
        for value in ("a2", "a3"):
            put = await c.put(f"/v1/providers/{name}/credentials",
                              json={"credentials": {"K": value}})  # fmt: skip
            assert put.status_code == 200, put.text
        old_last = await revision()
        assert old_last == 3
        assert (await c.delete(f"/v1/providers/{name}")).status_code == 200
        again = await c.post("/v1/providers", json={"name": name, "credentials": {"K": "b1"}})
        assert again.status_code == 201, again.text
        assert await revision() == old_last + 1  # not 1
        rotated = await c.put(f"/v1/providers/{name}/credentials",
                              json={"credentials": {"K": "b2"}})  # fmt: skip
        assert rotated.status_code == 200, rotated.text
        new_rotation = await revision()
        # The unknown name gets 1, as ever.
        fresh = unique("fresh")
        first = await c.post("/v1/providers", json={"name": fresh, "credentials": {"K": "x"}})
        assert first.status_code == 201
        assert (await c.get(f"/v1/providers/{fresh}")).json()["revision"] == 1

    # The rule with these revisions: a launch pending when the new provider's rotation came,
    # which had read the deleted provider's last revision, must not leave the agent Ready.
    h = f.harness_in(Phase.PROVISIONING, providers=[name])
    h.send(f.rotate(rotations={name: new_rotation}))
    d = h.send(f.result(credentials={name: old_last}))
    assert [type(e) for e in d.events] == [SandboxReady, AgentRestarted], d.reason
    assert h.row().phase is Phase.STARTING
