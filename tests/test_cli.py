"""The `sandstream` command against a real `sandstream up`: the README session and more.

`sandstream up` runs as a subprocess (the real console script) with this module's own topics,
schema, run directory (tokens, pid file) and an ephemeral API port, so the whole pipeline runs
with the real Podman driver. Every CLI call is a subprocess too, exactly as a person types it.
"""

from __future__ import annotations

import asyncio
import json
import re
import stat
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import pytest_asyncio
from harness import eventually
from upkit import SANDSTREAM, Up, running_up

from services.cli.client import EXIT_FAILED, CliError
from services.cli.sandbox import _submit
from services.common.settings import PROJECT_ROOT, load_settings
from services.common.tokens import SCOPES
from services.executor.backends import podman_driver

IMAGE = load_settings().sandbox_image


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    async with running_up(tmp_path_factory.mktemp("run")) as running:
        yield running


def lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


async def test_up_prints_where_the_api_and_the_token_are(up: Up) -> None:
    assert "sandstream is up" in up.banner
    assert f"API         {up.url}" in up.banner
    admin = up.run_dir / "admin.token"
    tokens = up.run_dir / "tokens.json"
    assert f"token       {admin}  (new admin token)" in up.banner
    assert f"tokens      {tokens}" in up.banner
    for path in (admin, tokens):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    value = admin.read_text().strip()
    stored = tokens.read_text()
    assert value not in stored  # only its hash
    assert json.loads(stored)["tokens"][0]["scopes"] == sorted(SCOPES)


async def test_the_readme_session(up: Up) -> None:
    name = up.name("readme")
    r = await up.cli("sandbox", "create", name, "--image", IMAGE, "--label", "team=research",
                     "--", "sleep", "3600")  # fmt: skip
    assert (r.code, lines(r.out)) == (0, [f"✓ Created sandbox {name} (generation 1)"]), r.err

    r = await up.cli("sandbox", "list")
    assert r.code == 0
    table = lines(r.out)
    assert table[0].split() == ["NAME", "PHASE", "GENERATION", "AGE"]
    assert [row.split()[:3] for row in table[1:]] == [[name, "Ready", "1"]]

    r = await up.cli("sandbox", "list", "-o", "json", "--label", "team=research")
    listed = json.loads(r.out)
    assert [(s["name"], s["phase"], s["labels"]) for s in listed] == [
        (name, "Ready", {"team": "research"})
    ]

    r = await up.cli("sandbox", "get", name)
    assert r.code == 0
    assert ["Phase", "Ready"] in [row.split() for row in lines(r.out)]
    assert "Command     sleep 3600" in r.out

    r = await up.cli("sandbox", "stop", name)
    assert (r.code, lines(r.out)) == (0, [f"✓ Stopped sandbox {name} (generation 1)"]), r.err
    r = await up.cli("sandbox", "start", name)
    assert (r.code, lines(r.out)) == (0, [f"✓ Started sandbox {name} (generation 2)"]), r.err

    r = await up.cli("sandbox", "history", name)
    assert r.code == 0
    table = lines(r.out)
    assert table[0].split() == ["TIME", "INPUT", "BY", "RESULT", "PHASE", "GEN", "VER", "REASON"]
    assert any(re.search(r"^\S+\s+Stop\s+admin\s+applied\s+Stopping\s+1\s+3\s", row)
               for row in table), r.out  # fmt: skip
    assert any(" ignored " in row and "no effect in phase" in row for row in table)
    r = await up.cli("sandbox", "history", name, "-o", "json")
    history = json.loads(r.out)
    applied = [h for h in history if h["disposition"] == "applied"]
    # (Whether the executor's result or the watcher's snapshot moved the row is a race.)
    assert [h["phase"] for h in applied] == [
        "Provisioning", "Ready", "Stopping", "Stopped", "Starting", "Ready",
    ]  # fmt: skip
    assert [h["message_type"] for h in applied][0::2] == [
        "CreateSandbox", "StopSandbox", "StartSandbox",
    ]  # fmt: skip

    r = await up.cli("sandbox", "delete", name)
    assert (r.code, lines(r.out)) == (0, [f"✓ Deleted sandbox {name}"]), r.err
    r = await up.cli("sandbox", "list", "-o", "json")
    assert name not in [s["name"] for s in json.loads(r.out)]
    r = await up.cli("sandbox", "get", name)
    assert (r.code, r.err.strip()) == (1, f"✗ sandbox {name!r} not found")


async def test_rejections_and_failures_exit_non_zero_with_the_reason(up: Up) -> None:
    ghost = up.name("ghost")
    r = await up.cli("sandbox", "stop", ghost)
    assert r.code == 1
    assert r.err.strip() == f"✗ rejected: sandbox {ghost!r} not found (NOT_FOUND)"

    r = await up.cli("sandbox", "create", "Not_A_Name", "--image", IMAGE)
    assert r.code == 1 and "✗ field 'name': must be a DNS label" in r.err

    r = await up.cli("sandbox", "create", "x", "--image", IMAGE, "--label", "novalue")
    assert r.code == 2 and "expected --label as KEY=VALUE" in r.err

    broken = up.name("broken")
    r = await up.cli("sandbox", "create", broken, "--image", "localhost/no-such-image:1")
    assert r.code == 1
    assert r.err.startswith(f"✗ sandbox {broken} is Error: ") and "(generation 1)" in r.err

    r = await up.cli("sandbox", "create", broken, "--image", IMAGE)
    assert r.code == 1 and "(ALREADY_EXISTS)" in r.err and "phase: Error" in r.err

    r = await up.cli("sandbox", "stop", broken, "--expected-version", "1")
    assert r.code == 1 and "(ABORTED)" in r.err
    r = await up.cli("sandbox", "delete", broken, "-o", "json")
    assert r.code == 0 and json.loads(r.out)["phase"] == "Deleted"


async def test_a_wait_that_runs_out_exits_3_and_a_repeat_stop_waits_again(up: Up) -> None:
    name = up.name("stubborn")
    # The shell ignores SIGTERM: the stop takes the whole stop timeout, then SIGKILL.
    r = await up.cli("sandbox", "create", name, "--image", IMAGE, "--stop-timeout", "2", "--",
                     "sh", "-c", "trap '' TERM; touch /tmp/trapped; "
                     "while true; do sleep 1; done")  # fmt: skip
    assert r.code == 0, r.err
    driver = podman_driver(load_settings())
    try:  # only once the trap is set is a stop slow
        await eventually(lambda: driver.exec(name, 1, ["test", "-f", "/tmp/trapped"]),
                         lambda result: result[0] == 0, what="the trap")  # fmt: skip
    finally:
        await driver.close()
    r = await up.cli("sandbox", "stop", name, "--timeout", "0.5")
    assert r.code == 3
    assert f"✗ timed out waiting for sandbox {name} to be Stopped" in r.err
    r = await up.cli("sandbox", "stop", name, "-o", "json")  # idempotent: waits for Stopped
    assert r.code == 0, r.err
    assert json.loads(r.out)["phase"] == "Stopped"
    r = await up.cli("sandbox", "restart", name, "--no-wait")
    assert r.code == 0 and "RestartSandbox accepted" in r.out
    r = await up.cli("sandbox", "delete", name)
    assert r.code == 0, r.err


async def test_exec_streams_the_output_and_exits_with_the_commands_code(up: Up) -> None:
    name = up.name("exec")
    r = await up.cli("sandbox", "create", name, "--image", IMAGE, "--", "sleep", "3600")
    assert r.code == 0, r.err
    r = await up.cli("sandbox", "exec", name, "--env", "WHO=cli", "-w", "/tmp", "--",
                     "sh", "-c", 'echo "$WHO $(pwd)"; echo oops >&2; exit 7')  # fmt: skip
    assert (r.code, r.out, r.err) == (7, "cli /tmp\n", "oops\n"), r.err
    r = await up.cli("sandbox", "exec", name, "-i", "--", "wc", "-l", stdin=b"a\nb\nc\n")
    assert (r.code, r.out.strip()) == (0, "3"), r.err
    r = await up.cli("sandbox", "exec", name, "--timeout", "0.5", "--", "sleep", "30")
    assert r.code == 124 and "ran past its timeout" in r.err
    ghost = up.name("ghost")
    r = await up.cli("sandbox", "exec", ghost, "--", "true")
    assert (r.code, r.err) == (1, f"✗ sandbox {ghost!r} not found\n")
    r = await up.cli("sandbox", "delete", name)
    assert r.code == 0, r.err


async def test_watch_status_and_json_output(up: Up) -> None:
    name = up.name("watched")
    r = await up.cli("sandbox", "create", name, "--image", IMAGE, "-o", "json", "--",
                     "sleep", "3600")  # fmt: skip
    created = json.loads(r.out)
    assert (created["name"], created["phase"], created["generation"]) == (name, "Ready", 1)

    r = await up.cli("sandbox", "watch", name, "--timeout", "1", "-o", "json")
    assert r.code == 0, r.err
    events = [json.loads(line) for line in r.out.splitlines()]
    assert [(e["name"], e["phase"]) for e in events] == [(name, "Ready")]

    r = await up.cli("sandbox", "watch", name, "--timeout", "1")
    assert r.code == 0
    assert re.search(rf"{name}\s+Ready\s+gen 1\s+v2\s+#\d+", r.out), r.out

    r = await up.cli("status")
    assert r.code == 0, r.err
    status = {row.split()[0]: row.split()[1:] for row in lines(r.out)}
    assert status["API"] == [up.url, "ready"]
    assert status["kafka"][0] == status["postgres"][0] == status["processor"][0] == "ok"
    r = await up.cli("status", "-o", "json")
    assert json.loads(r.out)["ready"] is True
    assert json.loads(r.out)["sandboxes"]["Ready"] >= 1

    r = await up.cli("sandbox", "delete", name)
    assert r.code == 0, r.err


async def test_ttl_hold_release_extend_and_the_scheduler_inside_up(up: Up) -> None:
    """The operator lifecycle from the command line; the expiry at the end is the scheduler
    that `sandstream up` runs, with the real Podman driver."""
    name = up.name("ops")
    r = await up.cli("sandbox", "create", name, "--image", IMAGE, "--ttl", "1h", "--",
                     "sleep", "3600")  # fmt: skip
    assert r.code == 0, r.err
    r = await up.cli("sandbox", "get", name)
    fields = {row.split()[0]: " ".join(row.split()[1:]) for row in lines(r.out) if row.strip()}
    assert fields["Expires"].endswith("(then stop)") and fields["Held"] == "no"

    r = await up.cli("sandbox", "hold", name, "--reason", "incident 9")
    assert r.code == 0 and f"Held sandbox {name}: incident 9" in r.out, r.err
    r = await up.cli("sandbox", "restart", name)
    assert r.code == 1 and "held by admin" in r.err and "incident 9" in r.err, r.err
    r = await up.cli("status", "-o", "json")
    assert json.loads(r.out)["attention"]["held"] >= 1
    r = await up.cli("status")
    assert re.search(r"^attention\s+\d+ past their deadline, [1-9]\d* held", r.out, re.M), r.out
    r = await up.cli("sandbox", "release", name)
    assert r.code == 0 and f"Released sandbox {name}" in r.out, r.err

    r = await up.cli("sandbox", "restart-policy", name, "OnFailure", "--backoff", "2s:1m",
                     "--max-restarts", "2")  # fmt: skip
    assert r.code == 0 and f"Sandbox {name} restarts: OnFailure" in r.out, r.err
    r = await up.cli("sandbox", "get", name)
    fields = {row.split()[0]: " ".join(row.split()[1:]) for row in lines(r.out) if row.strip()}
    assert fields["Restarts"] == "0 (OnFailure)", r.out
    r = await up.cli("sandbox", "get", name, "-o", "json")
    spec = json.loads(r.out)["spec"]
    assert spec["restart_backoff"] == {"initial_seconds": 2.0, "max_seconds": 60.0}

    r = await up.cli("sandbox", "extend", name, "--ttl", "soon")
    assert r.code == 2 and "expected a positive duration" in r.err
    r = await up.cli("sandbox", "extend", name, "--ttl", "1s")
    assert r.code == 0, r.err

    async def phase() -> str:
        got = await up.cli("sandbox", "get", name, "-o", "json")
        return str(json.loads(got.out)["phase"])

    await eventually(phase, lambda p: p == "Stopped", timeout=60, what="the ttl to stop it")
    r = await up.cli("sandbox", "history", name)
    assert "Deadline(ttl)" in r.out and "applied" in r.out


async def test_tokens_scopes_and_connection_errors(up: Up) -> None:
    r = await up.cli("token", "create", "ci-reader", "--scope", "sandbox:read")
    assert r.code == 0, r.err
    token = r.out.strip()
    assert token.startswith("sst_") and token not in (up.run_dir / "tokens.json").read_text()

    r = await up.cli("sandbox", "create", up.name("denied"), "--image", IMAGE,
                     SANDSTREAM_TOKEN=token)  # fmt: skip
    assert r.code == 1 and "token 'ci-reader' lacks the scope sandbox:write" in r.err
    r = await up.cli("sandbox", "list", SANDSTREAM_TOKEN=token)
    assert r.code == 0
    r = await up.cli("--token", "sst_wrong", "sandbox", "list")
    assert r.code == 1 and "✗ invalid bearer token" in r.err

    r = await up.cli("sandbox", "list", SANDSTREAM_TOKEN_FILE=str(up.run_dir / "missing"))
    assert r.code == 1 and "no API token" in r.err
    r = await up.cli("--url", "http://127.0.0.1:9", "sandbox", "list")
    assert r.code == 1 and "cannot reach the API at http://127.0.0.1:9" in r.err


async def test_a_revoked_or_expired_token_is_refused_by_the_running_api(up: Up) -> None:
    """`token revoke` and an expiry take effect on the running `up` at the next request: the
    API re-reads the tokens file when it changes, never needing a restart."""
    r = await up.cli("token", "create", "ci-revoked", "--scope", "sandbox:read")
    assert r.code == 0, r.err
    token = r.out.strip()
    assert (await up.cli("sandbox", "list", SANDSTREAM_TOKEN=token)).code == 0
    r = await up.cli("token", "revoke", "ci-revoked")
    assert r.code == 0 and "token 'ci-revoked' revoked" in r.err
    r = await up.cli("sandbox", "list", SANDSTREAM_TOKEN=token)
    assert r.code == 1 and "✗ token 'ci-revoked' was revoked at " in r.err
    async with httpx.AsyncClient(base_url=up.url) as http:
        denied = await http.get("/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
    assert denied.status_code == 401 and denied.json()["code"] == "UNAUTHENTICATED"

    r = await up.cli("token", "create", "ci-brief", "--scope", "sandbox:read", "--expires", "2s")
    assert r.code == 0, r.err
    brief = r.out.strip()  # accepted before its expiry: tests/test_api.py (a clock of its own)
    expired = await eventually(
        lambda: up.cli("sandbox", "list", SANDSTREAM_TOKEN=brief),
        lambda result: result.code != 0,
        timeout=30,
        what="the token to expire",
    )
    assert "✗ token 'ci-brief' expired at " in expired.err

    r = await up.cli("token", "list", "-o", "json")
    assert r.code == 0, r.err
    listed = {t["name"]: t for t in json.loads(r.out)}
    assert listed["ci-revoked"]["state"] == "revoked" and listed["ci-revoked"]["revoked_at"]
    assert listed["ci-brief"]["state"] == "expired" and listed["ci-brief"]["expires_at"]
    assert listed["admin"]["state"] == "active" and listed["admin"]["expires_at"] is None
    assert token not in r.out and brief not in r.out and "sha256" not in r.out
    r = await up.cli("token", "list")
    assert re.search(r"^ci-revoked\s+sandbox:read\s+\S+\s+-\s+\S+\s+revoked$", r.out, re.M), r.out

    # The name of a revoked token can be given to a new one (the same actor, a new value).
    r = await up.cli("token", "create", "ci-revoked", "--scope", "sandbox:read")
    assert r.code == 0, r.err
    assert (await up.cli("sandbox", "list", SANDSTREAM_TOKEN=r.out.strip())).code == 0
    r = await up.cli("token", "create", "ci-revoked", "--scope", "sandbox:read")
    assert r.code == 1 and "a token named 'ci-revoked' exists already" in r.err


async def test_sandbox_logs_prints_the_output_and_follows_it_as_it_is_written(up: Up) -> None:
    name = up.name("logs")
    script = "echo to-err >&2; i=0; while true; do echo tick-$i; i=$((i+1)); sleep 0.5; done"
    r = await up.cli("sandbox", "create", name, "--image", IMAGE, "--", "sh", "-c", script)
    assert r.code == 0, r.err
    r = await up.cli("sandbox", "logs", name, "--tail", "2")
    assert r.code == 0, r.err
    assert len(lines(r.out) + lines(r.err)) == 2
    r = await up.cli("sandbox", "logs", name)
    assert "to-err" in lines(r.err) and lines(r.out)[0] == "tick-0"

    proc = await asyncio.create_subprocess_exec(
        SANDSTREAM, "sandbox", "logs", name, "-f", "--tail", "1",
        env={**up.env, "SANDSTREAM_API_URL": up.url}, cwd=PROJECT_ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            first = (await proc.stdout.readline()).decode().strip()
            later = [(await proc.stdout.readline()).decode().strip() for _ in range(3)]
    finally:
        proc.kill()
        await proc.wait()
    # Lines written after `logs -f` began arrive through it, in order.
    ticks = [int(t.removeprefix("tick-")) for t in [first, *later]]
    assert ticks == list(range(ticks[0], ticks[0] + 4))
    r = await up.cli("sandbox", "logs", "no-such-sandbox")
    assert r.code != 0 and "not found" in (r.out + r.err)


async def test_a_followed_log_and_a_watch_end_when_their_token_is_revoked(up: Up) -> None:
    """Regression: `sandbox logs -f` and `sandbox watch` went on after their token was revoked
    (the server re-checked it at the next request only). Now the server ends both streams
    within a second or so, saying why, and the CLI exits 1 with that message."""
    name = up.name("revoked")
    script = "i=0; while true; do echo tick-$i; i=$((i+1)); sleep 0.5; done"
    r = await up.cli("sandbox", "create", name, "--image", IMAGE, "--", "sh", "-c", script)
    assert r.code == 0, r.err
    r = await up.cli("token", "create", "ci-follower", "--scope", "sandbox:read")
    assert r.code == 0, r.err
    env = {**up.env, "SANDSTREAM_API_URL": up.url, "SANDSTREAM_TOKEN": r.out.strip()}
    followers = []
    for args in (("logs", name, "-f", "--tail", "1"), ("watch", name)):
        started = await asyncio.create_subprocess_exec(
            SANDSTREAM, "sandbox", *args, env=env, cwd=PROJECT_ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        followers.append(started)
    try:
        async with asyncio.timeout(60):
            for proc in followers:  # both streams are open and delivering
                assert proc.stdout is not None and await proc.stdout.readline()
            r = await up.cli("token", "revoke", "ci-follower")
            assert r.code == 0, r.err
            ended = [await proc.communicate() for proc in followers]
    finally:
        for proc in followers:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    for proc, (_, err), what in zip(followers, ended, ("logs", "watch"), strict=True):
        assert proc.returncode == 1, (what, err)
        assert f"{what} ended: token 'ci-follower' was revoked at " in err.decode(), err


# These two come last among those using `up`: the second stops it.
async def test_a_second_up_refuses_to_start(up: Up) -> None:
    r = await up.cli("up", timeout=60)
    assert r.code == 1
    assert f"sandstream up is already running (pid {up.proc.pid})" in r.err


async def test_down_keep_stack_stops_a_running_up_cleanly(up: Up) -> None:
    # Last in this module: it ends the `up` the other tests used.
    r = await up.cli("down", "--keep-stack", timeout=90)
    assert r.code == 0, r.err
    assert r.out.strip() == f"sandstream: stopped `up` (pid {up.proc.pid})"
    assert await asyncio.wait_for(up.proc.wait(), 30) == 0
    log = up.log.read_text()
    assert "SIGTERM received: stopping" in log
    assert "stopped. The stack (Kafka, PostgreSQL, Podman) is still running" in log
    assert "Traceback" not in log, log
    assert not (up.run_dir / "up.pid").exists()
    r = await up.cli("down", "--keep-stack")
    assert (r.code, r.out.strip()) == (0, "sandstream: `up` not running")


class _Replies:
    """Stands in for the API client: answers each request with the next body, in order."""

    def __init__(self, *bodies: dict[str, object]) -> None:
        self.bodies = list(bodies)
        self.paths: list[str] = []

    def request(self, method: str, path: str, **_: object) -> httpx.Response:
        self.paths.append(f"{method} {path}")
        return httpx.Response(200, json=self.bodies.pop(0))

    def retried(self, send: Callable[[], httpx.Response], deadline: float) -> httpx.Response:
        return send()  # every answer arrives: nothing to send again


def test_a_rejection_decided_after_the_first_wait_fails_the_command() -> None:
    why = "sandbox must be Ready to stop (current phase: Deleting)"
    pending = {"command_id": "c-1", "status": "pending", "code": None, "message": "pending"}
    rejected = pending | {"status": "rejected", "code": "FAILED_PRECONDITION", "message": why}
    client = _Replies(pending, rejected)
    with pytest.raises(CliError) as failed:
        _submit(client, "POST", "/v1/sandboxes/x:stop", {}, "x", time.monotonic() + 30)  # type: ignore[arg-type]
    assert failed.value.code == EXIT_FAILED
    assert failed.value.message == f"rejected: {why} (FAILED_PRECONDITION)"
    assert client.paths == ["POST /v1/sandboxes/x:stop", "GET /v1/commands/c-1"]
