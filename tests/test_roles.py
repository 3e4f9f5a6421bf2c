"""The roles as separate processes (`sandstream processor|executor|watcher|scheduler|api|
provider-sync`) on the real stack: real subprocesses, real Kafka, PostgreSQL and Podman, talking
to each other only through them; each reports itself through its own health endpoint."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from harness import eventually, isolated_env
from pg_goodbye import behind_holding_proxy, say_goodbye
from pipeline_support import PodmanKeys, containers_of, history
from podman import PodmanClient
from role_processes import all_ready, assigned_metric, one_active, roles_env, shared_out

from services.common.entrypoint import EXIT_START_FAILED, EXIT_STOPPED
from services.common.settings import PROJECT_ROOT
from services.common.tokens import ensure_tokens

SLEEP = ["sh", "-c", "exec sleep 3600"]


@pytest.fixture
def keys(podman: PodmanClient) -> Iterator[PodmanKeys]:
    made = PodmanKeys(podman, "roles")
    yield made
    made.cleanup()


async def test_split_roles_share_partitions_and_survive_a_killed_processor(
    tmp_path: Path, podman: PodmanClient, keys: PodmanKeys
) -> None:
    """Two processors, two executors (Podman), a watcher, a scheduler and the API, each its own
    process: the consumer groups share the partitions out (readiness and metrics say so),
    sandboxes created through the API reach Ready with one launch each; after a SIGKILL of one
    processor the other takes all the partitions and every accepted create still reaches
    Ready; SIGTERM stops the others cleanly (exit 0)."""
    async with roles_env(tmp_path, partitions=4) as roles:
        prepared = await asyncio.to_thread(roles.run, "prepare")
        assert prepared.returncode == 0, prepared.stderr
        processors = [roles.start("processor"), roles.start("processor", "run")]
        executors = [roles.start("executor"), roles.start("executor")]
        watcher = roles.start("watcher")
        scheduler = roles.start("scheduler")
        api = roles.start("api", "--port", "0")

        for p in [*processors, *executors, watcher, scheduler, api]:
            await p.ready()
        await eventually(lambda: all_ready(processors), lambda b: shared_out(b, 4),
                         timeout=60, what="the processors sharing 4 partitions")  # fmt: skip
        await eventually(lambda: all_ready(executors), lambda b: shared_out(b, 4),
                         timeout=60, what="the executors sharing 4 partitions")  # fmt: skip
        assert (await watcher.readiness())["active"] is True
        assert (await scheduler.readiness())["active"] is True
        for p in processors:
            owned = (await p.readiness())["partitions"]
            assert await assigned_metric(p, "processor") == len(owned)

        url = (await api.readiness())["url"]
        token = (tmp_path / "admin.token").read_text().strip()
        image = roles.env.settings.sandbox_image
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as client:

            async def create(name: str) -> None:
                body = {"name": name, "spec": {"image": image, "command": SLEEP}}
                r = await client.post("/v1/sandboxes", json=body)
                assert r.status_code in (201, 202), r.text

            async def phases(names: list[str]) -> dict[str, str]:
                rows = await roles.env.fetch(
                    "SELECT key, phase FROM sandboxes WHERE key = ANY($1)", names
                )
                return {r["key"]: r["phase"] for r in rows}

            first = [keys() for _ in range(4)]
            for name in first:
                await create(name)
            await eventually(lambda: phases(first), lambda f: list(f.values()) == ["Ready"] * 4,
                             timeout=90, what="the first sandboxes Ready")  # fmt: skip

            # One processor dies without leaving the group: the other takes its partitions.
            processors[0].kill()
            second = [keys() for _ in range(4)]
            for name in second:
                await create(name)
            await eventually(processors[1].readiness,
                             lambda b: b.get("partitions") == [0, 1, 2, 3],
                             timeout=60, what="the survivor owning every partition")  # fmt: skip
            everything = first + second
            await eventually(lambda: phases(everything),
                             lambda f: sorted(f.values()) == ["Ready"] * 8,
                             timeout=90, what="every sandbox Ready")  # fmt: skip

        # No executor acted twice on one intent: one launch result and one container each.
        for name in everything:
            results = [h for h in await history(roles.env, name)
                       if h["message_type"] == "DriverOperationResult"]  # fmt: skip
            assert len(results) == 1, (name, results)
            assert len(containers_of(podman, name)) == 1, name
        survivors = [processors[1], *executors, watcher, scheduler, api]
        for p in survivors:
            p.proc.send_signal(signal.SIGTERM)  # all at once; each drains on its own
        codes = {p.name: p.exit_code() for p in survivors}
        assert set(codes.values()) == {EXIT_STOPPED}, (codes, roles.logs())


async def test_one_watcher_is_active_and_another_takes_over_when_it_dies(
    tmp_path: Path,
) -> None:
    """Two watchers: one holds the lease and is active, the other stands by (both ready);
    after a SIGKILL of the active one the standby takes the lease over."""
    async with roles_env(tmp_path) as roles:
        watchers = [roles.start("watcher"), roles.start("watcher")]
        bodies = await eventually(lambda: all_ready(watchers),
                                  lambda b: all(x.get("status") == "ready" for x in b),
                                  timeout=60, what="both watchers ready")  # fmt: skip
        bodies = await eventually(lambda: all_ready(watchers),
                                  one_active,
                                  timeout=30, what="exactly one watcher active")  # fmt: skip
        active = watchers[0] if bodies[0]["active"] else watchers[1]
        standby = watchers[1] if active is watchers[0] else watchers[0]
        active.kill()
        # PostgreSQL releases a dead holder's lock with its session; the standby tries every
        # lease_check_seconds (0.5 here).
        taken = await eventually(standby.readiness, lambda b: b.get("active") is True,
                                 timeout=15, what="the standby taking the lease over")  # fmt: skip
        assert taken["acquisitions"] == 1 and taken["status"] == "ready"
        metrics = await standby.get("/metrics")
        assert metrics is not None
        assert 'sandstream_lease_held{lease="watcher"} 1.0' in metrics.text
        assert standby.terminate() == EXIT_STOPPED, roles.logs()


async def test_executor_processes_with_the_fake_driver_share_and_hand_over_on_sigterm(
    tmp_path: Path,
) -> None:
    """SANDSTREAM_DRIVER=fake runs executors on the in-memory fake (for runs where the backend
    does not matter): two of them share the partitions and launch what the processor
    decides; one stopped by SIGTERM exits 0 and leaves the group, so the other owns every
    partition well before the session timeout (30 s here) would have given them to it, and
    launches what comes next."""
    import factories as f
    from pipeline_support import command

    async def ready(names: list[str]) -> list[Any]:
        return await eventually(
            lambda: roles.env.fetch("SELECT phase FROM sandboxes WHERE key = ANY($1)", names),
            lambda found: [r["phase"] for r in found] == ["Ready"] * len(names),
            timeout=60, what=f"{names} Ready",
        )  # fmt: skip

    async with roles_env(tmp_path) as roles, await roles.env.publisher() as pub:
        await roles.env.start_processor()
        fake = {"SANDSTREAM_DRIVER": "fake", "SANDSTREAM_KAFKA_SESSION_TIMEOUT_MS": "30000"}
        executors = [roles.start("executor", env=fake), roles.start("executor", env=fake)]
        await eventually(lambda: all_ready(executors), lambda b: shared_out(b, 4),
                         timeout=60, what="the executors sharing 4 partitions")  # fmt: skip
        first = [f"fake-{i}" for i in range(6)]
        for name in first:
            await command(roles.env, pub, f.create(name))
        await ready(first)

        assert executors[0].terminate() == EXIT_STOPPED, roles.logs()
        await eventually(executors[1].readiness, lambda b: b.get("partitions") == [0, 1, 2, 3],
                         timeout=20, what="the survivor owning every partition")  # fmt: skip
        second = [f"fake-{i}" for i in range(6, 10)]
        for name in second:
            await command(roles.env, pub, f.create(name))
        await ready(second)
        assert executors[1].terminate() == EXIT_STOPPED, roles.logs()


async def test_provider_sync_processes_one_active_keeps_providers_in_step(
    tmp_path: Path,
) -> None:
    """Two `provider-sync` processes on one directory: one holds the lease and creates the
    provider the directory holds, the other stands by. A value file that is not UTF-8 is
    reported (its file named in the log) and no value stored for it; the process goes on."""
    import base64
    import secrets

    secrets_dir = tmp_path / "providers"
    (secrets_dir / "gh").mkdir(parents=True)
    (secrets_dir / "gh" / "TOKEN").write_text("one")
    (secrets_dir / "gh" / "BROKEN").write_bytes(b"\xff\xfe")
    key = {"SANDSTREAM_CREDENTIALS_KEY": base64.b64encode(secrets.token_bytes(32)).decode()}
    async with roles_env(tmp_path) as roles:
        syncs = [roles.start("provider-sync", "--dir", str(secrets_dir), env=key)
                 for _ in range(2)]  # fmt: skip
        await eventually(lambda: all_ready(syncs),
                         one_active,
                         timeout=60, what="one provider-sync active, one standby")  # fmt: skip
        await eventually(lambda: roles.env.fetch("SELECT name FROM providers"),
                         lambda rows: [r["name"] for r in rows] == ["gh"],
                         what="the provider created from the directory")  # fmt: skip
        keys = await roles.env.fetch("SELECT key FROM provider_credentials")
        assert [r["key"] for r in keys] == ["TOKEN"]
        assert "keeping the stored value of gh/BROKEN" in roles.logs()
        for s in syncs:
            s.proc.send_signal(signal.SIGTERM)
        assert [s.exit_code() for s in syncs] == [EXIT_STOPPED] * 2, roles.logs()


@pytest.mark.parametrize(
    ("role", "variables", "why"),
    [
        ("processor", {"SANDSTREAM_KAFKA_BOOTSTRAP": "127.0.0.1:1"}, "KafkaConnectionError"),
        ("watcher", {"SANDSTREAM_DRIVER": "fake"}, "Run no watcher with SANDSTREAM_DRIVER=fake"),
    ],
    ids=["processor-without-kafka", "watcher-with-the-fake-driver"],
)
async def test_a_role_that_cannot_start_exits_3_saying_why(
    tmp_path: Path, role: str, variables: dict[str, str], why: str
) -> None:
    """A processor pointed at a port where no broker listens, and a watcher asked to watch
    the in-memory fake driver (another process's memory), each serve their health endpoint,
    then exit 3, the code for a role that could not start, naming the cause."""
    async with roles_env(tmp_path) as roles:
        port_file = tmp_path / f"{role}.port"
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "services.cli", role, "--port-file", str(port_file)],
            cwd=PROJECT_ROOT, env={**roles.variables(), **variables}, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == EXIT_START_FAILED, proc.stderr
        assert f"{role} failed at start" in proc.stderr and why in proc.stderr, proc.stderr
        assert "health endpoint http://127.0.0.1:" in proc.stderr
        assert not port_file.exists()  # removed on the way out


def layout_commands() -> list[list[str]]:
    """The sandstream commands of compose/Procfile and compose/docker-compose.yml."""
    import re
    import shlex

    import yaml

    procfile = (PROJECT_ROOT / "compose" / "Procfile").read_text().splitlines()
    commands = [
        shlex.split(line.split(":", 1)[1].replace("$PORT", "9100"))
        for line in procfile
        if line.strip() and not line.startswith("#")
    ]
    compose = yaml.safe_load((PROJECT_ROOT / "compose" / "docker-compose.yml").read_text())
    # the image's entry point is `sandstream`; ${VAR:-default} as compose expands it unset
    commands += [
        ["sandstream", *(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in s["command"])]
        for s in compose["services"].values()
        if "command" in s
    ]
    return commands


def test_the_process_layouts_name_commands_the_cli_has() -> None:
    """Every line of the Procfile and every role service of the compose file is a sandstream
    command, with options it knows (an unknown option fails even with --help)."""
    from typer.testing import CliRunner

    from services.cli.main import app

    commands = layout_commands()
    roles = {c[1] for c in commands}
    assert roles == {"prepare", "processor", "executor", "watcher", "scheduler", "api"}
    for command in commands:
        assert command[0] == "sandstream", command
        result = CliRunner().invoke(app, [*command[1:], "--help"])
        assert result.exit_code == 0, (command, result.output)


async def test_a_lease_holder_whose_session_ends_stops_its_work_and_one_holder_follows() -> None:
    """Two instances of one lease in this process: one works, one waits. When PostgreSQL ends
    the holder's session, the holder's work is stopped, and the lease is held again, by one
    of them, whose work runs."""
    from services.common.lease import Lease

    async with isolated_env(lease_check_seconds=0.2) as env:
        leases = [Lease(env.settings, "test"), Lease(env.settings, "test")]
        working: dict[int, asyncio.Event] = {}
        ended: list[int] = []

        def work(i: int) -> Any:
            async def run(lost: asyncio.Event) -> None:
                working[i] = lost
                await lost.wait()
                ended.append(i)

            return run

        def holding() -> list[tuple[bool, bool]]:
            """Each lease: held, and its work running (the work starts just after the lease
            says held: a CI run read the two in between)."""
            return [(x.held, i in working and not working[i].is_set())
                    for i, x in enumerate(leases)]  # fmt: skip

        def one_working(state: list[tuple[bool, bool]]) -> bool:
            return sorted(h for h, _ in state) == [False, True] and all(w for h, w in state if h)

        stop = asyncio.Event()
        tasks = [asyncio.create_task(lease.run(stop, work(i))) for i, lease in enumerate(leases)]
        try:
            await eventually(holding, one_working, what="one holder, its work running")
            holder = 0 if leases[0].held else 1
            assert list(working) == [holder]
            conn = leases[holder]._conn
            assert conn is not None
            await env.pool.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())
            await eventually(lambda: ended, lambda e: e == [holder], what="the holder's work ended")
            await eventually(holding, one_working, what="one holder again, its work running")
            assert sum(x.acquisitions for x in leases) == 2
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert all(event.is_set() for event in working.values())  # every work was stopped


async def test_a_lease_holder_hearing_postgresql_s_goodbye_before_the_close_takes_it_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found with the chaos checker's PostgreSQL restart: the holder's check met a session that
    had the server's goodbye but not yet its close (asyncpg's InternalClientError, not one of
    the errors the check expected), and the lease's loop died with it. It is a lost lease."""
    from services.common.lease import Lease

    caplog.set_level(logging.INFO, logger="sandstream.lease")
    async with (
        isolated_env(lease_check_seconds=0.2) as env,
        behind_holding_proxy(env.settings) as (settings, proxy),
    ):
        lease = Lease(settings, "test")
        runs: list[asyncio.Event] = []

        async def work(lost: asyncio.Event) -> None:
            runs.append(lost)
            await lost.wait()

        stop = asyncio.Event()
        task = asyncio.create_task(lease.run(stop, work))
        try:
            await eventually(lambda: runs, lambda r: len(r) == 1, what="the lease taken")
            assert lease._conn is not None
            await say_goodbye(env, proxy, [lease._conn.get_server_pid()])
            await eventually(lambda: runs, lambda r: len(r) == 2, what="the lease taken again")
            assert runs[0].is_set() and not runs[1].is_set()
            assert "lease test lost (InternalClientError(" in caplog.text
            assert not task.done()
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=30)


async def test_a_lease_holder_whose_work_fails_on_postgresql_gives_the_lease_up_and_takes_it_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found with the chaos checker's PostgreSQL restart: the watcher's work opens its own
    connections when it starts, and a restart could fail them before the lease's own check
    saw anything. The work ended by itself, and the lease re-raised its error: the process
    exited 1. A work that fails on PostgreSQL's trouble is a lost lease, taken again."""
    import asyncpg

    from services.common.lease import Lease

    caplog.set_level(logging.INFO, logger="sandstream.lease")
    async with isolated_env(lease_check_seconds=0.2) as env:
        lease = Lease(env.settings, "test")
        sessions: asyncio.Queue[int] = asyncio.Queue()
        runs: list[asyncio.Event] = []

        async def work(lost: asyncio.Event) -> None:
            runs.append(lost)
            if len(runs) > 1:  # taken again: runs until stopped
                await sessions.put(0)
                await lost.wait()
                return
            conn = await asyncpg.connect(env.settings.pg_dsn)
            try:
                await sessions.put(conn.get_server_pid())
                await conn.fetchval("SELECT pg_sleep(60)")  # ends when the session does
            finally:
                conn.terminate()

        stop = asyncio.Event()
        task = asyncio.create_task(lease.run(stop, work))
        try:
            first = await asyncio.wait_for(sessions.get(), timeout=30)
            # Only the work's session ends: the lease's own check still passes.
            await env.pool.execute("SELECT pg_terminate_backend($1)", first)
            await asyncio.wait_for(sessions.get(), timeout=30)  # the work runs again
            assert not task.done()
            assert len(runs) == 2 and runs[0].is_set() and not runs[1].is_set()
            assert lease.acquisitions == 2
            assert "lease test given up: its work failed on PostgreSQL" in caplog.text
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=30)


async def test_a_lease_holder_whose_work_fails_otherwise_raises_the_error() -> None:
    """Any other failure of the work is a crash: ``Lease.run`` raises it (the role's process
    then exits 1, for its supervisor to restart it)."""
    from services.common.lease import Lease

    async with isolated_env(lease_check_seconds=0.2) as env:

        async def work(lost: asyncio.Event) -> None:
            raise ValueError("the work's own bug")

        with pytest.raises(ValueError, match="the work's own bug"):
            await asyncio.wait_for(Lease(env.settings, "test").run(asyncio.Event(), work), 30)


async def test_the_openshell_role_alone_takes_its_publish_timeout_and_size_limit_from_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Run alone, the OpenShell role built its gateway with the default 15 s publish timeout,
    whatever SANDSTREAM_API_PUBLISH_TIMEOUT_SECONDS said (the API and provider-sync read it).
    Every role now builds its gateway from its settings in one place."""
    from services.openshell import server

    built: list[Any] = []
    stop = asyncio.Event()

    async def started(settings: Any, **parts: Any) -> Any:  # stands in for the gRPC server
        built.append(parts["gateway"])
        stop.set()

        async def no_server() -> None:
            return None

        return SimpleNamespace(address="-", stop=no_server)

    monkeypatch.setattr(server, "start_openshell", started)
    async with isolated_env(
        partitions=1,
        api_publish_timeout_seconds=2.5,
        processor_max_input_bytes=500_000,
        run_dir=tmp_path,  # a tokens file of its own (a fresh clone has none yet)
    ) as env:
        ensure_tokens(env.settings)
        await asyncio.wait_for(server.serve(env.settings, stop), 60)
    [gateway] = built
    assert (gateway.publish_timeout, gateway.max_bytes) == (2.5, 500_000)
