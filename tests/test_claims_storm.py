"""A claim storm with a processor SIGKILLed in the middle (real Kafka, PostgreSQL, Podman; the
processors and the executor are `sandstream` processes, the claims run through the API's
gateway in this process): every claim ends, exactly min(N, M) of them warm, each on its own
member, no member adopted twice and none lost (adopted but never bound)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from claims_support import adoptions, all_ready, bindings, create_members
from harness import eventually
from role_processes import Roles, roles_env, shared_out
from role_processes import all_ready as roles_ready

from events.publisher import CommandPublisher
from events.topics import partition_for
from services.api.claims import ClaimResult, claim
from services.api.gateway import CommandGateway
from services.api.readmodel import ChangeFeed
from services.common.kafka_clients import kafka_client_args

MEMBERS, CLAIMS = 6, 11


@asynccontextmanager
async def gateway(roles: Roles) -> AsyncIterator[CommandGateway]:
    """The API's command gateway over the roles' environment (this process is the API)."""
    settings = roles.env.settings
    feed = ChangeFeed(roles.env.pool, poll_interval=0.2)
    await feed.start()
    publisher = CommandPublisher(kafka_client_args(settings, "api"), topic=settings.topic_commands)
    await publisher.__aenter__()
    try:
        yield CommandGateway(roles.env.pool, publisher, feed, poll_interval=0.2)
    finally:
        await publisher.__aexit__()
        await feed.close()


async def published_adoptions(roles: Roles, members: list[str]) -> int:
    found = await roles.env.fetch(
        "SELECT count(*) AS n FROM api_commands WHERE command_type = 'AdoptSandbox' "
        "AND published AND key = ANY($1)",
        members,
    )
    return int(found[0]["n"])


async def test_a_claim_storm_with_a_processor_killed_adopts_each_member_once(
    tmp_path: Path,
) -> None:
    async with roles_env(tmp_path, partitions=4) as roles:
        prepared = await asyncio.to_thread(roles.run, "prepare")
        assert prepared.returncode == 0, prepared.stderr
        processors = [roles.start("processor"), roles.start("processor")]
        executor = roles.start("executor")
        for p in [*processors, executor]:
            await p.ready()
        await eventually(lambda: roles_ready(processors), lambda b: shared_out(b, 4),
                         timeout=60, what="the processors sharing 4 partitions")  # fmt: skip
        async with gateway(roles) as gw:
            pool = f"storm-{uuid.uuid4().hex[:6]}"
            image = roles.env.settings.sandbox_image
            members = await create_members(gw, pool, MEMBERS, image)
            await all_ready(roles.env.pool, members)
            names = [f"claim-{i}-{uuid.uuid4().hex[:6]}" for i in range(CLAIMS)]
            # The kill lands mid-storm, deterministically: the processor to be killed is frozen
            # (SIGSTOP) as the storm starts, so whatever it polled is not committed and every
            # command of its partitions is still to be decided when it is killed; the
            # survivor decides its own partitions' adoptions meanwhile (the first one is waited
            # for when it owns a member's partition).
            count = roles.env.settings.kafka_partitions
            owned = set((await processors[0].readiness())["partitions"])
            assert {partition_for(k.encode(), count) for k in members + names} & owned
            survivor_adopts = {partition_for(k.encode(), count) for k in members} - owned
            os.kill(processors[0].proc.pid, signal.SIGSTOP)
            storm = [
                asyncio.create_task(
                    claim(gw, pool, n, actor="storm", claim_id=str(uuid.uuid4()), timeout=180)
                )
                for n in names
            ]
            if survivor_adopts:
                await eventually(lambda: adoptions(roles.env.pool, pool), lambda a: len(a) >= 1,
                                 timeout=60, interval=0.01, what="the first adoption")  # fmt: skip
            else:  # every member is the frozen one's to decide: the adoptions sent will do
                await eventually(lambda: published_adoptions(roles, members), lambda n: n >= 1,
                                 timeout=60, interval=0.01, what="an adoption sent")  # fmt: skip
            processors[0].kill()
            results: list[ClaimResult] = list(await asyncio.gather(*storm))

            warm = {n: r.member for n, r in zip(names, results, strict=True) if r.warm}
            assert len(warm) == min(CLAIMS, MEMBERS), results
            assert sorted(warm.values()) == sorted(members)  # distinct: each member once
            cold = [r for r in results if not r.warm]
            assert all("no Ready member" in r.reason for r in cold), cold
            adopted = await adoptions(roles.env.pool, pool)
            assert {a["adopted_as"]: a["key"] for a in adopted} == warm
            assert all(a["phase"] == "Ready" for a in adopted)
            bound = await bindings(roles.env.pool)
            assert {n: bound[n][0] for n in warm} == warm  # none lost: every adoption bound
            # One adoption decided per member, whatever was delivered again after the kill.
            decided = await roles.env.fetch(
                "SELECT key, count(*) AS n FROM history WHERE key = ANY($1) "
                "AND 'SandboxAdopted' = ANY(event_types) GROUP BY key",
                members,
            )
            assert {r["key"]: r["n"] for r in decided} == dict.fromkeys(members, 1)
            # The survivor took the killed one's partitions over (the claims that needed them
            # waited for that; the ones that did not may have ended before).
            await eventually(processors[1].readiness,
                             lambda b: b.get("partitions") == [0, 1, 2, 3],
                             timeout=60, what="the survivor owning every partition")  # fmt: skip
