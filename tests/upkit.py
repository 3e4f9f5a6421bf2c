"""`sandstream up` as a subprocess for tests: the real console script with an isolated
environment's topics and schema, a run directory of its own (tokens, pid file), ephemeral ports
and the real Podman driver. ``running_up`` yields it once its banner is printed and stops it
(and deletes the containers of the names it handed out) at the end.

Import it as ``import upkit`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from apikit import unique
from harness import Env, isolated_env

from services.common.settings import PROJECT_ROOT
from services.executor.backends import podman_driver

SANDSTREAM = str(PROJECT_ROOT / ".venv" / "bin" / "sandstream")


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str


@dataclass
class Up:
    proc: asyncio.subprocess.Process
    url: str
    env: dict[str, str]
    run_dir: Path
    log: Path
    banner: str
    stack: Env
    names: list[str] = field(default_factory=list)

    async def cli(
        self, *args: str, timeout: float = 120, stdin: bytes | None = None, **env: str
    ) -> Result:
        """The CLI's answer; ``stdin``: what its standard input holds (else it inherits ours)."""
        proc = await asyncio.create_subprocess_exec(
            SANDSTREAM,
            *args,
            env={**self.env, "SANDSTREAM_API_URL": self.url, **env},
            cwd=PROJECT_ROOT,
            stdin=None if stdin is None else asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
        assert proc.returncode is not None
        return Result(proc.returncode, out.decode(), err.decode())

    def name(self, prefix: str) -> str:
        self.names.append(unique(prefix))
        return self.names[-1]

    def admin_token(self) -> str:
        return (self.run_dir / "admin.token").read_text().strip()


@asynccontextmanager
async def running_up(
    run_dir: Path, variables: dict[str, str] | None = None, env: Env | None = None
) -> AsyncIterator[Up]:
    """`sandstream up` on ``env`` (an isolated environment of its own when none is given) until
    the block ends (SIGTERM then); the sandboxes named through ``Up.name`` are removed from
    Podman afterwards. ``variables`` are added to its environment."""
    async with AsyncExitStack() as scope:
        if env is None:
            env = await scope.enter_async_context(isolated_env())
        async with _running_up(env, run_dir, variables or {}) as running:
            yield running


@asynccontextmanager
async def _running_up(env: Env, run_dir: Path, extra: dict[str, str]) -> AsyncIterator[Up]:
    variables = {
        **env.env_vars(),
        "SANDSTREAM_RUN_DIR": str(run_dir),
        "SANDSTREAM_API_PORT": "0",
        "SANDSTREAM_OPENSHELL_PORT": "0",
        "COLUMNS": "200",
        **extra,
    }
    for inherited in ("SANDSTREAM_TOKEN", "SANDSTREAM_TOKEN_FILE", "SANDSTREAM_API_URL"):
        variables.pop(inherited, None)
    log = run_dir / "up.log"
    with log.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            SANDSTREAM, "up", env=variables, cwd=PROJECT_ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=log_file,
        )  # fmt: skip
    assert proc.stdout is not None
    banner: list[str] = []
    url = None
    running = None
    try:
        async with asyncio.timeout(120):
            while url is None:
                line = (await proc.stdout.readline()).decode()
                assert line, f"`sandstream up` ended early:\n{''.join(banner)}{log.read_text()}"
                banner.append(line)
                if match := re.match(r"^\s+API\s+(http://\S+)", line):
                    url = match.group(1)
            while "Ctrl-C" not in banner[-1]:
                banner.append((await proc.stdout.readline()).decode())
        running = Up(proc, url, variables, run_dir, log, "".join(banner), env)
        yield running
    finally:
        try:
            await _stopped(proc)
        finally:
            await _removed(env, running.names if running else [])


async def _stopped(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL if it has not ended within a minute (it is not left running)."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise


async def _removed(env: Env, names: list[str]) -> None:
    """Delete every name's runtimes from Podman, each even when one before it failed (a
    failed delete left the later names' containers on the shared Podman)."""
    driver = podman_driver(env.settings)
    failed = []
    try:
        for name in names:
            try:
                await driver.delete(name)
            except Exception as exc:
                failed.append(f"{name}: {exc!r}")
    finally:
        await driver.close()
    assert not failed, f"could not remove {failed}"


def sdk_environment(up: Up) -> Iterator[dict[str, str]]:
    """The variables the SDK reads to find ``up``'s API, set while the generator is open (as
    a user sets them), then restored."""
    variables = {"SANDSTREAM_API_URL": up.url, "SANDSTREAM_TOKEN": up.admin_token()}
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    yield variables
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
