"""The Podman driver's exec through runc (drivers/podman_runc.py) on the real Podman service:
the same process as Podman's exec gives (user, groups, capabilities, seccomp, env, cwd), the
deadline ending the command's whole process group, the remembered container never standing in
for a replaced or stopped one, and the hostile side (odd bytes stay data, the process file is
0600 and gone).

Fails (never skips) when the service or the sandbox image is missing (see conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from harness import eventually
from podman import PodmanClient
from podman.domain.containers import Container

from drivers import podman, podman_exec, podman_runc
from drivers.podman import PodmanDriver
from drivers.podman_execs import PodmanExecs
from drivers.podman_objects import container_name
from drivers.podman_runc import RUNC_ROOT, Runc
from drivers.protocol import (
    IDENTITY_ENV,
    DriverError,
    ExecEvent,
    ExecExit,
    ExecOutput,
    LaunchSpec,
)
from events.common import SandboxSpec
from services.common.exec_sessions import ExecTimedOut, within
from services.common.settings import Settings

WAIT = 20.0
# What the process is, seen from inside: identity, privileges, confinement, env, cwd, limits.
IDENTITY = (
    "grep -E '^(Uid|Gid|Groups|Cap|NoNewPrivs|Seccomp)' /proc/self/status; env | sort; pwd; "
    "ulimit -a; cat /proc/self/oom_score_adj; readlink /proc/self/ns/pid; "
    "readlink /proc/self/ns/mnt"
)


@pytest.fixture
def runc(settings: Settings) -> Runc:
    found, why = podman_runc.probe(settings.podman_url, "runtime", RUNC_ROOT, WAIT)
    assert found is not None, why
    return found


@pytest.fixture
async def driver(settings: Settings, podman: PodmanClient) -> AsyncIterator[PodmanDriver]:
    drv = PodmanDriver(settings.podman_url, stop_timeout=1, exec_grace=0.5, exec_mode="runtime")
    yield drv
    await drv.close()


@pytest.fixture
async def launched(driver: PodmanDriver, settings: Settings) -> AsyncIterator[Callable[..., Any]]:
    """Launches a sandbox's generation (a sleeping main process); deletes its keys after."""
    made: set[str] = set()

    async def launch(
        key: str | None = None, generation: int = 1, identity: str = "",
        through: PodmanDriver | None = None,
    ) -> str:  # fmt: skip
        key = key or f"runc-{uuid.uuid4().hex[:10]}"
        made.add(key)
        spec = SandboxSpec(image=settings.sandbox_image, command=["sleep", "3600"])
        launch = LaunchSpec(key, uuid.uuid4(), generation, identity or key, spec)
        await (through or driver).launch(launch)
        return key

    yield launch
    for key in made:
        await driver.delete(key)


@pytest.fixture
def containers(settings: Settings, podman: PodmanClient) -> Any:
    """Plain containers of the sandbox image made with Podman's options; removed after.
    Removing one stops it first, with its stop timeout: ``sleep`` as PID 1 ignores SIGTERM,
    so the default (10 s) was spent in full at every teardown; they are killed at once."""
    made: list[Container] = []

    def run(**options: Any) -> Container:
        container = podman.containers.run(
            settings.sandbox_image, ["sleep", "3600"], detach=True,
            name=f"runc-shape-{uuid.uuid4().hex[:8]}", stop_timeout=0, **options,
        )  # fmt: skip
        assert isinstance(container, Container)
        made.append(container)
        return container

    yield run
    for container in made:
        container.remove(force=True)


async def collect(stream: AsyncIterator[ExecEvent]) -> list[ExecEvent]:
    return [event async for event in stream]


def out(events: list[ExecEvent], stream: str = "stdout") -> str:
    data = b"".join(e.data for e in events if isinstance(e, ExecOutput) and e.stream == stream)
    return data.decode()


@pytest.mark.parametrize(
    "shape",
    [
        {"init": True, "cap_drop": ["ALL"], "read_only": True, "hostname": "confined",
         "environment": {"PATH": "/usr/bin:/bin:/opt"}},
        {"user": "nobody", "group_add": ["10"], "cap_add": ["NET_ADMIN"]},
        {"user": "65534:65534"},
        {},
    ],
    ids=["confined-root", "named-user-group-add", "numeric-user", "plain"],
)  # fmt: skip
async def test_the_runtime_path_runs_exactly_what_podmans_exec_runs(
    settings: Settings, runc: Runc, containers: Any, shape: dict[str, Any]
) -> None:
    """User, groups, capabilities, no_new_privileges, seccomp, namespaces, env (the
    container's, then the exec's: a later entry wins), cwd and limits are those Podman's exec
    gives, for containers of several shapes."""
    container = containers(**shape)
    exec_env = {"EXTRA": "1", "PATH": "/exec/bin:/usr/bin:/bin"}
    command = ["sh", "-c", IDENTITY]
    podmans = await collect(podman_exec.exec_stream(
        settings.podman_url, str(container.id), command, env=exec_env, workdir="/tmp",
    ))  # fmt: skip
    ours = await collect(podman_runc.exec_stream(
        runc, str(container.id), command, env=exec_env, workdir="/tmp",
    ))  # fmt: skip
    assert out(ours) == out(podmans)
    assert (ours[-1], podmans[-1]) == (ExecExit(0), ExecExit(0))
    seen = out(ours)
    assert "EXTRA=1\n" in seen and "PATH=/exec/bin:/usr/bin:/bin\n" in seen and "\n/tmp\n" in seen
    if "user" in shape:
        assert "Uid:\t65534\t65534\t65534\t65534" in seen


async def test_an_exec_runs_as_the_containers_user_with_its_env_and_the_execs(
    runc: Runc, containers: Any
) -> None:
    container = containers(user="nobody", environment={"OWN": "container"}, workdir="/tmp")
    stream = podman_runc.exec_stream(
        runc, str(container.id), ["sh", "-c", 'id -u; echo "$OWN $MINE"; pwd'],
        env={"MINE": "exec"},
    )  # fmt: skip
    events = await asyncio.wait_for(collect(stream), WAIT)
    assert out(events) == "65534\ncontainer exec\n/tmp\n"
    assert events[-1] == ExecExit(0)


async def processes(driver: PodmanDriver, key: str, marker: str) -> list[str]:
    """The container's processes whose command line holds ``marker``, by a second exec
    reading /proc (its own shell left out)."""
    script = ("for d in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null); "
              "[ \"${d#/proc/}\" = $$ ] || echo \"$c\"; done")  # fmt: skip
    events = await asyncio.wait_for(collect(driver.exec_stream(key, 1, ["sh", "-c", script])), WAIT)
    return [line for line in out(events).splitlines() if marker in line]


async def test_a_deadline_ends_the_commands_whole_process_group_inside_the_container(
    driver: PodmanDriver, launched: Callable[..., Any]
) -> None:
    """The deadline (services/common/exec_sessions.py ``within``) ends the command, a child in
    the background and one that ignores SIGTERM (killed after the grace): no process of the
    exec is left, as a second exec reading /proc shows."""
    key = await launched()
    marker = str(uuid.uuid4().int % 100_000 + 500_000)
    script = (f"sleep {marker} & sh -c 'trap \"\" TERM; sleep {marker}; sleep {marker}' & "
              f"echo first; wait")  # fmt: skip
    events = within(driver.exec_stream(key, 1, ["sh", "-c", script]), 5.0)
    seen = await asyncio.wait_for(collect(events), WAIT)
    assert seen[0] == ExecOutput("stdout", b"first\n")
    assert isinstance(seen[-1], ExecTimedOut)
    assert await processes(driver, key, marker) == []


async def test_stdin_reaches_the_command_then_its_end(
    driver: PodmanDriver, launched: Callable[..., Any]
) -> None:
    key = await launched()
    data = bytes(range(256)) * 4096
    events = await asyncio.wait_for(
        collect(driver.exec_stream(key, 1, ["sh", "-c", "wc -c; echo done >&2"], stdin=data)),
        WAIT,
    )
    assert out(events).strip() == str(len(data)) and out(events, "stderr") == "done\n"
    assert events[-1] == ExecExit(0)


def counted(driver: PodmanDriver, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    """The driver's lookups of a container by its name and listings of a key, from now on."""
    lookups: list[object] = []
    listings: list[object] = []
    lookup, listing = podman.running_id, driver._sync.list

    def looked_up(*args: Any) -> Any:
        lookups.append(args)
        return lookup(*args)

    def listed(*args: Any) -> Any:
        listings.append(args)
        return listing(*args)

    monkeypatch.setattr(podman, "running_id", looked_up)
    monkeypatch.setattr(driver._sync, "list", listed)
    return lookups, listings


async def test_an_exec_remembers_the_container_and_never_lists_the_key(
    settings: Settings, launched: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three execs through a driver that did not launch the container (an API process of its
    own): one lookup of the container (by its name), no listing of the key's containers at all
    (the listing read every container of the key on every exec)."""
    key = await launched()
    driver = PodmanDriver(settings.podman_url, stop_timeout=1, exec_mode="runtime")
    try:
        lookups, listings = counted(driver, monkeypatch)
        for _ in range(3):
            events = await asyncio.wait_for(collect(driver.exec_stream(key, 1, ["true"])), WAIT)
            assert events[-1] == ExecExit(0)
        assert (len(lookups), listings) == (1, [])
    finally:
        await driver.close()


async def test_the_first_exec_in_a_container_the_driver_launched_looks_nothing_up(
    driver: PodmanDriver, launched: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver that launched the container (``sandstream up``: the executor's driver is
    the API's) knows it: a claim's first exec in a pool member asks Podman nothing."""
    key = await launched()
    lookups, listings = counted(driver, monkeypatch)
    events = await asyncio.wait_for(collect(driver.exec_stream(key, 1, ["true"])), WAIT)
    assert events[-1] == ExecExit(0)
    assert (lookups, listings) == ([], [])


async def test_a_container_the_watch_saw_running_is_not_looked_up(
    settings: Settings, launched: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver that did not launch the container but watches (``up`` restarted beside pool
    members launched before): the watch's listing tells it the running container."""
    key = await launched()
    driver = PodmanDriver(settings.podman_url, stop_timeout=1, exec_mode="runtime")

    async def watch() -> None:
        async for _ in driver.watch():
            pass

    watching = asyncio.create_task(watch())
    try:
        await eventually(lambda: (key, 1) in driver.execs.ids, bool, WAIT, what="the listing")
        lookups, listings = counted(driver, monkeypatch)
        events = await asyncio.wait_for(collect(driver.exec_stream(key, 1, ["true"])), WAIT)
        assert events[-1] == ExecExit(0)
        assert (lookups, listings) == ([], [])
    finally:
        watching.cancel()
        await driver.close()


@pytest.mark.parametrize("launcher", ["another driver", "the exec's driver"])
@pytest.mark.parametrize("mode", ["runtime", "api"])
async def test_a_generation_replaced_under_a_remembered_container_gets_the_new_one(
    settings: Settings, launched: Callable[..., Any], mode: str, launcher: str
) -> None:
    """The remembered container of (key, generation) is replaced (a launch of another
    identity removes it and creates a new one): the next exec runs in the new container,
    never the old; once the next generation replaces it, generation 1 has none. Whether the
    container was remembered at an exec (another driver launched it) or at its launch (the
    exec's own driver launched every one)."""
    driver = PodmanDriver(settings.podman_url, stop_timeout=1, exec_mode=mode)  # type: ignore[arg-type]
    through = driver if launcher == "the exec's driver" else None
    try:
        key = await launched(identity="first", through=through)
        echo = ["sh", "-c", f"echo ${IDENTITY_ENV}"]
        assert out(await collect(driver.exec_stream(key, 1, echo))) == "first\n"
        remembered = driver.execs.ids[(key, 1)]
        await launched(key, identity="second", through=through)
        assert out(await collect(driver.exec_stream(key, 1, echo))) == "second\n"
        assert driver.execs.ids[(key, 1)] != remembered
        await launched(key, generation=2, identity="third", through=through)
        assert out(await collect(driver.exec_stream(key, 2, echo))) == "third\n"
        # The next generation's launch removed the one remembered for generation 1.
        with pytest.raises(DriverError, match="no running runtime"):
            await collect(driver.exec_stream(key, 1, echo))
    finally:
        await driver.close()


@pytest.mark.parametrize("mode", ["runtime", "api"])
async def test_a_remembered_container_stopped_or_restarted_answers_as_today(
    settings: Settings, podman: PodmanClient, launched: Callable[..., Any], mode: str
) -> None:
    """Stopped: "no running runtime" (as without a remembered container); started again
    (the same container): the exec runs in it."""
    driver = PodmanDriver(settings.podman_url, stop_timeout=1, exec_mode=mode)  # type: ignore[arg-type]
    try:
        key = await launched()
        assert (await collect(driver.exec_stream(key, 1, ["true"])))[-1] == ExecExit(0)
        await driver.stop(key, 1, timeout=1)
        with pytest.raises(DriverError, match="no running runtime"):
            await collect(driver.exec_stream(key, 1, ["true"]))
        podman.containers.get(container_name(key, 1)).start()
        events = await collect(driver.exec_stream(key, 1, ["cat", "/proc/1/cmdline"]))
        assert events[-1] == ExecExit(0)
    finally:
        await driver.close()


ODD = [
    "$(touch {host})", "`touch {host}`", "; touch {host}", "a\nb", "'\"\\", "*", " ",
    "\x01\x7f", "é ✓", "-e", "--", "|| touch {host}",
]  # fmt: skip


async def test_odd_bytes_in_argv_and_env_stay_data_and_never_reach_a_host_shell(
    driver: PodmanDriver, launched: Callable[..., Any], tmp_path: Path
) -> None:
    key = await launched()
    host = tmp_path / "touched"
    args = [arg.format(host=host) for arg in ODD]
    events = await collect(driver.exec_stream(key, 1, ["printf", "%s\\0", *args]))
    assert out(events).split("\0")[:-1] == args
    env = {f"ODD{i}": arg for i, arg in enumerate(args)}
    script = "printf '%s\\0' " + " ".join(f'"$ODD{i}"' for i in range(len(args)))
    events = await collect(driver.exec_stream(key, 1, ["sh", "-c", script], env=env))
    assert out(events).split("\0")[:-1] == args
    assert not host.exists()


async def test_the_process_file_is_private_and_gone_once_the_command_runs(
    driver: PodmanDriver, launched: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = await launched()
    written: list[tuple[Path, int, int]] = []
    write = podman_runc.write_private

    def watched(directory: Path, name: str, data: bytes) -> Path:
        path = write(directory, name, data)
        written.append((path, os.stat(path).st_mode, os.stat(directory).st_mode))
        return path

    monkeypatch.setattr(podman_runc, "write_private", watched)
    stream = driver.exec_stream(key, 1, ["sh", "-c", "echo first; sleep 600"], env={"S": "v"})
    assert await asyncio.wait_for(anext(stream), WAIT) == ExecOutput("stdout", b"first\n")
    ((path, mode, dir_mode),) = written
    assert (stat.S_IMODE(mode), stat.S_IMODE(dir_mode)) == (0o600, 0o700)
    assert not path.exists()  # gone while the command still runs
    await asyncio.wait_for(stream.aclose(), WAIT)
    assert not path.parent.exists()


def descriptors() -> set[tuple[str, str]]:
    """This process's open descriptors with what each is (a pipe's inode tells two apart)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:  # the listing's own, closed since
            continue
    return found


async def test_concurrent_execs_each_get_their_own_output_and_leave_nothing_behind(
    runc: Runc, containers: Any
) -> None:
    """30 execs at once in one container: each its own output and exit code; afterwards no
    descriptor, thread or process file of theirs is left in this process."""
    container = containers()
    before = descriptors()

    async def one(i: int) -> list[ExecEvent]:
        script = f"echo {i}; echo e{i} >&2; exit {i % 7}"
        return await collect(podman_runc.exec_stream(runc, str(container.id), ["sh", "-c", script]))

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(30))), WAIT * 3)
    for i, events in enumerate(results):
        assert (out(events), out(events, "stderr")) == (f"{i}\n", f"e{i}\n")
        assert events[-1] == ExecExit(i % 7)

    def left() -> tuple[list[tuple[str, str]], list[str]]:
        threads = [t.name for t in threading.enumerate() if t.name.startswith("runc-exec")]
        return sorted(descriptors() - before), threads  # an earlier test's may close meanwhile

    await eventually(left, lambda now: now == ([], []), timeout=WAIT,
                     what="the execs' descriptors and threads gone")  # fmt: skip


def children(state: str = "") -> list[tuple[int, str]]:
    """This process's children now (PID, command line), only those in ``state`` if given."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = dict(
                line.split(":\t", 1) for line in (entry / "status").read_text().splitlines()
            )
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue  # not a process, or gone
        if int(status["PPid"]) == os.getpid() and status["State"].startswith(state):
            found.append((int(entry.name), command))
    return found


async def test_the_command_is_this_process_child_once_runc_has_left_it(
    runc: Runc, containers: Any
) -> None:
    """runc exits once it has started the command (``--detach``); the command, in the
    container's PID namespace, is then this process's child (its subreaper), which reaps it."""
    container = containers()
    marker = str(uuid.uuid4().int % 100_000 + 700_000)
    stream = podman_runc.exec_stream(
        runc, str(container.id), ["sh", "-c", f"echo first; sleep {marker}; exit 3"]
    )
    assert await asyncio.wait_for(anext(stream), WAIT) == ExecOutput("stdout", b"first\n")
    ours = [command for _, command in children() if f"sleep {marker}" in command]
    assert ours == [f"sh -c echo first; sleep {marker}; exit 3 "]
    assert not [command for _, command in children() if "runc" in command]  # runc has gone
    await asyncio.wait_for(stream.aclose(), WAIT)
    assert not [command for _, command in children() if marker in command]


async def test_many_execs_leave_no_zombie_child_of_this_process(
    runc: Runc, containers: Any
) -> None:
    """Exits, failures to start, input, background children holding the output, deadlines:
    every command and every runc is reaped."""
    container = containers()
    scripts = [
        "exit 4",
        "sleep 600 & echo started",
        "read line; echo $line",
        "trap '' TERM; echo first; sleep 600",
    ]

    async def one(i: int) -> list[ExecEvent | ExecTimedOut]:
        command = ["no-such-program"] if i % 5 == 4 else ["sh", "-c", scripts[i % 5]]
        events = podman_runc.exec_stream(
            runc, str(container.id), command, stdin=b"hello\n", grace=0.2
        )
        return [event async for event in within(events, 10.0)]

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), WAIT * 3)
    for i, events in enumerate(results):
        last = events[-1]
        assert last == [ExecExit(4), ExecExit(0), ExecExit(0), last, ExecExit(127)][i % 5]
        if i % 5 == 3:
            assert isinstance(last, ExecTimedOut)
    await eventually(children, lambda now: now == [], timeout=WAIT,
                     what="no child (zombie or not) of this process left")  # fmt: skip
    assert children("Z") == []


def test_a_process_with_children_of_its_own_keeps_podmans_exec(settings: Settings) -> None:
    """As their subreaper, this process would adopt the orphans of every child it has (a
    stack it started: Podman's conmons), zombies nobody reaps: the runtime path is refused
    while it has a child that is not an exec's."""
    child = subprocess.Popen(["sleep", "600"])
    try:
        found, why = podman_runc.probe(settings.podman_url, "runtime", RUNC_ROOT, WAIT)
        assert found is None and f"child processes of its own (PIDs [{child.pid}]: sleep)" in why
    finally:
        child.kill()
        child.wait()
    found, why = podman_runc.probe(settings.podman_url, "runtime", RUNC_ROOT, WAIT)
    assert found is not None, why


async def test_a_zombie_child_is_no_reason_to_keep_podmans_exec_and_is_left_to_its_owner(
    settings: Settings,
) -> None:
    """A child that has exited but is not yet reaped (a test before, a Popen not yet waited
    for) can hand no orphan on: the runtime path is taken, and the child's exit stays its
    owner's to read."""
    child = subprocess.Popen(["sh", "-c", "exit 7"])  # noqa: ASYNC220 (a plain child, as a test's)
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        await eventually(lambda: stat.read_text().rsplit(")", 1)[1].split()[0],
                         lambda state: state == "Z", timeout=WAIT, what="its exit")  # fmt: skip
        found, why = podman_runc.probe(settings.podman_url, "runtime", RUNC_ROOT, WAIT)
        assert found is not None, why
    finally:
        assert child.wait() == 7


async def test_a_late_running_event_never_replaces_the_container_a_launch_remembered() -> None:
    """The watch's word comes after the launch's: a running event of the container the launch
    replaced (read late) leaves the new one remembered; its removal forgets only itself."""

    async def never(key: str, generation: int) -> str:
        raise AssertionError("no lookup expected")

    execs = PodmanExecs("unix:///nowhere", mode="api", runc_root=RUNC_ROOT, request_timeout=1,
                        grace=1, running=never)  # fmt: skip
    execs.seen_running("k", 1, "old")
    assert execs.ids[("k", 1)] == "old"
    execs.remember("k", 1, "new")  # the launch that replaced it
    execs.seen_running("k", 1, "old")  # its event, read late
    execs.forget("k", 1, "old")  # its removal
    assert execs.ids == {("k", 1): "new"}
    execs.seen_running("k", 2, "other")  # another generation: its own entry
    execs.forget("k", 1, "new")
    assert dict(execs.ids) == {("k", 2): "other"}
