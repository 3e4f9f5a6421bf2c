"""Provider writes are idempotent by their request id (``command_id``, as the commands), on the
real stack (Kafka, PostgreSQL, the processor, the fake driver): a retried write gets the first
outcome and changes nothing (no second revision, no second restart, even when another write
came in between); the same id with another request is 409 IDEMPOTENCY_CONFLICT naming
``command_id``; and no value is stored in plaintext to compare them. The CLI resends its own
write, id and all, when the answer is lost."""

from __future__ import annotations

import asyncio
import base64
import secrets

import apikit
import factories as f
import httpx
from apikit import unique
from harness import eventually
from pydantic import SecretStr
from test_cli_retry import LosesTheFirstAnswer

from drivers.fake import FakeDriver
from events.publisher import now
from services.cli.client import Connection
from services.cli.providers import _write

KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
SETTINGS = {"credentials_key": KEY}


def conflict(r: httpx.Response) -> None:
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["code"] == "IDEMPOTENCY_CONFLICT" and "command_id" in body["message"]
    # The body names the key as a sandbox command's conflict does (it had no command_id).
    assert body.get("command_id") and body["command_id"] in body["message"], body


async def rotations(api: apikit.Api, name: str) -> list[str]:
    """The sandbox's RotateCredentials history entries' command ids."""
    rows = await api.env.fetch(
        "SELECT command_id FROM history WHERE key = $1 AND message_type = 'RotateCredentials' "
        "ORDER BY id",
        name,
    )
    return [r["command_id"] for r in rows]


async def test_a_retried_credentials_put_rotates_and_restarts_once() -> None:
    """The retry comes after another client's write: without the id it would put the first
    values back (a third revision, a third restart)."""
    p, box = unique("rid-p"), unique("rid-s")
    first, other = "value-" + secrets.token_hex(8), "value-" + secrets.token_hex(8)
    async with apikit.running_api(FakeDriver(), settings_update=SETTINGS) as api:
        async with api.client() as c:
            r = await c.post("/v1/providers", json={"name": p, "credentials": {"K": "one"}})
            assert r.status_code == 201, r.text
        async with await api.env.publisher() as publisher:
            await publisher.publish(f.create(box, providers=[p], occurred_at=now()))
        await api.wait_phase(box, "Ready")

        put = {"credentials": {"K": first}, "command_id": "rot-" + p}
        between = {"credentials": {"K": other}, "command_id": "other-" + p}
        path = f"/v1/providers/{p}/credentials"
        async with api.client() as c:
            answers = [await c.put(path, json=put)]
            answers.append(await c.put(path, json=put))  # at once
            assert [a.status_code for a in answers] == [200, 200], answers[1].text
            receipt = answers[0].json()
            assert [(x["revision"], x["rotated"]) for x in receipt["providers"]] == [(2, ["K"])]
            assert [x["action"] for x in receipt["sandboxes"]] == ["restart"]
            assert answers[1].json() == receipt
            await wait_generation(api, box, 2)

            r = await c.put(path, json=between)  # another client's write
            assert r.status_code == 200, r.text
            assert [x["revision"] for x in r.json()["providers"]] == [3]
            await wait_generation(api, box, 3)
            late = await c.put(path, json=put)  # the first client's retry, after it
            assert late.status_code == 200, late.text
            assert late.json() == receipt
            assert (await c.get(f"/v1/providers/{p}")).json()["revision"] == 3

            # The same id for another request: other values, flags, verb, caller.
            conflict(await c.put(path, json={**put, "credentials": {"K": other}}))
            conflict(await c.put(path, json={**put, "no_restart": True}))
            async with api.client(apikit.KEEPER) as keeper:
                conflict(await keeper.put(path, json=put))
            conflict(await c.request(
                "DELETE", f"/v1/providers/{p}", json={"command_id": put["command_id"]}
            ))  # fmt: skip
            assert (await c.get(f"/v1/providers/{p}")).json()["revision"] == 3

        restarts = [receipt["sandboxes"][0]["command_id"], r.json()["sandboxes"][0]["command_id"]]
        assert await rotations(api, box) == restarts
        assert await api.env.fetch("SELECT command_id FROM provider_outbox") == []
        assert await api.env.fetchval("SELECT generation FROM sandboxes WHERE key = $1", box) == 3

        stored = await api.env.fetch(
            "SELECT fingerprint, outcome::text AS outcome FROM api_commands WHERE command_id = $1",
            put["command_id"],
        )
        assert len(stored) == 1
        assert first not in stored[0]["fingerprint"] + stored[0]["outcome"]


async def wait_generation(api: apikit.Api, name: str, generation: int) -> None:
    await eventually(
        lambda: api.env.fetch("SELECT generation, phase FROM sandboxes WHERE key = $1", name),
        lambda rows: rows[0]["generation"] >= generation and rows[0]["phase"] == "Ready",
        what=f"{name} Ready in generation {generation}",
    )


async def test_a_retried_create_update_and_delete_answer_their_first_outcome() -> None:
    p = unique("rid-c")
    async with (
        apikit.running_api(FakeDriver(), settings_update=SETTINGS) as api,
        api.client() as c,
    ):
        make = {"name": p, "credentials": {"K": "one"}, "command_id": "mk-" + p}
        made = [await c.post("/v1/providers", json=make) for _ in range(2)]
        assert [m.status_code for m in made] == [201, 201], made[1].text
        assert made[1].json() == made[0].json()
        conflict(await c.post("/v1/providers", json={**make, "credentials": {"K": "two"}}))
        conflict(await c.post("/v1/providers", json={**make, "name": unique("rid-o")}))
        # A refused write records nothing.
        exists = await c.post("/v1/providers", json={**make, "command_id": "again-" + p})
        assert exists.status_code == 409 and exists.json()["code"] == "ALREADY_EXISTS"
        known = "SELECT command_id FROM api_commands WHERE command_id = $1"
        assert await api.env.fetch(known, "again-" + p) == []
        # One namespace with the sandbox commands' ids, both ways.
        stop = await c.post(
            f"/v1/sandboxes/{unique()}:stop", json={"command_id": make["command_id"]}
        )
        assert stop.status_code == 409 and stop.json()["code"] == "IDEMPOTENCY_CONFLICT", stop.text
        used = await c.post(f"/v1/sandboxes/{unique()}:stop", json={"command_id": "cmd-" + p})
        assert used.status_code == 202, used.text
        conflict(await c.post("/v1/providers", json={**make, "command_id": "cmd-" + p}))
        assert (await c.get(f"/v1/providers/{p}")).json()["revision"] == 1

        many = {"providers": [{"name": p, "credentials": {"K": "two"}}], "command_id": "up-" + p}
        ups = [await c.post("/v1/providers:update", json=many) for _ in range(2)]
        assert [u.status_code for u in ups] == [200, 200], ups[1].text
        assert ups[1].json() == ups[0].json()
        assert [(x["revision"], x["rotated"]) for x in ups[0].json()["providers"]] == [(2, ["K"])]
        conflict(await c.post("/v1/providers:update", json={**many, "create_missing": True}))
        assert (await c.get(f"/v1/providers/{p}")).json()["revision"] == 2

        drop = {"command_id": "rm-" + p}
        dropped = [await c.request("DELETE", f"/v1/providers/{p}", json=drop)
                   for _ in range(2)]  # fmt: skip
        assert [d.status_code for d in dropped] == [200, 200], dropped[1].text
        assert dropped[1].json() == dropped[0].json() == {
            "name": p, "detached": [], "unsent": []
        }  # fmt: skip
        conflict(await c.request(
            "DELETE", f"/v1/providers/{p}", params={"force": "true"}, json=drop
        ))  # fmt: skip
        gone = await c.post("/v1/providers", json=make)  # the create's retry, too late
        assert gone.status_code == 404 and "deleted since" in gone.json()["message"], gone.text
        # A new id is a new request: the provider is gone.
        gone = await c.request("DELETE", f"/v1/providers/{p}", json={"command_id": "rm2-" + p})
        assert gone.status_code == 404, gone.text


class LosesTheFirstPut(LosesTheFirstAnswer):
    method = "PUT"


async def test_the_cli_resends_a_write_whose_answer_is_lost_without_a_second_revision() -> None:
    p = unique("rid-cli")
    async with apikit.running_api(None, settings_update=SETTINGS) as api:
        async with api.client() as c:
            r = await c.post("/v1/providers", json={"name": p, "credentials": {"K": "one"}})
            assert r.status_code == 201, r.text
        client = LosesTheFirstPut(api.env.settings, Connection(api.url, apikit.ADMIN, None))
        body = {"credentials": {"K": "two"}, "no_restart": False}  # `sandstream provider update`
        receipt = await asyncio.to_thread(
            _write, client, "PUT", f"/v1/providers/{p}/credentials", body, None, 60.0
        )
        assert client.lost == 1  # the first answer was lost, the resend got the outcome
        # The first outcome (a rotation), not what a second write would say (unchanged).
        assert [(x["revision"], x["rotated"]) for x in receipt["providers"]] == [(2, ["K"])]
        async with api.client() as c:
            assert (await c.get(f"/v1/providers/{p}")).json()["revision"] == 2
        ids = await api.env.fetch(
            "SELECT command_id FROM api_commands WHERE command_type = 'UpdateProviders' "
            "AND key = $1",
            p,
        )
        assert len(ids) == 1 and ids[0]["command_id"].startswith("cli-")
