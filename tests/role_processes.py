"""The roles as separate processes for tests (and fault-injection runs): start `sandstream
<role>` subprocesses on an isolated environment's topics and schema, read their health
endpoints, signal them. Import it as ``import role_processes`` (pytest puts ``tests/`` on
``sys.path``).

Each process gets the environment's settings as SANDSTREAM_* variables, ``--port-file`` in the
work directory (the health endpoint's port, once it listens) and a log file there.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from harness import Env, eventually, isolated_env

from services.common.settings import PROJECT_ROOT
from services.common.tokens import ensure_tokens, read_token_value


@dataclass
class RoleProcess:
    """One `sandstream <role>` subprocess with its log and health endpoint's port file."""

    role: list[str]
    proc: subprocess.Popen[bytes]
    log: Path
    port_file: Path
    token: str | None = None  # sent to the health endpoint (ops:read: readiness detail, metrics)

    @property
    def port(self) -> int | None:
        try:
            return int(self.port_file.read_text())
        except (OSError, ValueError):
            return None

    async def get(self, path: str) -> httpx.Response | None:
        """A GET on the health endpoint; None while it does not answer."""
        if self.port is None:
            return None
        try:
            headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
            async with httpx.AsyncClient(timeout=5, headers=headers) as client:
                return await client.get(f"http://127.0.0.1:{self.port}{path}")
        except httpx.TransportError:
            return None

    async def readiness(self) -> dict[str, Any]:
        """The /readyz body ({} while the endpoint does not answer)."""
        response = await self.get("/readyz")
        return response.json() if response is not None else {}

    async def ready(self, timeout: float = 60) -> dict[str, Any]:
        return await eventually(self.readiness, lambda b: b.get("status") == "ready",
                                timeout=timeout, what=f"{self.name} ready")  # fmt: skip

    @property
    def name(self) -> str:
        return f"{' '.join(self.role)} (pid {self.proc.pid})"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> int:
        """SIGTERM and wait: the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.exit_code()

    def exit_code(self) -> int:
        """Wait for the process to end (killed after a minute): its exit code."""
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return f"--- {self.name}:\n" + self.log.read_text(errors="replace")[-3000:]
        return ""


@dataclass
class Roles:
    env: Env
    workdir: Path
    processes: list[RoleProcess]

    def variables(self) -> dict[str, str]:
        return {**self.env.env_vars(), "SANDSTREAM_RUN_DIR": str(self.workdir)}

    def admin_token(self) -> str:
        """The admin token of the work directory's tokens file (made on first use, as
        `sandstream prepare` would): the health endpoints show detail and metrics to it."""
        settings = self.env.settings.model_copy(update={"run_dir": self.workdir})
        setup = ensure_tokens(settings)
        return read_token_value(setup.admin_token_file)

    def start(self, *role: str, env: dict[str, str] | None = None) -> RoleProcess:
        n = len(self.processes)
        log = self.workdir / f"{n}-{role[0]}.log"
        port_file = self.workdir / f"{n}-{role[0]}.port"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *role, "--port-file", str(port_file)],
                cwd=PROJECT_ROOT,
                env={**self.variables(), **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        process = RoleProcess(list(role), proc, log, port_file, self.admin_token())
        self.processes.append(process)
        return process

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli", *command],
            cwd=PROJECT_ROOT,
            env=self.variables(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.processes)

    def stop_all(self) -> None:
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()


@asynccontextmanager
async def roles_env(tmp_path: Path, **settings: Any) -> AsyncIterator[Roles]:
    """An isolated environment and the role processes a test starts in it (killed at the end,
    their logs printed when the test failed)."""
    async with isolated_env(lease_check_seconds=0.5, **settings) as env:
        roles = Roles(env, tmp_path, [])
        try:
            yield roles
        except BaseException:
            print(roles.logs())
            raise
        finally:
            roles.stop_all()


def partitions_of(bodies: list[dict[str, Any]]) -> list[list[int]]:
    return [list(b.get("partitions", [])) for b in bodies]


def shared_out(bodies: list[dict[str, Any]], count: int) -> bool:
    """Every member owns some partitions, none twice, all of them covered."""
    owned = partitions_of(bodies)
    flat = [p for ps in owned for p in ps]
    return all(owned) and sorted(flat) == list(range(count))


async def assigned_metric(process: RoleProcess, role: str) -> float | None:
    """``sandstream_assigned_partitions{role}`` from the process's /metrics."""
    response = await process.get("/metrics")
    assert response is not None
    prefix = f'sandstream_assigned_partitions{{role="{role}"}} '
    found = [line for line in response.text.splitlines() if line.startswith(prefix)]
    return float(found[0].removeprefix(prefix)) if found else None


def one_active(bodies: list[dict[str, Any]]) -> bool:
    """Both instances of a single-active role are ready, and exactly one is active."""
    ready = all(b.get("status") == "ready" for b in bodies)
    return ready and sorted(b.get("active") is True for b in bodies) == [False, True]


async def all_ready(processes: list[RoleProcess]) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(p.readiness() for p in processes)))
