"""`sandstream up` and `sandstream down`: the whole local control plane in one foreground process.

``up`` brings the stack up (Kafka, PostgreSQL, Podman; idempotent), applies the migrations,
creates the API tokens if missing, then runs the control plane (processor, executor with the
Podman driver, watcher, reconciler, deadline scheduler) and the HTTP API in one event loop,
logging to the terminal until Ctrl-C or SIGTERM, which stop everything cleanly. The stack keeps
running. With ``up_api_process`` the API runs in a child process instead (api_process.py).
``down`` stops a running ``up`` (through its pid file) and then the stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import asyncpg
from aiokafka.errors import KafkaError

from drivers.protocol import ExecDriver
from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.providers import ProviderService
from services.api.server import Tls, bind, start_api
from services.common.credentials import create_key_file
from services.common.kafka_clients import kafka_client_args
from services.common.log_filter import rate_limit_kafka_logs
from services.common.migrations import apply_migrations
from services.common.serving import url_of
from services.common.settings import Settings
from services.common.tokens import TokenFileError, TokenSetup, TokenStore, ensure_tokens
from services.executor.backends import describe_driver
from services.localstack import stack
from services.openshell.server import (
    OpenShellConfigError,
    RunningOpenShell,
    check_settings,
    is_loopback,
    start_openshell,
)
from services.provider_sync.controller import ProviderSync, sync_source
from services.up.api_process import ApiChild, settings_exec_driver

if TYPE_CHECKING:
    from services.up.control_plane import ControlPlane

log = logging.getLogger("sandstream.up")

STOP_WAIT = 60.0  # how long `down` waits for a running `up` to finish
EXECUTOR_JOIN_WAIT = 60.0  # how long `up` waits for its executor to join before taking commands


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)-5s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    for noisy in ("aiokafka", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    rate_limit_kafka_logs()


def shown(path: Path) -> str:
    """A path relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# The pid file: "pid start-time"; the start time guards against a reused pid


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot); None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
    return None if fields[0] in ("Z", "X") else fields[19]  # field 22: starttime


def running_up(settings: Settings) -> int | None:
    """The pid of a running `sandstream up` of these settings, if there is one."""
    try:
        pid_text, started = settings.up_pid_file.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    return pid if _start_time(pid) == started else None


def _claim_pid_file(settings: Settings) -> bool:
    path = settings.up_pid_file
    path.parent.mkdir(parents=True, exist_ok=True)
    if running_up(settings) is not None:
        return False
    path.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # another `up` claimed it just now
        return False
    with os.fdopen(fd, "w") as out:
        out.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
    return True


def _release_pid_file(settings: Settings) -> None:
    if running_up(settings) == os.getpid():
        settings.up_pid_file.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# up


def up(settings: Settings, *, start_stack: bool = True) -> int:
    """Run the control plane and the API in the foreground; the process exit code."""
    configure_logging()
    try:
        check_settings(settings)
    except OpenShellConfigError as exc:
        print(f"sandstream up: {exc}", file=sys.stderr)
        return 1
    if settings.up_api_process and (settings.openshell_enabled or sync_source(settings)):
        print(
            "sandstream up: the API in a process of its own (SANDSTREAM_UP_API_PROCESS) "
            "runs without OpenShell and the provider sync (--no-openshell)",
            file=sys.stderr,
        )
        return 1
    if not _claim_pid_file(settings):
        print(
            f"sandstream up is already running (pid {running_up(settings)}); "
            "`sandstream down` stops it",
            file=sys.stderr,
        )
        return 1
    try:
        if start_stack:
            try:
                settings = stack.up(settings)
            except stack.StackError as exc:
                print(f"sandstream up: the stack did not come up: {exc}", file=sys.stderr)
                return 1
        schema = None if settings.pg_schema == "public" else settings.pg_schema
        try:
            asyncio.run(apply_migrations(settings.pg_dsn, schema=schema))
        except (OSError, asyncpg.PostgresError) as exc:
            print(f"sandstream up: cannot migrate PostgreSQL: {exc!r}", file=sys.stderr)
            return 1
        try:
            tokens = ensure_tokens(settings)
        except TokenFileError as exc:
            print(f"sandstream up: {exc}", file=sys.stderr)
            return 1
        if settings.credentials_key is None and create_key_file(settings.credentials_key_path):
            log.info("created the credentials key %s (mode 0600)", settings.credentials_key_path)
        return asyncio.run(_serve(settings, tokens))
    finally:
        _release_pid_file(settings)


@dataclass
class _Signals:
    stop: asyncio.Event
    count: int = 0

    def received(self, signum: int) -> None:
        self.count += 1
        if self.count == 1:
            log.info("%s received: stopping (again to force)", signal.Signals(signum).name)
            self.stop.set()
        else:
            log.warning("forced exit")
            os._exit(130)


async def _serve(settings: Settings, tokens: TokenSetup) -> int:
    from services.common.database import connect_pool
    from services.executor.backends import driver_from_settings
    from services.up.control_plane import open_control_plane

    loop = asyncio.get_running_loop()
    signals = _Signals(asyncio.Event())
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.received, sig)
    try:
        sock = bind(settings.api_host, settings.api_port)
    except OSError as exc:
        print(
            f"sandstream up: cannot listen on {settings.api_host}:{settings.api_port}: "
            f"{exc.strerror}; set SANDSTREAM_API_PORT to use another port",
            file=sys.stderr,
        )
        return 1

    try:
        driver = driver_from_settings(settings)
        tls = Tls.of(settings)
    except (ValueError, OSError) as exc:
        print(f"sandstream up: {exc}", file=sys.stderr)
        sock.close()
        return 1
    if tls is None and not is_loopback(settings.api_host):
        log.warning(
            "the API listens on %s without TLS: tokens cross the network in clear "
            "(set SANDSTREAM_API_TLS_CERTFILE and SANDSTREAM_API_TLS_KEYFILE)",
            settings.api_host,
        )
    plane = None
    pool = None
    publisher = CommandPublisher(kafka_client_args(settings, "api"), topic=settings.topic_commands)
    api = None
    child: ApiChild | None = None
    openshell: RunningOpenShell | None = None
    code = 0
    try:
        started = time.monotonic()
        plane = await open_control_plane(settings, driver, with_scheduler=True, supervised=True)
        await _executor_joined(plane, signals.stop)
        if settings.up_api_process:
            port = sock.getsockname()[1]
            child = await ApiChild.start(settings, sock)
            sock.close()  # the child's now
            url = url_of(settings.api_host, port, "https" if tls else "http")
            _banner(settings, url, tokens, time.monotonic() - started)
            code = await _until_stopped(signals, plane, child.ended(), "API process")
            return code
        pool = await connect_pool(settings)
        await publisher.__aenter__()
        app = create_app(
            settings,
            pool,
            publisher,
            TokenStore.from_file(tokens.tokens_file),
            down=plane.down,
            exec_driver=_exec_driver(settings, driver),
        )
        api = await start_api(app, settings.api_host, settings.api_port, sock=sock, tls=tls,
                              trusted_proxies=settings.trusted_proxies)  # fmt: skip
        if settings.openshell_enabled:
            # A second door: the API's command gateway, pool and change feed, the same driver.
            openshell = await start_openshell(
                settings,
                pool=pool,
                gateway=app.state.api.gateway,
                tokens=app.state.tokens,
                driver=app.state.api.exec_driver,  # exec's driver and count: one for both doors
                logs=app.state.api.logs,
                limits=app.state.api.exec_limits,
                use=app.state.api.use,  # one record of use for both doors
            )
        _banner(settings, api.url, tokens, time.monotonic() - started, openshell)
        if sync_source(settings) is not None:
            sync = functools.partial(_run_provider_sync, settings, app.state.providers)
            plane.supervise("provider sync", sync)

        code = await _until_stopped(signals, plane, asyncio.shield(api.task), "api")
    except (OSError, KafkaError, TokenFileError, asyncpg.PostgresError, RuntimeError) as exc:
        log.error("startup failed: %r", exc)
        code = 1
    finally:
        log.info("stopping the API, processor, executor, watcher and scheduler")
        if openshell is not None:
            await openshell.stop()
        if child is not None:
            await child.stop()
        if api is not None:
            await api.stop()
        else:
            sock.close()
        if plane is not None:
            await plane.stop()
        with contextlib.suppress(Exception):
            await publisher.__aexit__()
        if pool is not None:
            await pool.close()
        await driver.close()
        log.info(
            "stopped. The stack (Kafka, PostgreSQL, Podman) is still running; "
            "`sandstream down` stops it"
        )
    return code


async def _until_stopped(
    signals: _Signals, plane: ControlPlane, api: Awaitable[object], what: str
) -> int:
    """Wait for a signal (0), or for the control plane or the API to stop by itself (1)."""
    waiters: dict[asyncio.Future[Any], str] = {
        asyncio.ensure_future(signals.stop.wait()): "signal",
        asyncio.ensure_future(plane.stopping.wait()): "control plane",
        asyncio.ensure_future(api): what,
    }
    done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    why = waiters[next(iter(done))]
    if why == "signal" or signals.stop.is_set():
        return 0
    log.error("the %s stopped unexpectedly; stopping everything", why)
    return 1


async def _run_provider_sync(
    settings: Settings, service: ProviderService, stop: asyncio.Event
) -> None:
    """The provider-sync controller on the source the settings name, until ``stop``: a part of
    ``up`` supervised like the control plane's (a crash is reported and it starts again with a
    source of its own; it never stops the rest)."""
    source = sync_source(settings)
    assert source is not None  # checked before it was supervised
    await ProviderSync(service, source).run(stop)


async def _executor_joined(plane: ControlPlane, stop: asyncio.Event) -> None:
    """Take no command before the executor has joined its group (at most EXECUTOR_JOIN_WAIT).
    A new group starts at the end of the events topic: a sandbox decided before that is not
    the executor's to launch, and would wait for the reconcile pass to pick it up (two passes,
    a minute by default)."""
    from services.common.tasks import first_of

    if plane.executor_assigned.is_set():
        return
    log.info("waiting for the executor to join its consumer group before taking commands")
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(first_of(plane.executor_assigned, stop), EXECUTOR_JOIN_WAIT)
    if not plane.executor_assigned.is_set() and not stop.is_set():
        log.warning(
            "the executor has not joined its consumer group after %.0fs: taking commands; "
            "sandboxes created before it joins are launched by the reconcile pass",
            EXECUTOR_JOIN_WAIT,
        )


def _banner(
    settings: Settings,
    url: str,
    tokens: TokenSetup,
    seconds: float,
    openshell: RunningOpenShell | None = None,
) -> None:
    token_line = shown(tokens.admin_token_file)
    if tokens.created:
        token_line += "  (new admin token)"
    elif not tokens.admin_token_file.exists():
        token_line = (
            f"(none: {shown(tokens.admin_token_file)} was removed; "
            "`sandstream token create NAME` makes a new one)"
        )
    lines = [
        f"sandstream is up ({seconds:.1f}s)",
        f"  API         {url}   (OpenAPI: {url}/docs)",
        f"  Console     {url}/ui/   (sign in with a token)",
        f"  OpenShell   {_openshell_line(settings, openshell)}",
        f"  token       {token_line}",
        f"  tokens      {shown(tokens.tokens_file)}",
        f"  driver      {describe_driver(settings, shown)}",
        "  Ctrl-C stops sandstream; the stack keeps running (`sandstream down` stops it)",
    ]
    print("\n".join(lines), flush=True)


def _openshell_line(settings: Settings, openshell: RunningOpenShell | None) -> str:
    if openshell is None:
        return "off"
    scheme = "grpcs" if openshell.tls else "grpc"
    line = f"{scheme}://{openshell.address}   (OpenShell's gRPC API)"
    if settings.openshell_allow_unauthenticated:
        scopes = ", ".join(sorted(settings.openshell_local_scopes)) or "no scope"
        line += f"  unauthenticated local calls allowed ({scopes})"
    return line


# ---------------------------------------------------------------------------------------------
# down


def stop_running_up(settings: Settings, timeout: float = STOP_WAIT) -> int | None:
    """SIGTERM a running `up` and wait for it to end; its pid, or None if none ran."""
    pid = running_up(settings)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _start_time(pid) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"sandstream up (pid {pid}) did not stop within {timeout:.0f}s")
        time.sleep(0.1)
    return pid


def down(settings: Settings, *, keep_stack: bool = False) -> int:
    try:
        pid = stop_running_up(settings)
    except TimeoutError as exc:
        print(f"sandstream down: {exc}", file=sys.stderr)
        return 1
    print(f"sandstream: stopped `up` (pid {pid})" if pid else "sandstream: `up` not running")
    if not keep_stack:
        try:
            stack.down(settings)
        except stack.StackError as exc:
            print(f"sandstream down: {exc}", file=sys.stderr)
            return 1
    return 0


def _exec_driver(settings: Settings, driver: object) -> ExecDriver | Literal["settings"] | None:
    """The driver exec runs through (both doors): ``up``'s own when it can exec (Podman's),
    else one built from the settings (the Kubernetes driver's exec); none behind a routing
    prefix (the routing driver has no exec)."""
    if isinstance(driver, ExecDriver):
        return driver
    return settings_exec_driver(settings)
