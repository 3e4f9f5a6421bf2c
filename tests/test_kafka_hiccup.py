"""Losing Kafka is ridden out: the processor backs off and resumes, nothing is lost.

The shared broker is never touched: these tests start a broker of their own (from the same
jars) that advertises a TCP proxy the test controls; cutting the proxy drops every client
connection at once, as a broker restart does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import workload
from harness import eventually, isolated_env
from tcp_proxy import TcpProxy
from test_exactly_once import publish, wait_outbox_drained

from services.common.settings import Settings
from services.localstack import private_broker


@asynccontextmanager
async def broker_behind_proxy(state_dir: Path) -> AsyncIterator[tuple[Settings, TcpProxy]]:
    """Settings whose Kafka is a private broker reached only through a proxy."""
    listening = private_broker.private_settings(Settings(), state_dir)
    broker_port = int(listening.kafka_bootstrap.rsplit(":", 1)[1])
    proxy_port = private_broker.free_port()
    proxy = TcpProxy(proxy_port, broker_port)
    await proxy.restore()
    through_proxy = listening.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{proxy_port}"})
    proc = private_broker.start(listening, advertised=through_proxy.kafka_bootstrap)
    try:
        await asyncio.to_thread(private_broker.wait_ready, through_proxy, proc)
        yield through_proxy, proxy
    finally:
        await proxy.cut()
        await asyncio.to_thread(private_broker.stop, proc)


# In `make soak`, not the default suite: the test needs the consumer's first fetch to hold the
# whole backlog, which a loaded machine does not always give (it timed out in 2 of ~6 full
# runs here, and passes alone). Making the dead letter fall after the cut deterministically
# is open work.
@pytest.mark.soak
async def test_the_processor_rides_out_a_send_that_fails_while_kafka_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the broker is unreachable the processor goes on applying what it had fetched;
    the first record for a topic its producer has no metadata for yet (a dead letter) then
    fails to send. That must be ridden out: back off, resume once Kafka is back, lose nothing.
    """
    caplog.set_level(logging.INFO, logger="sandstream.processor")
    inputs = workload.commands(count=2000, keys=100, seed=31)
    later = workload.commands(count=300, keys=100, seed=32)
    async with (
        broker_behind_proxy(tmp_path) as (base, proxy),
        isolated_env(
            partitions=2, base=base, kafka_request_timeout_ms=2000, kafka_session_timeout_ms=60_000
        ) as env,
    ):
        try:
            await publish(env, inputs)
            await env.produce(env.settings.topic_commands, [(b"x", b"not json")])
            # The first fetch holds all of it; applied five records per poll, the dead letter
            # (last in its partition) comes after the cut, and the long session timeout keeps
            # the consumer handing out what it holds while the coordinator is unreachable.
            processor = await env.start_processor("p1", max_records=5)
            [(_, _, task)] = env.processors
            await env.wait_applied(20)
            await proxy.cut()
            await eventually(
                lambda: task.done() or "lost Kafka" in caplog.text,
                bool,
                timeout=90,
                what="the failed send to stop the processor or be noticed",
            )
            assert not task.done()
            await proxy.restore()
            await publish(env, later)
            await env.wait_applied(len(inputs) + 1 + len(later), timeout=120)
            await wait_outbox_drained(env)
            assert not task.done()
            assert "resumed from the offsets stored in PostgreSQL" in caplog.text
            await env.stop_processor(processor)
        finally:
            await proxy.restore()  # the environment is removed through it
        letters = await env.read_topic(env.settings.topic_deadletter)
        assert [r.key for r in letters] == [b"x"]
