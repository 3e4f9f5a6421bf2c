"""Every version of a sandbox's row, rebuilt from its decided events in the outbox (what
OpenShell's WatchSandbox sends for the changes between two reads and the changes a resuming
client missed), on real PostgreSQL: the versions are the processor's own rows, an incarnation
is folded from its creation only, a pruned outbox or a replay above the bound is said so
(``VersionsLost``), and the read walks the outbox's key index backwards, never the outbox."""

from __future__ import annotations

from typing import Any

import factories as f
import pytest
from harness import isolated_env

from events.codec import encode
from events.common import Phase
from events.decided import DecidedEvent
from projections.lifecycle import Sandbox, evolve
from services.api import readmodel

TOPIC = "events"
KEY = "vers"


def lifecycle() -> tuple[list[DecidedEvent], list[Sandbox]]:
    """Two incarnations of KEY (the first completes and is deleted by its completion policy,
    two versions decided on one input): every event, and the row after each."""
    h = f.Harness()
    messages = [
        f.create(KEY, providers=["github"], on_exit="delete"), f.running(KEY, 1),
        f.attach(KEY, "slack"), f.stop(KEY), f.stopped(KEY, 1), f.start(KEY), f.running(KEY, 2),
        f.exited(KEY, 2, 0), f.deleted(KEY, 2),
        f.create(KEY), f.running(KEY, 3), f.stop(KEY), f.stopped(KEY, 3), f.start(KEY),
    ]  # fmt: skip
    inputs = 0
    for message in messages:
        h.send(message)
        inputs += 1
    events = h.events(KEY)
    assert len(events) > inputs  # an input decided more than one version
    every, row = [], None
    for event in events:
        row = evolve(row, event)
        every.append(row)
    assert every[-1] == h.row(KEY)  # the processor's row
    return events, every


async def fill(conn: Any, events: list[DecidedEvent], extra: str = "") -> None:
    """The events in the outbox as the processor writes them (with a dead letter of the key
    between them, and another key's events)."""
    for i, event in enumerate(events):
        await conn.execute(
            "INSERT INTO outbox (partition, topic, key, value) VALUES (0, $1, $2, $3)",
            TOPIC, KEY.encode(), encode(event),
        )  # fmt: skip
        if i % 4 == 0:
            await conn.execute(
                "INSERT INTO outbox (partition, topic, key, value) VALUES (0, 'dead', $1, 'x'), "
                "(0, $2, 'other', 'y')",
                KEY.encode(),
                TOPIC,
            )


async def test_the_versions_after_a_row_are_the_rows_the_processor_made() -> None:
    events, every = lifecycle()
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await fill(conn, events)
        pool = env.pool
        for start, end in ((0, 1), (0, 5), (3, 9), (7, 12), (len(every) - 3, len(every) - 1)):
            found = await readmodel.versions_after(pool, TOPIC, every[start], every[end].version)
            assert found == every[start + 1 : end + 1]
        assert await readmodel.versions_after(pool, TOPIC, every[4], every[4].version) == []


async def test_an_incarnation_is_folded_from_its_creation_and_no_further_back() -> None:
    events, every = lifecycle()
    second = next(i for i, r in enumerate(every) if r.generation == 3)
    assert every[second].phase is Phase.PROVISIONING and every[second - 1].phase is Phase.DELETED
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await fill(conn, events)
        pool = env.pool
        now = every[-1]
        found = await readmodel.incarnation_versions(pool, TOPIC, KEY, now.sandbox_id, now.version)
        assert found == every[second:]
        middle = every[second + 2]
        assert await readmodel.incarnation_versions(
            pool, TOPIC, KEY, now.sandbox_id, middle.version
        ) == every[second : second + 3]  # fmt: skip
        first = every[second - 1]  # the first incarnation's tombstone
        assert await readmodel.incarnation_versions(
            pool, TOPIC, KEY, first.sandbox_id, first.version
        ) == every[:second]  # fmt: skip
        with pytest.raises(readmodel.VersionsLost, match="more than 3 changes"):
            await readmodel.incarnation_versions(
                pool, TOPIC, KEY, now.sandbox_id, now.version, limit=3
            )


async def test_events_the_outbox_no_longer_holds_are_said_to_be_lost() -> None:
    events, every = lifecycle()
    second = next(i for i, r in enumerate(every) if r.generation == 3)
    async with isolated_env(partitions=1) as env, env.pool.acquire() as conn:
        await fill(conn, events)
        pool = env.pool
        now = every[-1]
        # Housekeeping deleted a published event in the middle, then the first creation.
        await prune(conn, every[second + 2].version)
        with pytest.raises(readmodel.VersionsLost):
            await readmodel.versions_after(pool, TOPIC, every[second], now.version)
        assert await readmodel.versions_after(
            pool, TOPIC, every[second + 2], now.version
        ) == every[second + 3 :]  # fmt: skip
        with pytest.raises(readmodel.VersionsLost):
            await readmodel.incarnation_versions(pool, TOPIC, KEY, now.sandbox_id, now.version)
        await prune(conn, every[0].version)
        with pytest.raises(readmodel.VersionsLost, match="creation"):
            await readmodel.incarnation_versions(
                pool, TOPIC, KEY, every[0].sandbox_id, every[second - 1].version
            )


async def prune(conn: Any, version: int) -> None:
    await conn.execute(
        "DELETE FROM outbox WHERE topic = $1 AND key = $2 "
        "AND (convert_from(value, 'UTF8')::json->>'version')::int = $3",
        TOPIC, KEY.encode(), version,
    )  # fmt: skip
