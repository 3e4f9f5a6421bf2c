"""Helpers for the pipeline tests of the executor, the watchers and the reconcile loop.

Rows, history and outcomes are read from the isolated environment's schema; waits poll to a
deadline and then fail with the last value seen (never a bare sleep). The Podman helpers look
behind the driver's back with a plain client, and ``PodmanKeys`` hands out unique sandbox
names and force-removes everything of them afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from harness import Env, eventually, isolated_env
from podman import PodmanClient
from podman.errors import NotFound

from drivers.podman import PodmanDriver, remove_volume
from drivers.podman_objects import list_volumes
from drivers.protocol import LABEL_KEY, Driver
from events.codec import EVENTS, decode, encode
from events.commands import Command
from events.common import SandboxSpec
from events.observations import Observation
from events.outcomes import CommandOutcome
from events.publisher import CommandPublisher
from services.api.readmodel import await_outcome
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.executor.backends import podman_driver
from services.up.control_plane import ControlPlane

# An entrypoint that ignores SIGTERM even with an init process: the shell traps it away and
# its children inherit the ignored disposition. Only SIGKILL (after the grace period) ends it.
# TRAPPED appears once the trap is set: only from then on is a stop slow.
TRAPPED = "/tmp/trapped"
IGNORE_TERM = ["sh", "-c", f"trap '' TERM; touch {TRAPPED}; while true; do sleep 1; done"]
SLEEPER = ["sh", "-c", "exec sleep 3600"]


async def trap_set(driver: PodmanDriver, key: str, generation: int) -> None:
    """Wait until the IGNORE_TERM entrypoint of ``key``'s generation has set its SIGTERM trap:
    a stop sent earlier ends it at once instead of waiting out its grace."""
    await eventually(
        lambda: driver.exec(key, generation, ["test", "-e", TRAPPED]),
        lambda result: result[0] == 0,
        what=f"{key} generation {generation}'s SIGTERM trap set",
    )


async def row(env: Env, key: str) -> dict[str, Any] | None:
    rows = await env.fetch(
        "SELECT key, sandbox_id, phase, generation, version, identity, reason, exit_code "
        "FROM sandboxes WHERE key = $1",
        key,
    )
    return dict(rows[0]) if rows else None


async def phase(env: Env, key: str) -> str | None:
    found = await row(env, key)
    return found["phase"] if found else None


async def wait_row(
    env: Env,
    key: str,
    check: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float = 30.0,
) -> dict[str, Any]:
    found = await eventually(
        lambda: row(env, key),
        lambda r: r is not None and check(r),
        timeout=timeout,
        what=f"{key}: {what}",
    )
    assert found is not None
    return found


async def wait_phase(
    env: Env, key: str, expected: str, timeout: float = 30.0, generation: int | None = None
) -> dict[str, Any]:
    def check(r: dict[str, Any]) -> bool:
        return bool(r["phase"] == expected and generation in (None, r["generation"]))

    what = f"phase {expected}" + (f" at generation {generation}" if generation else "")
    return await wait_row(env, key, check, what, timeout)


async def wait_restart_limit(env: Env, key: str, timeout: float = 30.0) -> dict[str, Any]:
    """The row once the restart policy gave up (SandboxRestartsExhausted: reason RestartLimit)."""
    return await wait_row(
        env, key, lambda r: (r["reason"] or "").startswith("RestartLimit"), "the limit", timeout
    )


async def history(env: Env, key: str) -> list[dict[str, Any]]:
    rows = await env.fetch(
        'SELECT topic, partition, "offset", message_type, disposition, reason, phase, '
        "generation, version, message FROM history WHERE key = $1 ORDER BY id",
        key,
    )
    out = [dict(r) for r in rows]
    for h in out:
        if isinstance(h["message"], str):
            h["message"] = json.loads(h["message"])
    return out


async def command(
    env: Env, pub: CommandPublisher, cmd: Command, timeout: float = 15.0
) -> CommandOutcome:
    """Publish ``cmd`` and return its outcome once decided; fails if it was not accepted."""
    await pub.publish(cmd)
    outcome = await await_outcome(env.pool, cmd.command_id, timeout=timeout, key=cmd.key)
    assert outcome is not None, f"no outcome for {cmd.type} of {cmd.key} within {timeout}s"
    assert outcome.status == "accepted", outcome
    return outcome


async def produce_raw(
    env: Env, records: list[tuple[bytes, bytes]], topic: str | None = None
) -> list[tuple[int, int]]:
    """Append raw (key, value) records in order; their (partition, offset)s."""
    producer = AIOKafkaProducer(
        **kafka_client_args(env.settings, "admin"), enable_idempotence=True, acks="all"
    )
    await producer.start()
    try:
        placed = []
        for key, value in records:
            meta = await producer.send_and_wait(
                topic or env.settings.topic_observations, value=value, key=key
            )
            placed.append((meta.partition, meta.offset))
        return placed
    finally:
        await producer.stop()


async def observations_of(env: Env, key: str) -> list[tuple[Observation, bytes]]:
    """Every observation of ``key`` now in the observations topic, in order, with its bytes."""
    from events.codec import OBSERVATIONS, decode

    out = []
    for record in await env.read_topic(env.settings.topic_observations):
        if record.key == key.encode() and record.value is not None:
            out.append((decode(OBSERVATIONS, record.value), record.value))
    return out


async def wait_history_at(
    env: Env, placed: list[tuple[int, int]], timeout: float = 30.0
) -> list[dict[str, Any]]:
    """The history rows of observations at ``placed`` (partition, offset), once all exist."""
    topic = env.settings.topic_observations
    partitions = [p for p, _ in placed]
    offsets = [o for _, o in placed]

    async def probe() -> list[dict[str, Any]]:
        rows = await env.fetch(
            'SELECT partition, "offset", message_type, disposition, reason, phase, version '
            'FROM history WHERE topic = $1 AND (partition, "offset") IN '
            '(SELECT * FROM unnest($2::int[], $3::bigint[])) ORDER BY "offset"',
            topic,
            partitions,
            offsets,
        )
        return [dict(r) for r in rows]

    found: list[dict[str, Any]] = await eventually(
        probe, lambda rows: len(rows) == len(placed), timeout=timeout, what="replayed history"
    )
    return found


async def events_of(env: Env, key: str) -> list[str]:
    """The types of ``key``'s decided events now in the events topic, in order."""
    records = await env.read_topic(env.settings.topic_events)
    return [decode(EVENTS, r.value).type for r in records if r.key == key.encode()]


def encode_all(observations: list[Observation]) -> list[tuple[bytes, bytes]]:
    return [(o.key.encode(), encode(o)) for o in observations]


# -- Podman ---------------------------------------------------------------------------------


def sandbox_spec(
    settings: Settings, command: list[str], stop_timeout: int | None = None
) -> SandboxSpec:
    return SandboxSpec(
        image=settings.sandbox_image, command=command, stop_timeout_seconds=stop_timeout
    )


def containers_of(client: PodmanClient, key: str) -> list[dict[str, str]]:
    """Name and status of every container labelled with ``key`` (ours or not)."""
    found = client.containers.list(all=True, filters=[f"label={LABEL_KEY}={key}"])
    return sorted(
        ({"name": c.name, "status": c.attrs.get("State", ""), "id": c.id} for c in found),
        key=lambda c: c["name"],
    )


def volumes_of(client: PodmanClient, key: str) -> list[str]:
    return sorted(v.name for v in list_volumes(client, f"{LABEL_KEY}={key}"))


def secrets_of(client: PodmanClient, key: str) -> list[str]:
    """The Podman secrets of every generation of ``key`` (drivers/podman_secrets.py names
    them ``sandstream-<key>-g<generation>--<NAME>``)."""
    own = re.compile(re.escape(f"sandstream-{key}-g") + r"\d+--")
    return sorted(str(s.name) for s in client.secrets.list() if own.match(str(s.name)))


def status_of(client: PodmanClient, name: str) -> str | None:
    try:
        return str(client.containers.get(name).attrs["State"]["Status"])
    except Exception:
        return None


async def await_podman(
    client: PodmanClient,
    probe: Callable[[PodmanClient], Any],
    check: Callable[[Any], bool],
    what: str,
    timeout: float = 30.0,
) -> Any:
    """Poll a blocking Podman probe (in a thread) until ``check`` holds; fail at the deadline."""
    return await eventually(
        lambda: asyncio.to_thread(probe, client), check, timeout=timeout, what=what
    )


class PodmanKeys:
    """Unique sandbox names; ``cleanup()`` force-removes their containers, volumes and
    secrets."""

    def __init__(self, client: PodmanClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.made: list[str] = []

    def __call__(self) -> str:
        self.made.append(f"{self.prefix}-{uuid.uuid4().hex[:10]}")
        return self.made[-1]

    def cleanup(self) -> None:
        for key in self.made:
            for container in containers_of(self.client, key):
                remove_now(self.client, container["id"])
            for name in volumes_of(self.client, key):
                # A delete the killed runtime let finish, or the plane's own, may remove it
                # first.
                remove_volume(self.client, name, force=True)
            # Removing a container leaves its generation's secrets (the driver removes them
            # beside it; a force-remove does not).
            for secret in secrets_of(self.client, key):
                with contextlib.suppress(NotFound):
                    self.client.secrets.remove(secret)
        leftovers = {
            k: [c["name"] for c in containers_of(self.client, k)]
            + volumes_of(self.client, k)
            + secrets_of(self.client, k)
            for k in self.made
        }
        assert not any(leftovers.values()), f"cleanup left {leftovers}"


def remove_now(client: PodmanClient, container_id: str) -> None:
    """SIGKILL, then ``podman rm -f --time 0`` (a plain force-remove waits out the container's
    stop timeout first). The kill comes first because a driver's stop under way on the
    container returns when it dies, but not when it is removed: it would hold its thread for
    the whole grace period."""
    # Refused (500 "container state improper", 404) when it is not running: the remove below
    # reports any real trouble.
    client.api.post(f"/containers/{container_id}/kill", params={"signal": "SIGKILL"})
    response = client.api.delete(
        f"/containers/{container_id}", params={"force": True, "timeout": 0, "volumes": True}
    )
    if response.status_code != 404:
        response.raise_for_status()


DRIVER_STOP_TIMEOUT = 5.0  # the Podman driver's default grace period in these tests


@asynccontextmanager
async def podman_env(
    podman: PodmanClient, prefix: str
) -> AsyncIterator[tuple[Env, PodmanDriver, PodmanKeys]]:
    """An isolated environment with a Podman driver, and unique sandbox names whose containers
    and volumes are force-removed afterwards."""
    keys = PodmanKeys(podman, prefix)
    try:
        async with isolated_env() as env:
            driver = podman_driver(env.settings, stop_timeout=DRIVER_STOP_TIMEOUT)
            try:
                yield env, driver, keys
            finally:
                await driver.close()
    finally:
        await asyncio.to_thread(keys.cleanup)


@asynccontextmanager
async def running_plane(
    env: Env, driver: Driver, *, removing: PodmanKeys | None = None, **plane_args: Any
) -> AsyncIterator[ControlPlane]:
    """A started control plane (processor, executor, watcher, reconciler), stopped afterwards;
    with ``removing``, as stop_after_removing does."""
    plane = ControlPlane(env.settings, driver, env.pool, **plane_args)
    await plane.start()
    try:
        yield plane
    finally:
        await stop_after_removing(plane, removing)


async def stop_after_removing(plane: ControlPlane, keys: PodmanKeys | None) -> None:
    """Force-remove the keys' containers and volumes, then stop the plane, even if removing
    them failed: a driver stop still waiting out a long grace (a failed test's) ends at once
    instead of holding the plane's stop for the executor's shutdown grace."""
    try:
        if keys is not None:
            await asyncio.to_thread(keys.cleanup)
    finally:
        await plane.stop()


async def rewind_group(settings: Settings, group: str, offset: int | None = 0) -> None:
    """Commit ``offset`` on every partition of the events topic (``kafka_partitions`` of
    them) for ``group``: an executor of that group then resumes as if it had crashed long ago
    (an old committed offset). ``None`` commits each partition's end: as if the group had
    read everything in the topic already."""
    consumer = AIOKafkaConsumer(
        **kafka_client_args(settings, "admin"), group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topic_events, p) for p in range(settings.kafka_partitions)]
        consumer.assign(tps)
        at = await consumer.end_offsets(tps) if offset is None else dict.fromkeys(tps, offset)
        await consumer.commit(at)
    finally:
        await consumer.stop()


async def forget_group(settings: Settings, group: str) -> None:
    """Delete the (empty) consumer group ``group`` with its committed offsets: an executor of
    that group then joins as a new group."""
    from confluent_kafka.admin import AdminClient

    from services.localstack.kafka_auth import admin_config

    admin = AdminClient(admin_config(settings))
    for future in admin.delete_consumer_groups([group]).values():
        await asyncio.to_thread(future.result, 30)


async def caught_up(settings: Settings, group: str) -> bool:
    """Whether ``group`` has committed the end of every partition of the events topic."""
    consumer = AIOKafkaConsumer(
        **kafka_client_args(settings, "admin"), group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topic_events, p) for p in range(settings.kafka_partitions)]
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            if (await consumer.committed(tp) or 0) < ends[tp]:
                return False
        return True
    finally:
        await consumer.stop()


async def processor_caught_up(env: Env) -> bool:
    """Whether the processor has applied every record now in its input topics (commands and
    observations): the offsets it stores in PostgreSQL reach the ends of their partitions."""
    s = env.settings
    topics = [s.topic_commands, s.topic_observations]
    consumer = AIOKafkaConsumer(**kafka_client_args(s, "admin"), enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in range(s.kafka_partitions)]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    rows = await env.fetch(
        "SELECT topic, partition, next_offset FROM input_offsets WHERE topic = ANY($1::text[])",
        topics,
    )
    stored = {TopicPartition(r["topic"], r["partition"]): r["next_offset"] for r in rows}
    return all(stored.get(tp, 0) >= end for tp, end in ends.items())


async def group_started(settings: Settings, group: str) -> bool:
    """Whether ``group`` has a committed offset on every partition of the events topic (an
    executor of a new group commits its starting position once it is assigned)."""
    consumer = AIOKafkaConsumer(
        **kafka_client_args(settings, "admin"), group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topic_events, p) for p in range(settings.kafka_partitions)]
        return all([await consumer.committed(tp) is not None for tp in tps])
    finally:
        await consumer.stop()
