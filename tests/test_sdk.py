"""The Python SDK (sdk/python/, import ``sandstream_sdk``) against a real `sandstream up` (a
subprocess with this module's own topics, schema and port; sandboxes in real Podman
containers): its README example as written, both faces, the typed errors; that it imports none
of the server's packages; and that it builds as a wheel that holds it all."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from harness import eventually
from upkit import SANDSTREAM, Up, running_up, sdk_environment

from services.common.settings import PROJECT_ROOT, load_settings

SDK = PROJECT_ROOT / "sdk" / "python"
sys.path.insert(0, str(SDK))  # the SDK as a user has it: its own distribution's folder

import sandstream_sdk as ss  # noqa: E402
from sandstream_sdk import AsyncSandbox, Sandbox  # noqa: E402
from sandstream_sdk.commands import Streamed  # noqa: E402
from sandstream_sdk.errors import error_of  # noqa: E402

IMAGE = load_settings().sandbox_image
SERVER_PACKAGES = {"events", "projections", "drivers", "services"}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    # Idle suspend's flush interval scaled to 1 s (default 10): only the waits change
    # (tests/test_idle_suspend.py says why the path is the same).
    flush = {"SANDSTREAM_USE_FLUSH_SECONDS": "1"}
    async with running_up(tmp_path_factory.mktemp("run"), flush) as running:
        yield running


@pytest.fixture
def connection(up: Up) -> Iterator[dict[str, str]]:
    """Where the SDK finds the API: the variables it reads, as a user sets them."""
    yield from sdk_environment(up)


def sdk_env(connection: dict[str, str]) -> dict[str, str]:
    """A process that has the SDK's folder on its path, and not the project's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **connection, "PYTHONPATH": str(SDK)}


def readme_example() -> str:
    text = (SDK / "README.md").read_text()
    found = re.search(r"## Ten lines\n\n```python\n(.*?)```", text, re.S)
    assert found, "the README's example"
    return found.group(1)


def test_the_readme_example_is_ten_lines() -> None:
    assert len(readme_example().strip().splitlines()) == 10


async def test_the_readme_example_runs_as_written(up: Up, connection: dict[str, str]) -> None:
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", readme_example()], env=sdk_env(connection),
        cwd="/", capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["hello from the SDK", "stderr: done"]
    assert lines[-1] == "['hello.txt']"
    # Each chunk as it came, after "live: " (chunks two ticks apart are rarely one).
    assert lines[2].startswith("live: ")
    assert [line.removeprefix("live: ") for line in lines[2:-1]] == ["tick 1", "tick 2", "tick 3"]


def test_the_sdk_imports_none_of_the_servers_packages() -> None:
    """Every import in the SDK's source is the standard library, httpx, pydantic or itself;
    and importing it loads nothing of the server."""
    allowed = set(sys.stdlib_module_names) | {"httpx", "pydantic", "sandstream_sdk"}
    for path in sorted((SDK / "sandstream_sdk").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
    probe = "import sys, sandstream_sdk; print(sorted({m.split('.')[0] for m in sys.modules}))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(SDK)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd="/", capture_output=True,
                          text=True, check=True)  # fmt: skip
    loaded = set(ast.literal_eval(done.stdout))
    assert "sandstream_sdk" in loaded and not loaded & SERVER_PACKAGES


def test_the_sdk_builds_as_a_wheel_with_its_two_dependencies(tmp_path: Path) -> None:
    """What CI builds: ``pip wheel --no-deps`` of the distribution (offline, no isolation)."""
    source = tmp_path / "src"
    shutil.copytree(SDK, source, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp_path / "dist"), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("sandstream_sdk-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as built:
        names = set(built.namelist())
        metadata = built.read(next(n for n in names if n.endswith("/METADATA"))).decode()
    modules = {f"sandstream_sdk/{p.name}" for p in (SDK / "sandstream_sdk").glob("*.py")}
    assert modules | {"sandstream_sdk/py.typed"} <= names
    requires = sorted(re.findall(r"^Requires-Dist: (\w+)", metadata, re.M))
    assert requires == ["httpx", "pydantic"]
    assert "Name: sandstream-sdk" in metadata


def test_sync_sandbox_commands_files_logs_and_lifecycle(up: Up, connection: dict[str, str]) -> None:
    sb = Sandbox.create(image=IMAGE, name=up.name("sdk"), env={"WHO": "sdk"}, timeout=600,
                        command=["sh", "-c", "echo booted; exec sleep 3600"])  # fmt: skip
    with sb:
        assert sb.get_info().phase == "Ready" and sb.is_running()
        result = sb.commands.run('echo "$WHO $X"; echo err >&2', envs={"X": "y"}, cwd="/tmp")
        assert (result.exit_code, result.stdout, result.stderr) == (0, "sdk y\n", "err\n")
        assert sb.commands.run(["cat"], stdin="fed").stdout == "fed"
        with pytest.raises(ss.CommandExitError) as failed:
            sb.commands.run("echo partial; exit 3")
        assert (failed.value.exit_code, failed.value.stdout) == (3, "partial\n")
        assert sb.commands.run("exit 4", check=False).exit_code == 4
        seen: list[tuple[str, str]] = []
        streamed = sb.commands.run(
            "echo a; echo b >&2; echo c", on_stdout=lambda t: seen.append(("out", t)),
            on_stderr=lambda t: seen.append(("err", t)),
        )  # fmt: skip
        assert "".join(t for s, t in seen if s == "out") == streamed.stdout == "a\nc\n"
        assert ("err", "b\n") in seen
        with pytest.raises(ss.TimeoutError) as late:
            sb.commands.run("echo before; sleep 30", timeout=1, on_stdout=lambda t: None)
        assert late.value.result.stdout == "before\n"

        assert sb.files.write("dir/a.txt", "alpha").type == "file"
        assert sb.files.read("dir/a.txt") == "alpha"
        assert sb.files.read("/workspace/dir/a.txt", format="bytes") == b"alpha"
        assert sb.files.make_dir("dir/sub") is True and sb.files.make_dir("dir/sub") is False
        assert sorted(e.name for e in sb.files.list("dir")) == ["a.txt", "sub"]
        assert sb.files.rename("dir/a.txt", "dir/b.txt").name == "b.txt"
        assert not sb.files.exists("dir/a.txt") and sb.files.exists("dir/b.txt")
        sb.files.remove("dir")
        assert not sb.files.exists("dir")
        with pytest.raises(ss.NotFoundError):
            sb.files.read("nothing-here")

        assert [line.text for line in sb.logs()] == ["booted"]
        version = sb.get_info().version
        with pytest.raises(ss.VersionConflictError):
            sb.stop(expected_version=version + 100)
        sb.stop(expected_version=version)
        assert sb.get_info().phase == "Stopped"
        with pytest.raises(ss.NotReadyError) as refused:
            sb.commands.run("true")
        assert "Stopped" in refused.value.message
        sb.start()
        assert sb.commands.run("echo again").stdout == "again\n"
    with pytest.raises(ss.NotFoundError):
        Sandbox.connect(sb.name)
    assert sb.kill() is False  # gone already
    sb.close()


def test_a_streamed_run_hands_all_output_to_the_callback_and_keeps_a_bounded_part(
    up: Up, connection: dict[str, str]
) -> None:
    """Regression: with a callback, ``commands.run`` kept every byte of the output in the
    result as well, so a command printing gigabytes (a build, a followed log) grew the
    caller's memory without bound. Now the callback gets it all and the result keeps 1 MiB
    per output, saying it was cut."""
    kept = 1024 * 1024
    size = 3 * kept
    seen = [0]

    def count(text: str) -> None:
        seen[0] += len(text)

    with Sandbox.create(image=IMAGE, name=up.name("sdk-huge")) as sb:
        result = sb.commands.run(f"head -c {size} /dev/zero | tr '\\0' x; echo done >&2",
                                 on_stdout=count, timeout=120)  # fmt: skip
    assert seen[0] == size
    assert len(result.stdout) == kept and result.stdout_truncated, len(result.stdout)
    assert set(result.stdout) == {"x"}
    assert result.stderr == "done\n" and not result.stderr_truncated


async def test_a_create_that_never_gets_ready_leaves_no_sandbox_behind(
    up: Up, connection: dict[str, str]
) -> None:
    """Regression: `with Sandbox.create(image=<one that cannot be pulled>) as sb:` raised
    SandboxError and left the sandbox in Error under its (by default random) name: the block
    never ran, so nothing killed it, and a retrying program piled them up. Both faces; a name
    that was taken already is not deleted (the create was not this call's)."""
    broken = "localhost/no-such-image:1"
    sync_name, async_name = up.name("sdk-broken"), up.name("sdk-broken")
    with (
        pytest.raises(ss.SandboxError, match="is Error"),
        Sandbox.create(image=broken, name=sync_name),
    ):
        pytest.fail("the block runs with a Ready sandbox only")
    with pytest.raises(ss.SandboxError, match="is Error"):
        async with await AsyncSandbox.create(image=broken, name=async_name):
            pytest.fail("the block runs with a Ready sandbox only")

    def gone(name: str) -> bool:
        try:
            Sandbox.connect(name).close()
        except ss.NotFoundError:
            return True
        return False

    for name in (sync_name, async_name):
        await eventually(lambda name=name: gone(name), bool, timeout=60, what=f"{name} gone")
    with Sandbox.create(image=IMAGE, name=sync_name) as kept:
        with pytest.raises(ss.AlreadyExistsError):
            Sandbox.create(image=broken, name=sync_name)
        assert kept.is_running()


async def test_async_sandbox_runs_streams_and_kills(up: Up, connection: dict[str, str]) -> None:
    chunks: list[str] = []

    async def collect(text: str) -> None:
        chunks.append(text)

    async with await AsyncSandbox.create(image=IMAGE, name=up.name("sdk-async")) as sb:
        assert (await sb.get_info()).phase == "Ready"
        result = await sb.commands.run("echo one; echo two", on_stdout=collect)
        assert "".join(chunks) == result.stdout == "one\ntwo\n"
        await sb.files.write("x.bin", b"\x00\x01")
        assert await sb.files.read("x.bin", format="bytes") == b"\x00\x01"
        again = await AsyncSandbox.connect(sb.name)
        assert (await again.commands.run(["echo", "connected"])).stdout == "connected\n"
        await again.close()
    with pytest.raises(ss.NotFoundError):
        await AsyncSandbox.connect(sb.name)


def phase_of(sb: Sandbox, phase: str, timeout: float = 60) -> ss.SandboxInfo:
    """Poll ``sb`` (reads, which are no use) until it is in ``phase``."""
    deadline = time.monotonic() + timeout
    while (info := sb.get_info()).phase != phase and time.monotonic() < deadline:
        time.sleep(0.2)
    assert info.phase == phase, f"{sb.name} is {info.phase}, not {phase}"
    return info


def test_idle_suspend_then_connect_resumes_and_pause_and_resume_by_hand(
    up: Up, connection: dict[str, str]
) -> None:
    with pytest.raises(ValueError, match="idle_suspend"):
        Sandbox.create(template="any", idle_suspend=5)
    with Sandbox.create(image=IMAGE, name=up.name("sdk-idle"), idle_suspend=2) as sb:
        assert sb.get_info().spec["idle_suspend_seconds"] == 2
        sb.files.write("kept.txt", "kept")
        assert phase_of(sb, "Suspended").generation == 1  # the server suspended it, unused
        again = Sandbox.connect(sb.name)  # E2B's auto_resume: Ready when it returns
        assert (again.info.phase, again.info.generation) == ("Ready", 2)
        again.set_idle_suspend(None)
        assert again.files.read("kept.txt") == "kept"
        assert again.pause() == sb.name
        assert (again.info.phase, again.info.generation) == ("Suspended", 2)
        left = Sandbox.connect(sb.name, auto_resume=False)
        assert left.info.phase == "Suspended"
        left.resume()
        assert (left.info.phase, left.info.generation) == ("Ready", 3)
        left.resume()  # Ready: nothing to do
        assert left.get_info().generation == 3
        assert left.get_info().spec.get("idle_suspend_seconds") is None
        again.close()
        left.close()


async def test_async_pause_connect_resumes_and_a_command_wakes_it(
    up: Up, connection: dict[str, str]
) -> None:
    async with await AsyncSandbox.create(image=IMAGE, name=up.name("sdk-apause")) as sb:
        await sb.files.write("kept.txt", "kept")
        assert await sb.pause() == sb.name and sb.info.phase == "Suspended"
        again = await AsyncSandbox.connect(sb.name)
        assert (again.info.phase, again.info.generation) == ("Ready", 2)
        assert await again.files.read("kept.txt") == "kept"
        await again.pause()
        left = await AsyncSandbox.connect(sb.name, auto_resume=False)
        assert left.info.phase == "Suspended"
        assert (await left.commands.run("cat kept.txt", cwd="/workspace")).stdout == "kept"
        assert ((await left.get_info()).phase, left.info.generation) == ("Ready", 3)
        await again.close()
        await left.close()


def test_create_from_a_template_with_env_and_labels_runs_its_spec(
    up: Up, connection: dict[str, str]
) -> None:
    template = up.name("sdk-tpl")
    spec = {"image": IMAGE, "command": ["sleep", "3600"], "env": {"MODE": "base"},
            "labels": {"team": "research"}}  # fmt: skip
    headers = {"Authorization": f"Bearer {connection['SANDSTREAM_TOKEN']}"}
    made = httpx.post(f"{up.url}/v1/templates", headers=headers,
                      json={"name": template, "spec": spec})  # fmt: skip
    assert made.status_code == 201, made.text
    with Sandbox.create(template=f"{template}:1", env={"MODE": "sdk"}, labels={"who": "sdk"}) as sb:
        info = sb.get_info()
        assert info.template == {"name": template, "revision": 1}
        assert info.labels == {"team": "research", "who": "sdk"}
        assert sb.commands.run("echo $MODE").stdout == "sdk\n"


def test_typed_errors_for_name_scope_token_size_path_and_template(
    up: Up, connection: dict[str, str]
) -> None:
    with pytest.raises(ValueError, match="image: set by the template"):
        Sandbox.create(image=IMAGE, template="base")
    with pytest.raises(ss.NotFoundError, match="field 'template'"):
        Sandbox.create(template=up.name("no-such-template"))
    with pytest.raises(ss.AuthenticationError):
        Sandbox.connect("anything", token="sst_not-a-token")
    with pytest.raises(ss.NotFoundError):
        Sandbox.connect(up.name("ghost"))
    name = up.name("sdk-errors")
    with Sandbox.create(image=IMAGE, name=name) as sb:
        with pytest.raises(ss.AlreadyExistsError):
            Sandbox.create(image=IMAGE, name=name)
        with pytest.raises(ss.TooLargeError):
            sb.commands.run("cat", stdin="x" * 600_000)
        # A refusal about the path is its own error, never NotReadyError: the sandbox is
        # Ready, and code that waits on NotReadyError would wait forever.
        for call in (
            lambda: sb.files.write("/etc/motd", "x"),
            lambda: sb.files.make_dir("/srv/new"),
            lambda: sb.files.remove("/etc/passwd"),
        ):
            with pytest.raises(ss.PathConflictError) as refused:
                call()
            assert not isinstance(refused.value, ss.NotReadyError)
            assert (refused.value.status, refused.value.code) == (409, "PATH_CONFLICT")
            assert "read-only file system" in refused.value.message.lower()
        # The SDK sends every upload with its length (an empty one too): no 411 from its own.
        assert sb.files.write("empty", b"").size == 0
        # What a body without a length is answered (a proxy's doing) is a clear typed error.
        headers = {"Authorization": f"Bearer {connection['SANDSTREAM_TOKEN']}"}
        r = httpx.put(f"{up.url}/v1/sandboxes/{name}/files/content", params={"path": "x"},
                      content=iter([b"x"]), headers=headers, timeout=30)  # fmt: skip
        error = error_of(r.status_code, r.json(), r.text)
        assert isinstance(error, ss.InvalidArgumentError), (r.status_code, r.text)
        assert "Content-Length" in error.message
        made = subprocess.run(
            [SANDSTREAM, "token", "create", "sdk-reader", "--scope", "sandbox:read"],
            env=up.env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        limited = Sandbox.connect(name, token=made.stdout.strip())
        with pytest.raises(ss.ForbiddenError, match="sandbox:exec"):
            limited.commands.run("true")
        limited.close()


# What the API answers on the exec and files routes (docs/api.md), and the error each becomes.
ANSWERS = [
    (400, "INVALID_ARGUMENT", ss.InvalidArgumentError),
    (401, "UNAUTHENTICATED", ss.AuthenticationError),
    (403, "PERMISSION_DENIED", ss.ForbiddenError),
    (404, "NOT_FOUND", ss.NotFoundError),
    (409, "ALREADY_EXISTS", ss.AlreadyExistsError),
    (409, "FAILED_PRECONDITION", ss.NotReadyError),
    (409, "PATH_CONFLICT", ss.PathConflictError),
    (411, "LENGTH_REQUIRED", ss.InvalidArgumentError),
    (412, "FAILED_PRECONDITION", ss.NotReadyError),
    (413, "PAYLOAD_TOO_LARGE", ss.TooLargeError),
    (422, "INVALID_ARGUMENT", ss.InvalidArgumentError),
    (429, "RESOURCE_EXHAUSTED", ss.TooManySessionsError),
    (501, "NOT_IMPLEMENTED", ss.NotSupportedError),
    (503, "UNAVAILABLE", ss.UnavailableError),
]


@pytest.mark.parametrize(("status", "code", "kind"), ANSWERS)
def test_each_answer_of_the_api_maps_to_its_typed_error(
    status: int, code: str, kind: type[ss.SandstreamError]
) -> None:
    error = error_of(status, {"code": code, "message": "why"}, "")
    assert (type(error), error.status, error.code, error.message) == (kind, status, code, "why")
    # The same status without the API's body (a proxy's answer) maps by status alone, as
    # closely as it can: a 409 without its code is the general ConflictError.
    alone = error_of(status, None, "from a proxy")
    assert isinstance(alone, ss.ConflictError if status == 409 else kind), status
    assert alone.message == "from a proxy"


@pytest.mark.parametrize(
    ("code", "kind", "status"),
    [
        ("FAILED_PRECONDITION", ss.NotReadyError, 409),
        ("RESOURCE_EXHAUSTED", ss.TooManySessionsError, 429),
        ("UNAVAILABLE", ss.UnavailableError, 503),
    ],
)
def test_an_error_event_of_a_streamed_run_keeps_the_status_of_its_code(
    code: str, kind: type[ss.SandstreamError], status: int
) -> None:
    """The codes the exec route's stream sends in an ``error`` event (a session limit reached
    after the answer began, the runtime gone, the runtime unreachable)."""
    with pytest.raises(kind) as raised:
        Streamed().take("error", {"code": code, "message": "why"})
    assert (raised.value.status, raised.value.code, raised.value.message) == (status, code, "why")
