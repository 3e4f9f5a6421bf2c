"""Claims on the real stack (Kafka, PostgreSQL, Podman): a warm pool's Ready member adopted
under the claimant's name, decided in two steps on the log (docs/adr/0009), through
``services.api.claims.claim`` and the HTTP API's doors."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import apikit
import pytest
import pytest_asyncio
from apikit import Api, unique
from claims_support import adoptions, all_ready, bindings, create_members
from harness import eventually
from openshell_support import auth, serving_door

from events.commands import AdoptSandbox, CreateSandbox
from events.common import SandboxSpec
from events.observations import RuntimeSnapshot
from events.publisher import new_command_id, now
from services.api.claims import _bound, claim
from services.api.gateway import CommandGateway
from services.audit.verify import verify
from services.common.settings import load_settings
from services.executor.backends import podman_driver
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import openshell_pb2_grpc
from services.processor.rebuild import rebuild_and_compare

IMAGE = load_settings().sandbox_image


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def driver() -> AsyncIterator[Any]:
    made = podman_driver(load_settings())
    try:
        yield made
    finally:
        await made.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api(driver: Any) -> AsyncIterator[Api]:
    async with apikit.running_api(driver) as running:
        yield running


def gateway_of(api: Api) -> CommandGateway:
    gateway: CommandGateway = api.app.state.api.gateway
    return gateway


def new_pool() -> str:
    return unique("pool")


async def claimed(api: Api, pool: str, name: str, **kw: Any) -> Any:
    return await claim(gateway_of(api), pool, name, actor="alice", claim_id=str(uuid.uuid4()), **kw)


async def cleanup(api: Api, names: list[str]) -> None:
    async with api.client() as c:
        for name in names:
            await c.delete(f"/v1/sandboxes/{name}")


async def test_a_claim_adopts_a_ready_member_and_its_name_works_at_every_door(api: Api) -> None:
    """Warm: the claimant's name reads the member (name and member_key), execs in it, shows
    the adoption in its history and the claim's labels without a restart; delete by the name
    deletes the member and frees the name, which a cold create then takes."""
    pool = new_pool()
    [member] = await create_members(gateway_of(api), pool, 1, IMAGE, labels={"tier": "warm"})
    await all_ready(api.env.pool, [member])
    name = unique("mine")
    result = await claimed(api, pool, name, labels={"team": "a"})
    assert (result.warm, result.member) == (True, member), result
    async with api.client() as c:
        r = await c.get(f"/v1/sandboxes/{name}")
        assert r.status_code == 200, r.text
        view = r.json()
        assert (view["name"], view["member_key"], view["pool"]) == (name, member, pool)
        assert view["phase"] == "Ready" and view["generation"] == 1  # not restarted
        assert view["labels"] == {"tier": "warm", "team": "a"}
        r = await c.post(f"/v1/sandboxes/{name}/exec", json={"command": ["echo", "hi"]})
        assert r.status_code == 200 and r.json()["stdout"] == "hi\n", r.text
        history = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
        assert "SandboxAdopted" in [e for h in history for e in h["events"]]
        listed = (await c.get("/v1/sandboxes", params={"label": "team=a"})).json()["items"]
        assert [(v["name"], v["member_key"]) for v in listed] == [(name, member)]
        # Commands for the name reach the member.
        r = await c.post(f"/v1/sandboxes/{name}:hold", json={"reason": "look"}, params={"wait": 30})
        assert r.status_code == 200 and r.json()["name"] == member, r.text
        r = await c.post(f"/v1/sandboxes/{name}:release", params={"wait": 30})
        assert r.status_code == 200, r.text
        # A create of the bound name is refused.
        r = await c.post("/v1/sandboxes", json=apikit.create_body(name), params={"wait": 30})
        assert r.status_code == 409 and "adopted sandbox" in r.json()["message"], r.text
        r = await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
        assert r.status_code == 200, r.text
        await api.wait_phase(member, "Deleted", timeout=60)
        await eventually(lambda: bindings(api.env.pool), lambda b: name not in b,
                         what="the name released")  # fmt: skip
        body = apikit.create_body(name, image=IMAGE, command=["sleep", "3600"])
        r = await c.post("/v1/sandboxes", json=body, params={"wait": 30})
        assert r.status_code == 201, r.text
        assert (await c.get(f"/v1/sandboxes/{name}")).json()["member_key"] == name
    await cleanup(api, [name])


async def test_a_claimed_name_works_at_openshell_the_console_and_the_audit(
    api: Api, driver: Any
) -> None:
    """OpenShell's door gets, execs in and deletes the adopted sandbox by the claimant's name;
    the console's page and the audit's explanation of the name are the member's."""
    pool = new_pool()
    [member] = await create_members(gateway_of(api), pool, 1, IMAGE)
    await all_ready(api.env.pool, [member])
    name = unique("door")
    assert (await claimed(api, pool, name)).warm
    async with api.client(None, follow_redirects=False) as console:
        r = await console.post("/ui/login", data={"token": apikit.INSPECTOR, "next": "/ui/"})
        assert r.status_code == 303, r.text
        page = await console.get(f"/ui/sandboxes/{name}")
        assert page.status_code == 200, page.text
        assert f"pool member <code>{member}</code> of pool {pool}, claimed as {name}" in page.text
        assert f"Adopt(as {name})" in page.text
    async with api.client(apikit.AUDITOR) as c:
        r = await c.get(f"/v1/audit/sandboxes/{name}/explain")
        assert r.status_code == 200, r.text
        assert "SandboxAdopted" in [e for step in r.json()["inputs"] for e in step["events"]]
    async with serving_door(api.env, driver) as (channel, _, _):
        stub = openshell_pb2_grpc.OpenShellStub(channel)
        got = await stub.GetSandbox(pb.GetSandboxRequest(name=name), metadata=auth())
        assert got.sandbox.metadata.name == name
        for reference in (name, got.sandbox.metadata.id):  # by name (0.1), by id (0.0)
            request = pb.ExecSandboxRequest(sandbox_id=reference, command=["echo", "warm"])
            events = [e async for e in stub.ExecSandbox(request, metadata=auth(), timeout=60)]
            assert b"".join(e.stdout.data for e in events if e.HasField("stdout")) == b"warm\n"
        deleted = await stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())
        assert deleted.deleted
    await api.wait_phase(member, "Deleted", timeout=60)


async def test_a_claim_is_cold_with_no_ready_member_or_env_its_driver_cannot_deliver(
    api: Api,
) -> None:
    pool = new_pool()
    result = await claimed(api, pool, unique("c"))
    assert not result.warm and result.member is None
    assert "no Ready member" in result.reason
    [member] = await create_members(gateway_of(api), pool, 1, IMAGE)
    await all_ready(api.env.pool, [member])
    why = "the kubernetes driver cannot pass an exec's environment privately"
    result = await claimed(api, pool, unique("c"), env={"TOKEN": "x"}, env_refusal=why)
    assert not result.warm and result.reason == f"per-claim env: a cold start ({why})"
    result = await claimed(api, pool, unique("c"), providers=["gh"], env_refusal=why)
    assert not result.warm and result.reason.startswith("per-claim providers: a cold start")
    assert await adoptions(api.env.pool, pool) == []  # the member was left alone
    await cleanup(api, [member])


async def test_concurrent_claims_adopt_exactly_as_many_distinct_members_as_are_ready(
    api: Api,
) -> None:
    """N claims at once against M Ready members: min(N, M) warm, each a distinct member under
    its own name, the rest cold; no member adopted twice, no name bound twice."""
    pool, ready, claims = new_pool(), 4, 9
    members = await create_members(gateway_of(api), pool, ready, IMAGE)
    await all_ready(api.env.pool, members)
    names = [unique("n") for _ in range(claims)]
    results = await asyncio.gather(*(claimed(api, pool, n) for n in names))
    warm = {n: r.member for n, r in zip(names, results, strict=True) if r.warm}
    assert len(warm) == min(claims, ready), results
    assert sorted(warm.values()) == sorted(members)
    adopted = await adoptions(api.env.pool, pool)
    assert sorted(a["key"] for a in adopted) == sorted(members)
    assert {a["adopted_as"]: a["key"] for a in adopted} == warm
    bound = await bindings(api.env.pool)
    assert {n: bound[n][0] for n in warm} == warm
    assert all(n not in bound for n in names if n not in warm)
    await cleanup(api, list(warm))


@pytest.mark.parametrize(("ready", "claims"), [(3, 7), (5, 3)])
async def test_concurrent_claims_in_one_process_send_one_adoption_per_member_adopted(
    api: Api, monkeypatch: pytest.MonkeyPatch, ready: int, claims: int
) -> None:
    """N claims at once against M Ready members in one API process, all trying the members in
    the same order: exactly min(N, M) AdoptSandbox commands are sent and decided, one per
    member adopted (a claim skips the members another claim here asks for, and the claims
    left over wait for those adoptions and go cold without sending any)."""
    monkeypatch.setattr("services.api.claims.random.shuffle", list.sort)
    pool = new_pool()
    members = await create_members(gateway_of(api), pool, ready, IMAGE)
    await all_ready(api.env.pool, members)
    names = [unique("n") for _ in range(claims)]
    results = await asyncio.gather(*(claimed(api, pool, n) for n in names))
    assert sum(r.warm for r in results) == min(claims, ready), results
    assert sum(r.attempts for r in results) == min(claims, ready), results
    decided = await api.env.pool.fetchval(
        "SELECT count(*) FROM command_outcomes WHERE command_type = 'AdoptSandbox' "
        "AND key = ANY($1)",
        members,
    )
    assert decided == min(claims, ready)
    adopted = {r.member for r in results if r.warm}
    warm = [n for n, r in zip(names, results, strict=True) if r.warm]
    await cleanup(api, warm + [m for m in members if m not in adopted])


async def test_a_late_snapshot_from_before_the_adoption_changes_nothing(api: Api) -> None:
    """A watcher's snapshot of the member taken before its adoption (still ``created``) and
    delivered after it is ignored: the adopted member stays Ready and adopted."""
    pool = new_pool()
    [member] = await create_members(gateway_of(api), pool, 1, IMAGE)
    await all_ready(api.env.pool, [member])
    taken = now()
    name = unique("late")
    assert (await claimed(api, pool, name)).warm
    late = [
        RuntimeSnapshot(type="RuntimeSnapshot", observation_id=f"late-{state}-{member}",
                        key=member, generation=1, occurred_at=taken, actor="podman-watcher",
                        state=state)
        for state in ("created", "running")
    ]  # fmt: skip
    await api.env.observe(*late)
    await eventually(
        lambda: api.env.fetch(
            "SELECT disposition FROM history WHERE key = $1 AND message_type = 'RuntimeSnapshot'",
            member,
        ),
        lambda rows: len(rows) >= 2,
        what="the late snapshots decided",
    )
    [row] = await api.env.fetch(
        "SELECT phase, adopted_as, generation FROM sandboxes WHERE key = $1", member
    )
    assert dict(row) == {"phase": "Ready", "adopted_as": name, "generation": 1}
    await cleanup(api, [name])


def race_commands(member: str, name: str, claim_id: str) -> tuple[CreateSandbox, AdoptSandbox]:
    create = CreateSandbox(
        type="CreateSandbox", command_id=new_command_id(), key=name, occurred_at=now(),
        actor="bob", spec=SandboxSpec(image=IMAGE, command=["sleep", "3600"]),
    )  # fmt: skip
    adopt = AdoptSandbox(
        type="AdoptSandbox", command_id=new_command_id(), key=member, occurred_at=now(),
        actor="alice", claimant=name, claim_id=claim_id,
    )  # fmt: skip
    return create, adopt


async def test_a_name_created_before_its_claim_binds_abandons_the_adopted_member(
    api: Api,
) -> None:
    """The create is decided first: the member is adopted (its key admits it), the name is
    refused to it, and the member is deleted; the created sandbox keeps the name."""
    pool = new_pool()
    [member] = await create_members(gateway_of(api), pool, 1, IMAGE)
    await all_ready(api.env.pool, [member])
    name = unique("race")
    create, adopt = race_commands(member, name, str(uuid.uuid4()))
    gateway = gateway_of(api)
    created = (await gateway.submit(create, 30)).outcome
    assert created is not None and created.accepted
    adopted = (await gateway.submit(adopt, 30)).outcome
    assert adopted is not None and adopted.accepted
    await api.wait_phase(member, "Deleted", timeout=60)  # abandoned, deleted
    assert name not in await bindings(api.env.pool)
    reason = await api.env.fetchval(
        "SELECT reason FROM history WHERE key = $1 AND message_type = 'AbandonAdoption'", member
    )
    assert "a sandbox of that name exists" in reason
    assert (
        await gateway_of(api).pool.fetchval("SELECT sandbox_id FROM sandboxes WHERE key = $1", name)
    ) == created.sandbox_id
    await cleanup(api, [name])


async def test_a_name_bound_by_a_claim_refuses_a_later_create(api: Api) -> None:
    pool = new_pool()
    [member] = await create_members(gateway_of(api), pool, 1, IMAGE)
    await all_ready(api.env.pool, [member])
    name, claim_id = unique("race"), str(uuid.uuid4())
    create, adopt = race_commands(member, name, claim_id)
    gateway = gateway_of(api)
    assert (await gateway.submit(adopt, 30)).outcome.accepted  # type: ignore[union-attr]
    await eventually(lambda: bindings(api.env.pool), lambda b: name in b, what="the name bound")
    created = (await gateway.submit(create, 30)).outcome
    assert created is not None and created.code == "ALREADY_EXISTS", created
    assert (await bindings(api.env.pool))[name] == (member, claim_id)
    assert await api.phase(member) == "Ready"
    await cleanup(api, [name])


async def test_creates_racing_claims_for_the_same_names_never_both_get_a_name(api: Api) -> None:
    """Rounds of a cold create and a claim of one name sent at once: each name ends held by
    exactly one of them (a live sandbox of its own, or bound to the member adopted for it),
    and a member whose claim lost the name is deleted."""
    pool, rounds = new_pool(), 6
    members = await create_members(gateway_of(api), pool, rounds, IMAGE)
    await all_ready(api.env.pool, members)
    gateway = gateway_of(api)
    names = [unique("race") for _ in range(rounds)]

    async def race(member: str, name: str) -> Any:
        create, adopt = race_commands(member, name, str(uuid.uuid4()))
        return await asyncio.gather(gateway.submit(create, 30), gateway.submit(adopt, 30))

    await asyncio.gather(*(race(m, n) for m, n in zip(members, names, strict=True)))

    async def settled() -> dict[str, str]:
        rows = await gateway.pool.fetch(
            "SELECT key, phase, adopted_as, bound_to FROM sandboxes WHERE key = ANY($1)",
            names + members,
        )
        by_key = {r["key"]: r for r in rows}
        found = {}
        for member, name in zip(members, names, strict=True):
            m, n = by_key.get(member), by_key.get(name)
            if n is not None and n["bound_to"] == member and m["phase"] == "Ready":
                found[name] = "claim"
            elif (
                n is not None
                and n["bound_to"] is None
                and n["phase"] != "Deleted"
                and (m["phase"] == "Deleted" and m["adopted_as"] is None)
            ):
                found[name] = "create"
        return found

    won = await eventually(settled, lambda f: len(f) == rounds, timeout=90,
                           what="every name held by exactly one of its two")  # fmt: skip
    assert set(won.values()) <= {"claim", "create"}
    await cleanup(api, names)


async def test_the_log_of_claims_verifies_and_rebuilds_the_rows(api: Api) -> None:
    """The audit re-decides every input of this module's environment (claims, bindings,
    abandonments, releases) to the same history, rows and events, and folding the events topic
    rebuilds every row, bound names included."""
    pool = new_pool()
    members = await create_members(gateway_of(api), pool, 2, IMAGE)
    await all_ready(api.env.pool, members)
    kept, freed = unique("kept"), unique("freed")
    assert (await claimed(api, pool, kept)).warm and (await claimed(api, pool, freed)).warm
    async with api.client() as c:
        assert (await c.delete(f"/v1/sandboxes/{freed}", params={"wait": 30})).status_code == 200
    await eventually(lambda: bindings(api.env.pool), lambda b: freed not in b and kept in b,
                     timeout=60, what="the freed name released")  # fmt: skip
    report = await verify(api.env.settings)
    assert report.divergences == [] and report.ok, report.divergences
    await eventually(
        lambda: rebuild_and_compare(api.env.settings),
        lambda r: r.equal,
        timeout=30,
        what="the rows rebuilt from the events topic",
    )
    await cleanup(api, [kept])


async def test_a_watch_of_a_claimed_name_follows_its_member(api: Api) -> None:
    """``/v1/watch?name=<claimant>`` streams the member's row (under the claimant's name), and
    never the name's own row; the decided-events stream of the name has the member's
    adoption and the name's binding."""
    pool = new_pool()
    [member] = await create_members(gateway_of(api), pool, 1, IMAGE)
    await all_ready(api.env.pool, [member])
    name = unique("watched")
    assert (await claimed(api, pool, name)).warm
    async with api.client() as c:
        events = await apikit.read_events(
            c, lambda ev: len(apikit.rows(ev)) >= 1, params={"name": name, "timeout": 20}
        )
        [row] = apikit.rows(events)
        assert (row["name"], row["member_key"], row["phase"]) == (name, member, "Ready")
        r = await c.post(f"/v1/sandboxes/{name}:stop", params={"wait": 30})
        assert r.status_code == 200, r.text
        cursor = row["change_seq"]
        events = await apikit.read_events(
            c,
            lambda ev: any(x["phase"] == "Stopped" for x in apikit.rows(ev)),
            params={"name": name, "cursor": cursor, "timeout": 30},
        )
        assert {x["member_key"] for x in apikit.rows(events)} == {member}
        decided: list[str] = []
        async with c.stream(
            "GET", "/v1/watch/events", params={"name": name, "timeout": 3}
        ) as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: ") and '"type"' in line:
                    decided.append(line)
        assert any('"SandboxAdopted"' in d for d in decided)
        assert any('"SandboxNameBound"' in d for d in decided)
    await cleanup(api, [name])


async def test_a_claim_retried_after_its_api_died_finds_its_member(api: Api) -> None:
    """An API process killed after its claim's adoption was published and decided (the
    claim's answer lost): the client's retry with the same claim id answers with that member,
    adopting no other, and so does a second retry once the name is bound."""
    pool = new_pool()
    members = await create_members(gateway_of(api), pool, 2, IMAGE)
    await all_ready(api.env.pool, members)
    name, claim_id = unique("retry"), str(uuid.uuid4())
    _, adopt = race_commands(members[0], name, claim_id)
    await gateway_of(api).publisher.publish(adopt)  # what the killed process managed to send
    await eventually(lambda: adoptions(api.env.pool, pool), lambda a: len(a) == 1,
                     what="the published adoption decided")  # fmt: skip
    retried = await claim(gateway_of(api), pool, name, actor="alice", claim_id=claim_id)
    assert (retried.warm, retried.member) == (True, members[0]), retried
    again = await claim(gateway_of(api), pool, name, actor="alice", claim_id=claim_id)
    assert (again.warm, again.member) == (True, members[0]), again
    assert [a["key"] for a in await adoptions(api.env.pool, pool)] == [members[0]]
    await cleanup(api, [name, members[1]])


async def test_a_claim_retried_while_its_first_adoption_is_undecided_ends_on_one_member(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry that starts before the first attempt's adoption is decided may adopt a second
    member with the same claim id: the name goes to one of them (its partition decides), the
    other is refused the name and deleted, and the retry answers with the one that holds it."""
    pool = new_pool()
    members = await create_members(gateway_of(api), pool, 2, IMAGE)
    await all_ready(api.env.pool, members)
    name, claim_id = unique("twice"), str(uuid.uuid4())
    # The two attempts try the members in opposite orders: each adopts another one.
    calls = itertools.count()

    def opposite(keys: list[str]) -> None:
        keys.sort(reverse=next(calls) % 2 == 1)

    monkeypatch.setattr("services.api.claims.random.shuffle", opposite)
    results = await asyncio.gather(
        *(claim(gateway_of(api), pool, name, actor="alice", claim_id=claim_id) for _ in "ab")
    )
    bound = (await bindings(api.env.pool))[name]
    assert bound[1] == claim_id
    assert [(r.warm, r.member) for r in results] == [(True, bound[0])] * 2, results
    others = [m for m in members if m != bound[0]]
    [other] = others
    adopted = [a["key"] for a in await adoptions(api.env.pool, pool)]
    if other in adopted:  # adopted too (the retry did not see the first adoption): deleted
        await api.wait_phase(other, "Deleted", timeout=60)
    # Whichever happened: waiting on another member than the one the name went to, for this
    # claim, answers with the member that holds the name.
    deadline = asyncio.get_running_loop().time() + 30
    late = await _bound(gateway_of(api), other, name, claim_id, deadline)
    assert (late.warm, late.member) == (True, bound[0]), late
    await cleanup(api, [name, *([] if other in adopted else [other])])
