"""The log's identity: offsets stored in PostgreSQL are only followed on the log they came from.

A wiped broker or a re-created topic starts again at offset 0 under the same names; without the
check every new input would be dropped as "already applied" while /readyz said ready. These
tests re-create the input topics of an isolated environment (new topic ids), never the shared
broker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import apikit
import factories as f
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError
from harness import Env, eventually, isolated_env
from test_exactly_once import publish

from services.common.log_identity import LogMismatch, read_log_identity
from services.common.settings import PROJECT_ROOT
from services.processor.consumer import Processor


async def recreate_input_topics(env: Env) -> None:
    """Delete the input topics and create them again: same names, new ids, offsets from 0."""
    topics = [env.settings.topic_commands, env.settings.topic_observations]
    before = await read_log_identity(env.settings.kafka_bootstrap, topics)
    admin = AIOKafkaAdminClient(bootstrap_servers=env.settings.kafka_bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(topics)

        async def recreated() -> bool:
            # A topic still being deleted refuses to be created: try again until both exist
            # under new ids.
            with contextlib.suppress(KafkaError):
                await admin.create_topics(
                    [NewTopic(t, env.settings.kafka_partitions, 1) for t in topics]
                )
            try:
                now = await read_log_identity(env.settings.kafka_bootstrap, topics)
            except (KafkaError, LogMismatch):
                return False
            return all(now.topic_ids[t] != before.topic_ids[t] for t in topics)

        await eventually(recreated, bool, what="the input topics to be created again")
    finally:
        await admin.close()


async def sandstream(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", "from services.cli.main import main; main()", *args],
        cwd=PROJECT_ROOT, env=env.env_vars(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


async def test_a_processor_refuses_a_recreated_input_log_until_an_operator_adopts_it() -> None:
    async with isolated_env(partitions=2) as env:
        await publish(env, [f.create("a", command_id="c1"), f.create("b", command_id="c2")])
        first = await env.start_processor("first")
        await env.wait_applied(2)
        await env.stop_processor(first)

        await recreate_input_topics(env)
        await publish(env, [f.create("c", command_id="c3")])  # offset 0 of the new log
        refused = Processor(env.settings, env.pool, name="second")
        with pytest.raises(Exception, match="sandstream log adopt") as caught:
            await refused.start()
        await refused.stop()
        assert "topic id" in str(caught.value)
        assert await env.fetchval("SELECT count(*) FROM history") == 2  # c3 not dropped

        shown = await sandstream(env, "log", "show")
        assert shown.returncode == 1 and "topic id" in shown.stdout, shown
        adopt = await sandstream(env, "log", "adopt", "--reason", "test re-created the topics")
        assert adopt.returncode == 0, adopt.stderr
        assert (await sandstream(env, "log", "show")).returncode == 0
        adoption = (await env.fetch("SELECT reason, old_offsets FROM log_adoptions"))[0]
        assert adoption["reason"] == "test re-created the topics"

        await env.start_processor("after-adoption")
        await eventually(
            lambda: env.fetchval("SELECT phase FROM sandboxes WHERE key = 'c'"),
            lambda phase: phase is not None,
            what="c3 of the new log to be applied",
        )
        topics = {r["topic"] for r in await env.fetch("SELECT DISTINCT topic FROM history")}
        assert env.settings.topic_commands in topics  # the new log's c3
        assert any(t.startswith(f"{env.settings.topic_commands}@") for t in topics)  # the old


async def test_readyz_is_not_ready_on_another_log_than_the_stored_offsets_belong_to() -> None:
    async with apikit.running_api(None, partitions=2) as api:
        env = api.env
        await publish(env, [f.create("a", command_id="c1")])
        processor = await env.start_processor("p1")
        await env.wait_applied(1)
        await env.stop_processor(processor)
        async with api.client() as c:  # the admin token: the checks need ops:read
            await eventually(lambda: c.get("/readyz"), lambda r: r.status_code == 200, what="ready")
            await recreate_input_topics(env)
            response = await eventually(
                lambda: c.get("/readyz"),
                lambda r: r.status_code == 503,
                timeout=15,
                what="not ready",
            )
        body = response.json()
        assert body["checks"]["kafka"]["ok"] and body["checks"]["postgres"]["ok"]
        assert not body["checks"]["log"]["ok"]
        assert "sandstream log adopt" in body["checks"]["log"]["detail"]
