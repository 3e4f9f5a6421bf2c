"""Streamed exec and the core-dump limit of the Podman driver, on the real Podman service,
through both exec paths: runc directly ("runtime", drivers/podman_runc.py) and Podman's exec
API ("api", drivers/podman_exec.py).

Fails (never skips) when the service or the sandbox image is missing (see conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import pytest
from exec_support import running_with
from harness import eventually
from podman import PodmanClient

from drivers import podman_exec, podman_runc
from drivers.podman import PodmanDriver
from drivers.podman_exec import OutputBuffer
from drivers.podman_objects import container_name
from drivers.podman_runc import RUNC_ROOT, ExecMode
from drivers.protocol import (
    DriverError,
    ExecDriver,
    ExecEvent,
    ExecExit,
    ExecOutput,
    LaunchSpec,
)
from events.common import SandboxSpec
from services.common.settings import Settings

WAIT = 20.0
MODES = ("runtime", "api")


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> ExecMode:
    mode: ExecMode = request.param
    return mode


@pytest.fixture
async def driver(
    settings: Settings, podman: PodmanClient, mode: ExecMode
) -> AsyncIterator[PodmanDriver]:
    drv = PodmanDriver(settings.podman_url, stop_timeout=1, exec_mode=mode)
    yield drv
    await drv.close()


def low_level(
    mode: ExecMode, settings: Settings, podman: PodmanClient, container: str,
    command: list[str], *, buffer: OutputBuffer, grace: float = 5.0,
) -> AsyncGenerator[ExecEvent, None]:  # fmt: skip
    """One path's exec_stream, by the container's name (Podman's API) or id (runc)."""
    if mode == "api":
        return podman_exec.exec_stream(
            settings.podman_url, container, command, buffer=buffer, grace=grace
        )
    runc, why = podman_runc.probe(settings.podman_url, "runtime", RUNC_ROOT, WAIT)
    assert runc is not None, why
    runtime_id = str(podman.containers.get(container).id)
    return podman_runc.exec_stream(runc, runtime_id, command, buffer=buffer, grace=grace)


@pytest.fixture
async def running(
    driver: PodmanDriver, settings: Settings
) -> AsyncIterator[Callable[[], asyncio.Future[str]]]:
    """Launches sandboxes (generation 1, a sleeping main process); deletes them afterwards."""
    made: list[str] = []

    async def launch() -> str:
        key = f"exec-{uuid.uuid4().hex[:10]}"
        made.append(key)
        spec = SandboxSpec(image=settings.sandbox_image, command=["sleep", "3600"])
        await driver.launch(LaunchSpec(key, uuid.uuid4(), 1, f"rid-{key}", spec))
        return key

    yield lambda: asyncio.ensure_future(launch())
    for key in made:
        await driver.delete(key)


async def collect(stream: AsyncIterator[ExecEvent]) -> list[ExecEvent]:
    return [event async for event in stream]


def joined(events: list[ExecEvent], stream: str) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, ExecOutput) and e.stream == stream)


def test_podman_driver_has_the_exec_capability(driver: PodmanDriver) -> None:
    assert isinstance(driver, ExecDriver)


async def test_exec_streams_stdout_and_stderr_apart_then_the_exit_code(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]]
) -> None:
    key = await running()
    events = await asyncio.wait_for(
        collect(driver.exec_stream(key, 1, ["sh", "-c", "printf out; printf err >&2; exit 3"])),
        WAIT,
    )
    assert joined(events, "stdout") == b"out"
    assert joined(events, "stderr") == b"err"
    assert events[-1] == ExecExit(3)
    assert sum(isinstance(e, ExecExit) for e in events) == 1


async def test_exec_passes_environment_and_working_directory(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]]
) -> None:
    key = await running()
    stream = driver.exec_stream(
        key, 1, ["sh", "-c", 'echo "$GREETING $(pwd)"'], env={"GREETING": "hi"}, workdir="/tmp"
    )
    events = await asyncio.wait_for(collect(stream), WAIT)
    assert joined(events, "stdout") == b"hi /tmp\n"
    assert events[-1] == ExecExit(0)


async def test_exec_feeds_stdin_then_its_end(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]]
) -> None:
    """The input reaches the command whole (larger than a pipe's buffer), then its end: ``wc``
    returns only once it has read the end."""
    key = await running()
    data = b"line\n" * 50_000
    stream = driver.exec_stream(key, 1, ["wc", "-c"], stdin=data)
    events = await asyncio.wait_for(collect(stream), WAIT)
    assert joined(events, "stdout").strip() == str(len(data)).encode()
    assert events[-1] == ExecExit(0)


async def test_exec_without_stdin_reads_its_end_at_once(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]]
) -> None:
    key = await running()
    events = await asyncio.wait_for(collect(driver.exec_stream(key, 1, ["cat"])), WAIT)
    assert joined(events, "stdout") == b""
    assert events[-1] == ExecExit(0)


async def test_exec_input_the_command_never_reads_still_gives_the_exit_code(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]]
) -> None:
    """Regression: a command that exits without reading a large input made Podman reset the
    stream, and the exec failed ("output broke off") instead of reporting the exit code."""
    key = await running()
    for _ in range(3):  # the reset is a race in Podman: it came in most runs of three
        stream = driver.exec_stream(key, 1, ["sh", "-c", "exit 5"], stdin=b"x" * 4_000_000)
        events = await asyncio.wait_for(collect(stream), WAIT)
        assert events[-1] == ExecExit(5)


async def test_a_background_child_holding_the_output_does_not_hold_the_exit(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]], podman: PodmanClient
) -> None:
    """Regression (runtime path): runc in the foreground copied the output until every
    holder closed it, so ``sh -c "server & echo started"`` answered only once ``server``
    ended. Both paths answer when the command exits: here while its background child, which
    still holds stdout and stderr, runs on."""
    key = await running()
    marker = f"{uuid.uuid4().int % 100_000 + 600_000}"  # the sleep's seconds: it outlives the test
    stream = driver.exec_stream(key, 1, ["sh", "-c", f"sleep {marker} & echo started"])
    events = await asyncio.wait_for(collect(stream), WAIT)
    assert joined(events, "stdout") == b"started\n"
    assert events[-1] == ExecExit(0)
    # Answered while the background child still runs (and still holds the output): one
    # process of the marker, the child (its command line the shell's until it execs sleep).
    container = container_name(key, 1)
    assert len(running_with(podman, container, marker)) == 1
    await eventually(lambda: running_with(podman, container, marker),
                     lambda now: now == [f"sleep {marker}"], timeout=WAIT,
                     what="the background sleep running on")  # fmt: skip


async def test_exec_output_arrives_while_the_command_still_runs(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]]
) -> None:
    key = await running()
    stream = driver.exec_stream(key, 1, ["sh", "-c", "echo first; sleep 600"])
    first = await asyncio.wait_for(anext(stream), WAIT)
    assert first == ExecOutput("stdout", b"first\n")
    await asyncio.wait_for(stream.aclose(), WAIT)


TOTAL = 20_000_000  # bytes of output, many times the buffer's chunks


async def test_output_a_caller_does_not_take_is_read_ahead_only_as_far_as_the_buffer(
    settings: Settings,
    running: Callable[[], asyncio.Future[str]],
    mode: ExecMode,
    podman: PodmanClient,
) -> None:
    """Regression: the reading thread queued all the output a caller did not take (an exec of
    ``head -c 300000000 /dev/zero`` read once grew the gateway by 300 MB). Now it waits for room
    once the buffer holds its size, and every byte still arrives once the caller reads."""
    key = await running()
    buffer = OutputBuffer(4)
    events = low_level(
        mode, settings, podman, container_name(key, 1), ["head", "-c", str(TOTAL), "/dev/zero"],
        buffer=buffer,
    )  # fmt: skip
    async with contextlib.aclosing(events):
        first = await asyncio.wait_for(anext(events), WAIT)
        assert isinstance(first, ExecOutput)
        # The thread fills the buffer and waits for room: it reads no further.
        await eventually(lambda: (buffer.waiting, buffer.held), lambda now: now == (True, 4),
                         timeout=WAIT, what="a full buffer and the thread waiting")  # fmt: skip
        assert buffer.most == 4
        rest = await asyncio.wait_for(collect(events), WAIT)
    assert len(first.data) + len(joined(rest, "stdout")) == TOTAL
    assert rest[-1] == ExecExit(0)
    assert buffer.most == 4


async def test_leaving_while_the_reading_thread_waits_for_room_ends_the_command(
    settings: Settings,
    running: Callable[[], asyncio.Future[str]],
    podman: PodmanClient,
    mode: ExecMode,
) -> None:
    key = await running()
    marker = f"{uuid.uuid4().int % 100_000 + 300_000}"
    buffer = OutputBuffer(2)
    script = f"while :; do head -c 1000000 /dev/zero; done # {marker}"
    events = low_level(
        mode, settings, podman, container_name(key, 1), ["sh", "-c", script], buffer=buffer,
        grace=0.5,
    )  # fmt: skip
    assert isinstance(await asyncio.wait_for(anext(events), WAIT), ExecOutput)
    await eventually(lambda: buffer.waiting, bool, timeout=WAIT,
                     what="the reading thread waiting for room")  # fmt: skip
    await asyncio.wait_for(events.aclose(), WAIT)
    assert running_with(podman, container_name(key, 1), marker) == []
    await eventually(lambda: buffer.waiting, lambda waiting: not waiting, timeout=WAIT,
                     what="the reading thread woken")  # fmt: skip


async def test_leaving_an_exec_early_terminates_the_command_and_its_background_children(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]], podman: PodmanClient
) -> None:
    key = await running()
    marker = f"{uuid.uuid4().int % 100_000 + 100_000}"  # a sleep no other test runs
    script = (f'trap "echo term > /tmp/{marker}; exit 0" TERM; sleep {marker} & '
              f"echo first; sleep {marker}; wait")  # fmt: skip
    stream = driver.exec_stream(key, 1, ["sh", "-c", script])
    assert await asyncio.wait_for(anext(stream), WAIT) == ExecOutput("stdout", b"first\n")
    container = container_name(key, 1)
    await eventually(lambda: running_with(podman, container, marker),
                     lambda now: now.count(f"sleep {marker}") == 2, timeout=WAIT,
                     what="both sleeps running")  # fmt: skip
    await asyncio.wait_for(stream.aclose(), WAIT)
    # Ended once aclose returns: SIGTERM reached the shell (its trap ran) and both sleeps.
    assert running_with(podman, container, marker) == []
    events = await asyncio.wait_for(collect(driver.exec_stream(key, 1, ["cat", f"/tmp/{marker}"])),
                                    WAIT)  # fmt: skip
    assert joined(events, "stdout") == b"term\n"


async def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(
    settings: Settings,
    running: Callable[[], asyncio.Future[str]],
    podman: PodmanClient,
    mode: ExecMode,
) -> None:
    key = await running()
    marker = f"{uuid.uuid4().int % 100_000 + 200_000}"
    # The shell ignores SIGTERM (each short sleep may die of it; the loop goes on).
    script = f'trap "" TERM; echo first; while :; do sleep 1; done # {marker}'
    impatient = PodmanDriver(settings.podman_url, stop_timeout=1, exec_grace=0.5, exec_mode=mode)
    try:
        stream = impatient.exec_stream(key, 1, ["sh", "-c", script])
        assert await asyncio.wait_for(anext(stream), WAIT) == ExecOutput("stdout", b"first\n")
        await asyncio.wait_for(stream.aclose(), WAIT)
    finally:
        await impatient.close()
    assert running_with(podman, container_name(key, 1), marker) == []


@pytest.mark.parametrize("mode", ["api"])
async def test_an_exec_out_of_reach_of_this_pid_namespace_is_not_signalled(
    settings: Settings,
    driver: PodmanDriver,
    running: Callable[[], asyncio.Future[str]],
    podman: PodmanClient,
) -> None:
    """Ending from a process in a PID namespace of its own (as a gateway in a container of
    its own would be): Podman's PID names nothing there, so nothing is signalled. (Podman's
    exec API only: the runtime path needs Podman's PID namespace to run at all.)"""
    key = await running()
    marker = f"{uuid.uuid4().int % 100_000 + 400_000}"
    stream = driver.exec_stream(key, 1, ["sh", "-c", f"echo first; sleep {marker}"])
    assert await asyncio.wait_for(anext(stream), WAIT) == ExecOutput("stdout", b"first\n")
    container = container_name(key, 1)
    (exec_id,) = podman.containers.get(container).attrs["ExecIDs"]
    ending = (f"from drivers.podman_exec_end import end_exec; "
              f"print(end_exec({settings.podman_url!r}, {exec_id!r}, grace=0.5, "
              f"request_timeout={WAIT}))")  # fmt: skip
    elsewhere = await asyncio.create_subprocess_exec(
        "unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", ending,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(elsewhere.communicate(), WAIT)
    assert out.decode().strip() == "unreachable", err.decode()
    assert b"out of reach here" in err and b"not signalled" in err
    assert f"sleep {marker}" in running_with(podman, container, marker)
    await asyncio.wait_for(stream.aclose(), WAIT)  # from here, where Podman's PIDs are
    assert running_with(podman, container, marker) == []


async def test_exec_in_a_missing_or_stopped_runtime_is_a_driver_error(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]]
) -> None:
    with pytest.raises(DriverError):
        await collect(driver.exec_stream(f"exec-none-{uuid.uuid4().hex[:6]}", 1, ["true"]))
    key = await running()
    await driver.stop(key, 1, timeout=1)
    with pytest.raises(DriverError, match="no running runtime"):
        await collect(driver.exec_stream(key, 1, ["true"]))


async def test_sandbox_processes_have_core_dumps_off(
    driver: PodmanDriver, running: Callable[[], asyncio.Future[str]]
) -> None:
    key = await running()
    # The exec'd shell (soft and hard limit) and the main process (PID 1 is the init process).
    script = "ulimit -c; ulimit -Hc; grep 'Max core file size' /proc/1/limits"
    events = await asyncio.wait_for(collect(driver.exec_stream(key, 1, ["sh", "-c", script])), WAIT)
    soft, hard, main = joined(events, "stdout").decode().splitlines()
    assert (soft, hard) == ("0", "0")
    assert main.split()[4:6] == ["0", "0"], main
    assert events[-1] == ExecExit(0)
