"""A failed delete is retried until the backend confirms, through the real pipeline (Kafka,
PostgreSQL, the processor, the executor and its reconcile loop) over the fake driver: with
delete deadlines turned off (``delete_retry_seconds`` 0), the reconcile loop's pick-up is what
asks again, and every failure stays visible in the history while the row stays Deleting."""

from __future__ import annotations

import builtins
from typing import Any
from uuid import UUID, uuid4

import factories as f
from aiokafka import AIOKafkaProducer
from harness import eventually, isolated_env
from pipeline_support import command, history, phase, wait_phase

from drivers.fake import FakeDriver
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.common.kafka_clients import kafka_client_args
from services.executor.calls import RetryPolicy
from services.executor.driver_side import DriverSide
from services.executor.reconcile import Reconciler

FAST_RETRY = RetryPolicy(first_delay=0.01, max_delay=0.05, give_up_after=0.2)


def failed_deletes(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        h
        for h in items
        if h["message_type"] == "DriverOperationResult"
        and (h["message"]["operation"], h["message"]["outcome"]) == ("delete", "failed")
    ]


async def test_with_delete_deadlines_off_the_pick_up_retries_a_failed_delete() -> None:
    driver = FakeDriver()
    async with isolated_env() as env:
        env.settings = env.settings.model_copy(update={"delete_retry_seconds": 0})
        await env.start_processor()
        side = DriverSide(env.settings, driver, env.pool, reconcile_interval=0.3, retry=FAST_RETRY)
        await side.start()
        try:
            async with await env.publisher() as pub:
                await command(env, pub, f.create("x"))
                await wait_phase(env, "x", "Ready")
                driver.fail("delete", "x", "workspace in use", retryable=False, times=3)
                await command(env, pub, f.delete("x"))
                failures = await eventually(
                    lambda: history(env, "x"),
                    lambda items: len(failed_deletes(items)) >= 2,
                    what="two failed deletes recorded",
                )
                assert await phase(env, "x") in ("Deleting", "Deleted")
                reasons = [h["reason"] for h in failed_deletes(failures)]
                assert all(r.endswith("Deleting -> Deleting") for r in reasons), reasons
                await wait_phase(env, "x", "Deleted", timeout=30)
            items = await history(env, "x")
            failed = failed_deletes(items)
            assert len(failed) == 3
            assert all((h["disposition"], h["phase"]) == ("applied", "Deleting") for h in failed)
            assert len(driver.calls_for("delete", "x")) == 4
            assert side.reconciler is not None and side.reconciler.picked_up >= 3
        finally:
            await side.stop()


async def test_a_failed_delete_waits_for_its_deadline_not_for_the_next_pick_up() -> None:
    """The reconcile loop picks up a row unchanged in a progressing phase for a whole pass. A
    Deleting row whose delete failed is unchanged until its deadline's retry: picked up, it was
    deleted again every other pass (every minute at the defaults), undoing the back-off and
    adding a failure to the history each time."""
    driver = FakeDriver()
    async with isolated_env() as env:
        env.settings = env.settings.model_copy(update={"delete_retry_seconds": 3600})
        await env.start_processor()
        side = DriverSide(env.settings, driver, env.pool, reconcile_interval=0.2, retry=FAST_RETRY)
        await side.start()
        try:
            async with await env.publisher() as pub:
                await command(env, pub, f.create("x"))
                await wait_phase(env, "x", "Ready")
                driver.fail("delete", "x", "workspace in use", retryable=False, times=None)
                await command(env, pub, f.delete("x"))
                await eventually(
                    lambda: history(env, "x"),
                    lambda items: len(failed_deletes(items)) == 1,
                    what="the failed delete recorded",
                )
                reconciler = side.reconciler
                assert reconciler is not None
                passes = reconciler.passes
                await eventually(
                    lambda: reconciler.passes, lambda n: n >= passes + 5,
                    what="five more reconcile passes",
                )  # fmt: skip
            assert await phase(env, "x") == "Deleting"
            assert len(driver.calls_for("delete", "x")) == 1
            assert len(failed_deletes(await history(env, "x"))) == 1
        finally:
            await side.stop()


class BrokenHoldings(FakeDriver):
    """A backend whose listing of workspaces fails (its runtimes list fine)."""

    async def incarnations(self) -> builtins.set[tuple[str, UUID]]:
        raise RuntimeError("listing the volumes failed")


async def test_a_failing_leftover_listing_leaves_the_reconcile_reports_alone() -> None:
    async with isolated_env() as env:
        await env.pool.execute(
            "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, "
            "providers, identity, created_at, updated_at, partition, change_seq) "
            "VALUES ('gone', $1, 'Ready', 1, 2, $2, '{}', 'rid-1', now(), now(), 0, 1)",
            uuid4(),
            SandboxSpec(image="x").model_dump_json(),
        )
        producer = AIOKafkaProducer(**kafka_client_args(env.settings, "watcher"))
        await producer.start()
        try:
            reconciler = Reconciler(
                BrokenHoldings(), env.pool, producer, env.settings, interval=3600,
                collect=lambda key, sandbox_id, generation: True,
            )  # fmt: skip
            found = await reconciler.run_once()
            assert [o.type for o in found] == ["RuntimeRemoved"]  # the vanished runtime
            assert reconciler.passes == 1
        finally:
            await producer.stop()


async def test_a_sandbox_created_and_deleted_during_a_pass_is_collected_too() -> None:
    """A pass reads the rows, then lists the backend, then asks for the tombstones. A sandbox
    created after the rows were read and deleted before the tombstones were asked for is a
    tombstoned incarnation the listing holds (its container still listed): collected, as
    docs/drivers.md says, a second delete of what its own delete removed."""
    async with isolated_env() as env:
        sandbox_id = uuid4()
        driver = FakeDriver()
        await driver.launch(LaunchSpec("brief", sandbox_id, 1, "rid-1", SandboxSpec(image="x")))
        await env.pool.execute(
            "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, "
            "providers, identity, created_at, updated_at, partition, change_seq) "
            "VALUES ('brief', $1, 'Deleted', 1, 3, $2, '{}', 'rid-1', now(), now(), 0, 1)",
            sandbox_id,
            SandboxSpec(image="x").model_dump_json(),
        )
        handed: list[tuple[str, UUID, int]] = []

        def collect(key: str, incarnation: UUID, generation: int) -> bool:
            handed.append((key, incarnation, generation))
            return True

        reconciler = Reconciler(
            driver, env.pool, None, env.settings, interval=3600, collect=collect,  # type: ignore[arg-type]
        )  # fmt: skip
        await reconciler.collect_leftovers([])  # the rows, read before the create: none
        assert handed == [("brief", sandbox_id, 1)]
        assert reconciler.collected == 1
