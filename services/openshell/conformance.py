"""OpenShell's conformance suite and CLI against a `sandstream up` of their own.

``python -m services.openshell.conformance [--runs N]`` creates an isolated environment on the
running local stack (topics, consumer groups and PostgreSQL schema of its own), starts
``sandstream up --no-stack`` in it on free ports with unauthenticated local OpenShell calls,
runs OpenShell's conformance runner (``$OPENSHELL_CONFORMANCE``) N times in a row, then
removes what is left (sandboxes, the environment) and exits non-zero unless every run passed.
``--cli`` runs the scripted session with OpenShell's CLI (``$OPENSHELL_CLI``) instead.

With a :class:`GatewayTls` the gateway serves TLS and the runner connects over https: it
insists on a client certificate (``--tls-cert``, ``--tls-key``) for https, and any pair does,
since the gateway asks for none (server authentication only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc

from services.common.settings import PROJECT_ROOT, Settings, load_settings
from services.common.tokens import SCOPES
from services.localstack.isolation import isolated
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto import openshell_pb2_grpc

RUNNER_ENV: Final = "OPENSHELL_CONFORMANCE"
CLI_ENV: Final = "OPENSHELL_CLI"
UP_TIMEOUT: Final = 120.0
RUN_TIMEOUT: Final = 600.0
# `sandstream up` from this checkout (the installed script may belong to another one).
UP_PROGRAM: Final = (
    "import sys; from services.cli.main import main; sys.argv[0] = 'sandstream'; main()"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tool(env_name: str) -> Path:
    """The OpenShell tool named by an environment variable; ValueError when it cannot run."""
    value = os.environ.get(env_name)
    if not value:
        raise ValueError(f"{env_name} is not set: point it at OpenShell's tool")
    path = Path(value)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(f"{env_name}={value}: no executable file there")
    return path


@dataclass(frozen=True)
class GatewayTls:
    ca: Path  # what the gateway's certificate chains to
    cert: Path  # the gateway's certificate and key (the HTTP API's too)
    key: Path
    client_cert: Path  # the runner's: any pair (the gateway asks for none)
    client_key: Path

    def runner_args(self) -> list[str]:
        return ["--tls-ca", str(self.ca), "--tls-cert", str(self.client_cert),
                "--tls-key", str(self.client_key)]  # fmt: skip


@dataclass(frozen=True)
class RunningUp:
    settings: Settings
    endpoint: str  # http(s)://127.0.0.1:PORT of the OpenShell gRPC API
    log: Path


def _channel(address: str, tls: GatewayTls | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address)
    trusting = grpc.ssl_channel_credentials(root_certificates=tls.ca.read_bytes())
    return grpc.aio.secure_channel(address, trusting)


async def _healthy(
    address: str, deadline: float, process: asyncio.subprocess.Process, tls: GatewayTls | None
) -> None:
    async with _channel(address, tls) as channel:
        stub = openshell_pb2_grpc.OpenShellStub(channel)
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"sandstream up exited with {process.returncode}")
            try:
                await stub.Health(pb.HealthRequest(), timeout=2)
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise TimeoutError("sandstream up did not answer Health in time") from None
                await asyncio.sleep(0.2)  # polling a port that is not open yet: no event to wait on


async def _delete_all(address: str, deadline: float, tls: GatewayTls | None) -> None:
    """Delete every sandbox left (a failed scenario may leave some) and wait until gone."""
    async with _channel(address, tls) as channel:
        stub = openshell_pb2_grpc.OpenShellStub(channel)
        while time.monotonic() < deadline:
            left = (await stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=10)).sandboxes
            if not left:
                return
            for sandbox in left:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.DeleteSandbox(
                        pb.DeleteSandboxRequest(name=sandbox.metadata.name), timeout=30
                    )
            await asyncio.sleep(0.5)  # the driver removes containers at its pace
    raise TimeoutError("sandboxes left after the run could not be deleted")


@contextlib.asynccontextmanager
async def up_process(
    settings: Settings, log_path: Path, tls: GatewayTls | None = None
) -> AsyncIterator[RunningUp]:
    """``sandstream up --no-stack`` with ``settings``, stopped (SIGTERM) after; its output
    appended to ``log_path``."""
    env = {**os.environ, **settings.as_env()}
    with log_path.open("ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            UP_PROGRAM,
            "up",
            "--no-stack",
            cwd=PROJECT_ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        address = f"127.0.0.1:{settings.openshell_port}"
        try:
            await _healthy(address, time.monotonic() + UP_TIMEOUT, process, tls)
            scheme = "https" if tls else "http"
            yield RunningUp(settings, f"{scheme}://{address}", log_path)
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 60)
            except TimeoutError:
                process.kill()
                await process.wait()


@contextlib.asynccontextmanager
async def isolated_up_settings(
    base: Settings, scratch: Path, tls: GatewayTls | None = None
) -> AsyncIterator[Settings]:
    """The settings of a `sandstream up` in an isolated environment of its own (free ports,
    unauthenticated local OpenShell calls, ``tls``'s certificate), removed after."""
    async with isolated(base, "osc-") as (settings, _pool):
        certificate = {"api_tls_certfile": tls.cert, "api_tls_keyfile": tls.key} if tls else {}
        yield settings.model_copy(
            update={
                "api_port": free_port(),
                "openshell_port": free_port(),
                "openshell_allow_unauthenticated": True,
                # The suite and the CLI session exec in sandboxes and manage providers.
                "openshell_unauthenticated_scopes": ",".join(SCOPES),
                "run_dir": scratch / "run",
                **certificate,
            }
        )


@contextlib.asynccontextmanager
async def running_up(
    base: Settings, scratch: Path, tls: GatewayTls | None = None
) -> AsyncIterator[RunningUp]:
    """``sandstream up --no-stack`` in an isolated environment; the sandboxes left are deleted,
    then it is stopped and the environment removed."""
    async with (
        isolated_up_settings(base, scratch, tls) as settings,
        up_process(settings, scratch / "up.log", tls) as up,
    ):
        address = f"127.0.0.1:{settings.openshell_port}"
        try:
            yield up
        finally:
            await _delete_all(address, time.monotonic() + 120, tls)


def run_suite(
    runner: Path, endpoint: str, timeout: float = RUN_TIMEOUT, tls: GatewayTls | None = None
) -> int:
    tls_args = tls.runner_args() if tls else []
    result = subprocess.run(
        [str(runner), "run", "--gateway-endpoint", endpoint, "--timeout", "300", *tls_args],
        timeout=timeout,
        check=False,
    )
    return result.returncode


def cli_session(cli: Path, endpoint: str, home: Path) -> Iterator[tuple[list[str], int, str]]:
    """OpenShell's CLI, step by step: (arguments, exit code, output) of each step; a step that
    fails ends the session."""
    name = f"cli-{os.getpid()}-{int(time.time())}"
    env = {**os.environ, "HOME": str(home), "NO_COLOR": "1"}
    steps = [
        ["gateway", "add", endpoint, "--local", "--name", "sandstream"],
        ["status"],
        # A main process of its own: the CLI's default (an interactive login shell, /bin/bash
        # -l on a terminal) needs bash and a terminal, which a plain image and sandstream's
        # terminal-less main processes do not give it.
        ["sandbox", "create", "--name", name, "--detach", "--no-tty", "--", "sleep", "infinity"],
        ["sandbox", "get", name],
        ["sandbox", "list"],
        ["sandbox", "exec", "--name", name, "--no-tty", "--", "sh", "-c", "echo cli-exec-ok"],
        ["sandbox", "stop", name],
        ["sandbox", "start", name],
        ["sandbox", "delete", name],
    ]
    for args in steps:
        result = subprocess.run(
            [str(cli), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=180,
            check=False,
        )
        output = (result.stdout + result.stderr).decode(errors="replace")
        yield args, result.returncode, output
        if result.returncode != 0:
            return


async def _main(args: argparse.Namespace) -> int:
    try:
        program = tool(CLI_ENV if args.cli else RUNNER_ENV)
    except ValueError as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="sandstream-openshell-"))
    code = 0
    try:
        async with running_up(load_settings(), scratch) as up:
            print(f"sandstream up: OpenShell API at {up.endpoint} (log {up.log})", flush=True)
            if args.cli:
                for step, rc, output in cli_session(program, up.endpoint, scratch / "home"):
                    print(f"$ openshell {' '.join(step)}  -> exit {rc}\n{output}", flush=True)
                    code = code or rc
            else:
                for run in range(1, args.runs + 1):
                    rc = await asyncio.to_thread(run_suite, program, up.endpoint)
                    print(f"conformance run {run}/{args.runs}: exit {rc}", flush=True)
                    code = code or rc
    finally:
        if code and not args.keep:
            print((scratch / "up.log").read_text(errors="replace")[-20000:], file=sys.stderr)
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="suite runs in a row (default 2)")
    parser.add_argument("--cli", action="store_true", help="the CLI session instead of the suite")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder and log")
    sys.exit(asyncio.run(_main(parser.parse_args())))


if __name__ == "__main__":
    main()
