"""Suspend that keeps memory, on real Podman with the CRIU the stack builds
(drivers/podman_checkpoint.py, services/localstack/criu_build.py).

The tests run a Podman API service of their own, started by the stack's own code
(``podman_service.up`` on a socket of their own, so with the built CRIU first on its PATH) on
the machine's one container store: the shared stack's service may have been started before
CRIU was built. The agent is a shell whose counter lives in its memory and is written to the
workspace every 50 ms: a restored process carries on from where it was, a fresh one starts
again at 1.
"""

from __future__ import annotations

import asyncio
import io
import stat
import subprocess
import tarfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import factories as f
import pytest
from harness import eventually, isolated_env
from pipeline_support import PodmanKeys, command, history, running_plane, wait_phase
from podman import PodmanClient
from test_driver_podman import containers_of, spec_for, volumes_of

from drivers.podman import PodmanDriver, container_name, volume_name
from drivers.podman_calls import PodmanCalls
from drivers.podman_checkpoint import Checkpoints
from drivers.podman_memory import (
    FRESH,
    NOT_KEPT,
    RESTART_AFRESH,
    RESTORED,
    WITH_PROVIDERS,
    restore_or_create,
)
from drivers.podman_objects import BACKEND_ERRORS
from drivers.podman_spec import DEFAULT_LIMITS
from events.common import SandboxSpec
from services.common.settings import Settings
from services.localstack import podman_service

# Written to a temporary file and renamed, so a reader never sees it empty (truncated).
TICK = "i=$((i+1)); echo $i > /workspace/n.new; mv /workspace/n.new /workspace/n; sleep 0.05"
COUNTER = ["sh", "-c", f"i=0; while true; do {TICK}; done"]
STOP_TIMEOUT = 2.0
WAIT = 60.0


@pytest.fixture(scope="module")
def criu_settings(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Settings]:
    """The stack's settings with a Podman service of this module's own (same store, same
    image, same CRIU cache), started and stopped by the stack's code."""
    state = tmp_path_factory.mktemp("criu")
    # A new Settings, not a copy: the socket's path is cached on the object.
    own = Settings(
        state_dir=state, podman_socket=state / "podman.sock", kube_home=settings.kube_home_path
    )
    podman_service.up(own)
    try:
        yield own
    finally:
        podman_service.stop(own)


@pytest.fixture
async def driver(criu_settings: Settings, tmp_path: Path) -> AsyncIterator[PodmanDriver]:
    drv = PodmanDriver(
        criu_settings.podman_url, stop_timeout=STOP_TIMEOUT, checkpoint_dir=tmp_path / "ckpt"
    )
    yield drv
    await drv.close()


@pytest.fixture
def keys(podman: PodmanClient) -> Iterator[Callable[[], str]]:
    made = PodmanKeys(podman, "mem")
    yield made
    made.cleanup()


async def counter(driver: PodmanDriver, key: str, generation: int) -> int:
    read = "cat /workspace/n 2>/dev/null || echo 0"  # 0 until the first tick has written it
    code, out = await driver.exec(key, generation, ["sh", "-c", read])
    assert code == 0, out
    return int(out)


async def counted_past(driver: PodmanDriver, key: str, generation: int, floor: int) -> int:
    return await eventually(
        lambda: counter(driver, key, generation),
        lambda value: value > floor,
        timeout=WAIT,
        what=f"{key}'s counter past {floor}",
    )


async def test_a_suspend_with_memory_resumes_the_agents_counter_where_it_stopped(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    first = spec_for(settings, key, 1, COUNTER)
    await driver.launch(first)
    before = await counted_past(driver, key, 1, 40)
    suspended = await driver.suspend(key, 1)
    assert suspended.outcome == "succeeded"
    assert (suspended.note or "").startswith("memory kept: generation 1 checkpointed")
    assert containers_of(podman, key) == []
    assert volumes_of(podman, key) == [volume_name(key, first.sandbox_id)]
    at_suspend = await asyncio.to_thread(read_volume_counter, podman, key, first.sandbox_id)
    assert at_suspend >= before
    resumed = await driver.launch(spec_for(settings, key, 2, COUNTER, first.sandbox_id))
    assert resumed.started and resumed.note == f"{RESTORED} of generation 1"
    assert containers_of(podman, key) == [container_name(key, 2)]
    # The shell's counter carries on from the value it had in memory; a fresh one would
    # count from 1 again and overwrite the file with smaller numbers.
    assert await counter(driver, key, 2) >= at_suspend
    assert await counted_past(driver, key, 2, at_suspend + 5) > at_suspend
    code, out = await driver.exec(key, 2, ["sh", "-c", "echo $SANDSTREAM_IDENTITY"])
    assert (code, out.strip()) == (0, f"rid-{key}-2")  # an exec gets the new generation's
    # It suspends with its memory again (its restore-only CRIU option is gone by then).
    again = await driver.suspend(key, 2)
    assert (again.note or "").startswith("memory kept: generation 2 checkpointed"), again.note
    third = await driver.launch(spec_for(settings, key, 3, COUNTER, first.sandbox_id))
    assert third.note == f"{RESTORED} of generation 2"
    assert await counter(driver, key, 3) > before


async def test_a_failed_restore_starts_afresh_on_the_same_workspace(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    first = spec_for(settings, key, 1, COUNTER)
    await driver.launch(first)
    await driver.exec(key, 1, ["sh", "-c", "echo kept > /workspace/marker"])
    before = await counted_past(driver, key, 1, 40)
    await driver.suspend(key, 1)
    corrupt_checkpoint(Checkpoints(driver_checkpoints(driver)).archive(key, first.sandbox_id))
    resumed = await driver.launch(spec_for(settings, key, 2, COUNTER, first.sandbox_id))
    assert resumed.started
    assert (resumed.note or "").startswith(
        f"{FRESH}: the memory checkpoint was not restored (its restore failed: "
    ), resumed.note
    assert containers_of(podman, key) == [container_name(key, 2)]  # the failed one removed
    code, out = await driver.exec(key, 2, ["cat", "/workspace/marker"])
    assert (code, out) == (0, "kept\n")
    # Started afresh: the counter began again from 1 (it overwrites the file each tick).
    await eventually(
        lambda: counter(driver, key, 2),
        lambda value: value < before,
        timeout=WAIT,
        what="a counter started afresh",
    )
    assert list(driver_checkpoints(driver).glob("*.tar")) == []  # used once


async def test_a_resume_that_loses_podman_keeps_the_checkpoint_for_its_retry(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, tmp_path: Path
) -> None:
    """Podman goes away after the launch's listing: the restore and the create both fail (a
    client and a driver's calls on a socket nobody serves), the launch fails retryable, and the
    checkpoint stays for the retry, which restores it."""
    key = keys()
    first = spec_for(settings, key, 1, COUNTER)
    await driver.launch(first)
    before = await counted_past(driver, key, 1, 20)
    await driver.suspend(key, 1)
    store = Checkpoints(driver_checkpoints(driver))
    resume = spec_for(settings, key, 2, COUNTER, first.sandbox_id)
    nobody = f"unix://{tmp_path / 'nobody.sock'}"
    away = PodmanCalls(
        nobody, stop_timeout=STOP_TIMEOUT, request_timeout=5, init=True, limits=DEFAULT_LIMITS
    )
    try:
        with pytest.raises(BACKEND_ERRORS):
            await asyncio.to_thread(
                restore_or_create, away.client(), store, resume, away._args(resume), away._create
            )
    finally:
        away.close()
    assert store.archive(key, first.sandbox_id).exists()
    retried = await driver.launch(resume)
    assert retried.note == f"{RESTORED} of generation 1"
    assert await counter(driver, key, 2) >= before


async def test_a_resume_with_changed_launch_arguments_starts_afresh(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings
) -> None:
    key = keys()
    first = spec_for(settings, key, 1, COUNTER)
    await driver.launch(first)
    await counted_past(driver, key, 1, 5)
    await driver.suspend(key, 1)
    other = spec_for(settings, key, 2, [*COUNTER[:2], COUNTER[2] + " # changed"], first.sandbox_id)
    resumed = await driver.launch(other)
    assert resumed.note == (
        f"{FRESH}: the memory checkpoint was not restored "
        "(the sandbox's launch arguments changed since the suspend)"
    )


async def test_a_suspend_keeps_no_memory_of_an_agent_given_provider_values(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """The agent ran with a provider's value (it read it into its memory); the provider is
    detached while suspended, so the resume's launch has no secrets: restoring the memory would
    hand the detached value back to the agent. The suspend keeps no memory of an agent given
    provider values, so the resume starts afresh."""
    key = keys()
    reads = ["sh", "-c", f"tok=$TOKEN; i=0; while true; do {TICK}; done"]
    first = replace(spec_for(settings, key, 1, reads), secrets={"TOKEN": "s3cret-value"})
    await driver.launch(first)
    await counted_past(driver, key, 1, 5)
    suspended = await driver.suspend(key, 1)
    assert suspended.outcome == "succeeded"
    resumed = await driver.launch(spec_for(settings, key, 2, reads, first.sandbox_id))
    assert resumed.started
    # Not even written: the agent's memory holds the value, and no resume could restore it.
    assert suspended.note == f"{NOT_KEPT}: {WITH_PROVIDERS}"
    assert list(driver_checkpoints(driver).glob("*")) == []
    assert resumed.note is None  # nothing to restore
    _, out = await driver.exec(key, 2, ["sh", "-c", "cat /proc/*/environ"])
    assert "s3cret-value" not in out


async def test_a_checkpoint_that_cannot_be_kept_leaves_a_plain_suspend(
    criu_settings: Settings,
    keys: Callable[[], str],
    settings: Settings,
    podman: PodmanClient,
    tmp_path: Path,
) -> None:
    """The checkpoint directory cannot be made (a file is in its place): the suspend says the
    memory was not kept and removes the container as a storage-only suspend does, and the
    resume starts afresh, saying nothing."""
    (tmp_path / "taken").write_text("")
    unkept = PodmanDriver(
        criu_settings.podman_url, stop_timeout=STOP_TIMEOUT, checkpoint_dir=tmp_path / "taken"
    )
    try:
        key = keys()
        first = spec_for(settings, key, 1, COUNTER)
        await unkept.launch(first)
        await counted_past(unkept, key, 1, 5)
        suspended = await unkept.suspend(key, 1)
        assert suspended.outcome == "succeeded"
        assert (suspended.note or "").startswith(
            "memory not kept (storage only): its checkpoint failed: "
        ), suspended.note
        assert containers_of(podman, key) == []
        assert volumes_of(podman, key) == [volume_name(key, first.sandbox_id)]
        resumed = await unkept.launch(spec_for(settings, key, 2, COUNTER, first.sandbox_id))
        assert resumed.started and resumed.note is None
    finally:
        await unkept.close()


async def test_a_checkpoint_on_a_full_disk_leaves_no_partial_archive(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """The archive's write fails with ENOSPC (its partial file is /dev/full): the suspend says
    the memory was not kept, and nothing of the agent's memory stays in the directory, where
    no delete would ever find it."""
    key = keys()
    first = spec_for(settings, key, 1, COUNTER)
    await driver.launch(first)
    await counted_past(driver, key, 1, 5)
    store = Checkpoints(driver_checkpoints(driver))
    store.root.mkdir(mode=0o700)
    store.archive(key, first.sandbox_id).with_suffix(".partial").symlink_to("/dev/full")
    suspended = await driver.suspend(key, 1)
    assert suspended.outcome == "succeeded"
    assert (suspended.note or "").startswith(
        f"{NOT_KEPT}: its checkpoint failed: [Errno 28] No space left on device"
    ), suspended.note
    assert containers_of(podman, key) == []
    assert sorted(p.name for p in store.root.iterdir()) == []


async def test_a_suspend_on_a_checkpoint_directory_that_turned_read_only_still_suspends(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    """An older checkpoint of the incarnation is in a directory nothing can change any more
    (immutable, as a file system remounted read-only): the suspend cannot remove it, says the
    memory was not kept and removes the container, rather than failing on every retry."""
    key = keys()
    first = spec_for(settings, key, 1, COUNTER)
    await driver.launch(first)
    await counted_past(driver, key, 1, 5)
    store = Checkpoints(driver_checkpoints(driver))
    store.save(key, first.sandbox_id, [b"older"], {"key": key, "sandbox_id": str(first.sandbox_id)})
    await asyncio.to_thread(subprocess.run, ["chattr", "+i", str(store.root)], check=True)
    try:
        suspended = await driver.suspend(key, 1)
    finally:
        await asyncio.to_thread(subprocess.run, ["chattr", "-i", str(store.root)], check=True)
    assert suspended.outcome == "succeeded"
    assert (suspended.note or "").startswith(
        f"{NOT_KEPT}: its checkpoint failed: [Errno 1] Operation not permitted"
    ), suspended.note
    assert containers_of(podman, key) == []


async def test_a_memory_checkpoint_is_private_and_a_delete_leaves_none(
    driver: PodmanDriver, keys: Callable[[], str], settings: Settings, podman: PodmanClient
) -> None:
    key = keys()
    first = spec_for(settings, key, 1, COUNTER)
    await driver.launch(first)
    await counted_past(driver, key, 1, 5)
    await driver.suspend(key, 1)
    store = Checkpoints(driver_checkpoints(driver))
    # The agent's memory is its owner's only.
    assert stat.S_IMODE(store.archive(key, first.sandbox_id).stat().st_mode) == 0o600
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert (key, first.sandbox_id) in await driver.incarnations()
    assert await driver.delete(key, first.sandbox_id)
    assert sorted(p.name for p in store.root.iterdir()) == []
    assert containers_of(podman, key) == [] and volumes_of(podman, key) == []
    assert (key, first.sandbox_id) not in await driver.incarnations()


async def test_the_history_says_whether_a_resume_restored_the_memory(
    driver: PodmanDriver, podman: PodmanClient
) -> None:
    """Through the pipeline: the suspend's and the resume's results carry the driver's word
    (DriverOperationResult.reason), first a restore, then, the checkpoint broken, a fresh
    start."""
    async with isolated_env() as env:
        keys = PodmanKeys(podman, "memh")
        key = keys()
        spec = SandboxSpec(image=env.settings.sandbox_image, command=COUNTER)
        async with running_plane(env, driver, removing=keys), await env.publisher() as pub:
            await command(env, pub, f.create(key, sandbox_spec=spec))
            await wait_phase(env, key, "Ready", timeout=WAIT)
            await counted_past(driver, key, 1, 5)
            await command(env, pub, f.suspend(key))
            await wait_phase(env, key, "Suspended", generation=1, timeout=WAIT)
            await command(env, pub, f.resume(key))
            await wait_phase(env, key, "Ready", generation=2, timeout=WAIT)
            await command(env, pub, f.suspend(key))
            await wait_phase(env, key, "Suspended", generation=2, timeout=WAIT)
            for archive in driver_checkpoints(driver).glob("*.tar"):
                corrupt_checkpoint(archive)
            await command(env, pub, f.resume(key))
            await wait_phase(env, key, "Ready", generation=3, timeout=WAIT)
            notes = [
                (h["message"]["operation"], h["generation"], h["message"]["reason"])
                for h in await history(env, key)
                if h["message_type"] == "DriverOperationResult"
                and h["message"]["operation"] in ("launch", "suspend")
            ]
        assert [(op, gen) for op, gen, _ in notes] == [
            ("launch", 1), ("suspend", 1), ("launch", 2), ("suspend", 2), ("launch", 3),
        ]  # fmt: skip
        reasons = [reason or "" for _, _, reason in notes]
        assert reasons[0] == ""
        assert reasons[1].startswith("memory kept: generation 1 checkpointed")
        assert reasons[2] == f"{RESTORED} of generation 1"
        assert reasons[3].startswith("memory kept: generation 2 checkpointed")
        assert reasons[4].startswith(f"{FRESH}: the memory checkpoint was not restored (its")


async def test_a_restart_of_a_suspended_sandbox_starts_the_agent_afresh(
    driver: PodmanDriver, podman: PodmanClient
) -> None:
    """RestartSandbox admits Suspended; a restart is the agent started again, so its launch
    does not restore the suspend's memory (a resume or a start would): the counter begins
    again, and the history says why."""
    async with isolated_env() as env:
        keys = PodmanKeys(podman, "memr")
        key = keys()
        spec = SandboxSpec(image=env.settings.sandbox_image, command=COUNTER)
        async with running_plane(env, driver, removing=keys), await env.publisher() as pub:
            await command(env, pub, f.create(key, sandbox_spec=spec))
            await wait_phase(env, key, "Ready", timeout=WAIT)
            before = await counted_past(driver, key, 1, 40)
            await command(env, pub, f.suspend(key))
            await wait_phase(env, key, "Suspended", generation=1, timeout=WAIT)
            await command(env, pub, f.restart(key))
            await wait_phase(env, key, "Ready", generation=2, timeout=WAIT)
            await eventually(
                lambda: counter(driver, key, 2),
                lambda value: value < before,
                timeout=WAIT,
                what="a counter started afresh",
            )
            reasons = [
                h["message"]["reason"]
                for h in await history(env, key)
                if h["message_type"] == "DriverOperationResult"
                and h["message"]["operation"] == "launch"
                and h["generation"] == 2
            ]
        assert reasons == [f"{FRESH}: the memory checkpoint was not restored ({RESTART_AFRESH})"], (
            reasons
        )
        assert list(driver_checkpoints(driver).glob("*.tar")) == []


# -- helpers -------------------------------------------------------------------------------------


def driver_checkpoints(driver: PodmanDriver) -> Path:
    store = driver._sync.checkpoints
    assert store is not None
    return store.root


def corrupt_checkpoint(archive: Path) -> None:
    """Break the CRIU images in an exported checkpoint (the archive itself stays readable, so
    the restore gets as far as CRIU)."""
    out = io.BytesIO()
    with tarfile.open(archive) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member) if member.isfile() else None
            if member.name.startswith("checkpoint/pstree"):
                junk = b"\0" * member.size
                dst.addfile(member, io.BytesIO(junk))
            else:
                dst.addfile(member, data)
    archive.write_bytes(out.getvalue())


def read_volume_counter(podman: PodmanClient, key: str, sandbox_id: uuid.UUID) -> int:
    volume = podman.volumes.get(volume_name(key, sandbox_id))
    return int((Path(volume.attrs["Mountpoint"]) / "n").read_text())
