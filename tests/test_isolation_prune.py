"""Isolated environments left behind by killed processes, and `python -m services.localstack
prune`, on the real Kafka and PostgreSQL of the local stack."""

from __future__ import annotations

import asyncio
import json
import sys

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient
from confluent_kafka.admin import AdminClient
from harness import isolated_env

from services.common.kafka_clients import kafka_client_args
from services.common.settings import PROJECT_ROOT, Settings
from services.localstack import kafka_auth
from services.localstack.isolation import (
    NAME_FIELDS,
    OWNER_MARK,
    Leftover,
    abandoned,
    leftovers,
    prune,
)

LEAKER = """
import asyncio
from services.common.settings import Settings
from services.localstack.isolation import isolated

async def main():
    async with isolated(Settings(), "leak") as (settings, _):
        print(settings.pg_schema, settings.topic_commands, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


def mark(schema: str, pid: int = 7, host: str = "here", **names: str) -> str:
    every = {field: f"{schema}-{field}" for field in NAME_FIELDS} | {"pg_schema": schema}
    return OWNER_MARK + json.dumps({"pid": pid, "host": host, "names": every | names})


def test_only_schemas_marked_as_an_environment_of_their_own_name_are_leftovers() -> None:
    found = leftovers([
        ("t1", mark("t1")),
        ("public", "standard public schema"),
        ("t2", OWNER_MARK + "{not json"),
        ("t3", OWNER_MARK + json.dumps({"pid": 1, "host": "here"})),  # no names
        ("t4", mark("t5")),  # names another schema
    ])  # fmt: skip
    assert [(x.schema, x.pid, x.host) for x in found] == [("t1", 7, "here")]
    assert found[0].names["topic_commands"] == "t1-topic_commands"


def test_abandoned_are_those_of_this_host_whose_process_is_gone() -> None:
    def left(schema: str, pid: int, host: str) -> Leftover:
        return leftovers([(schema, mark(schema, pid, host))])[0]

    found = [left("a", 10, "here"), left("b", 11, "here"), left("c", 10, "there")]
    gone = abandoned(found, "here", alive=lambda pid: pid == 11)
    assert [x.schema for x in gone] == ["a"]


async def test_prune_removes_a_killed_processs_environment_and_leaves_a_running_ones() -> None:
    base = Settings()
    leaker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LEAKER, cwd=PROJECT_ROOT, stdout=asyncio.subprocess.PIPE
    )
    assert leaker.stdout is not None
    line = await leaker.stdout.readline()
    leaker.kill()  # SIGKILL: no teardown
    await leaker.wait()
    schema, commands_topic = line.decode().split()
    async with isolated_env(partitions=1) as live:
        assert await schema_exists(base, schema) and await topic_exists(base, commands_topic)
        if kafka_auth.enabled(base):
            assert acls_on(base, commands_topic) > 0
        removed, _ = await prune(base)
        assert [x.schema for x in removed if x.schema == schema] == [schema]
        assert live.settings.pg_schema not in {x.schema for x in removed}
        assert not await schema_exists(base, schema)
        assert not await topic_exists(base, commands_topic)
        if kafka_auth.enabled(base):
            assert acls_on(base, commands_topic) == 0
        assert await schema_exists(base, live.settings.pg_schema)
        assert await topic_exists(base, live.settings.topic_commands)


async def schema_exists(settings: Settings, schema: str) -> bool:
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        return bool(await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1",
                                        schema))  # fmt: skip
    finally:
        await conn.close()


async def topic_exists(settings: Settings, topic: str) -> bool:
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
    await admin.start()
    try:
        return topic in await admin.list_topics()
    finally:
        await admin.close()


def acls_on(settings: Settings, topic: str) -> int:
    admin = AdminClient(kafka_auth.admin_config(settings))
    every = admin.describe_acls(kafka_auth.EVERY_ACL).result(30)
    return sum(1 for binding in every if binding.name == topic)
