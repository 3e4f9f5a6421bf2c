"""`sandstream processor | executor | watcher | scheduler | api`: one role as a long-lived
process, and `sandstream prepare`, which readies what they need once.

Each serves /healthz, /readyz and /metrics on its health endpoint (``--health-port``, 0: a free
port, logged and written to ``--port-file``) and stops gracefully on SIGTERM or SIGINT. Exit
codes: 0 stopped by a signal after a clean drain, 1 failed while running (or the drain did),
2 usage, 3 could not start (a backend unreachable or refusing), 130 forced by a second signal.
Settings come from SANDSTREAM_* variables (docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from services.cli.client import settings_of
from services.common.entrypoint import Endpoint, Role
from services.common.settings import Settings

HealthPort = Annotated[
    int | None,
    typer.Option("--health-port", min=0, max=65535, show_default=False,
                 help="port of /healthz, /readyz, /metrics (default SANDSTREAM_HEALTH_PORT, "
                 "else 0: a free port)"),
]  # fmt: skip
HealthHost = Annotated[
    str | None,
    typer.Option("--health-host", show_default=False,
                 help="address of the health endpoint (default SANDSTREAM_HEALTH_HOST)"),
]  # fmt: skip
PortFile = Annotated[
    Path | None,
    typer.Option("--port-file", show_default=False,
                 help="write the health endpoint's port here once it listens"),
]  # fmt: skip


def run_role_command(role: Role, settings: Settings, host: str | None, port: int | None,
         port_file: Path | None) -> None:  # fmt: skip
    from services.common.entrypoint import run_role

    endpoint = Endpoint(
        host if host is not None else settings.health_host,
        port if port is not None else settings.health_port,
        port_file,
        settings.tokens_file,
    )
    raise typer.Exit(run_role(role, endpoint))


def role_command(make: Callable[[Settings], Role], doc: str) -> Callable[..., None]:
    """A command that runs the role ``make`` builds from the settings."""

    def command(
        ctx: typer.Context,
        health_port: HealthPort = None,
        health_host: HealthHost = None,
        port_file: PortFile = None,
    ) -> None:
        settings = settings_of(ctx)
        run_role_command(make(settings), settings, health_host, health_port, port_file)

    command.__doc__ = doc
    return command


def _processor(settings: Settings) -> Role:
    from services.roles.processor import ProcessorRole

    return ProcessorRole(settings)


def _executor(settings: Settings) -> Role:
    from services.roles.driver_roles import executor_role

    return executor_role(settings)


def _watcher(settings: Settings) -> Role:
    from services.roles.driver_roles import WatcherRole

    return WatcherRole(settings)


def _scheduler(settings: Settings) -> Role:
    from services.roles.scheduler import SchedulerRole

    return SchedulerRole(settings)


processor_run = role_command(
    _processor, "Run one lifecycle processor; N of them share the input partitions."
)
executor = role_command(
    _executor, "Run one executor (SANDSTREAM_DRIVER's backend); N of them share the events."
)
watcher = role_command(
    _watcher, "Run the driver watcher and reconcile loop; one is active (lease), others wait."
)
scheduler = role_command(
    _scheduler, "Run the deadline scheduler; one is active (lease), the others wait."
)


def api(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option("--port", min=0, max=65535, show_default=False,
                                             help="API port (default 8787)")] = None,
    host: Annotated[str | None, typer.Option("--host", show_default=False,
                                             help="API address")] = None,
    health_port: HealthPort = None,
    health_host: HealthHost = None,
    port_file: PortFile = None,
) -> None:  # fmt: skip
    """Run the HTTP API; N of them can serve side by side."""
    from services.roles.api import ApiRole

    settings = settings_of(ctx)
    overrides = {k: v for k, v in (("api_port", port), ("api_host", host)) if v is not None}
    settings = settings.model_copy(update=overrides)
    run_role_command(ApiRole(settings), settings, health_host, health_port, port_file)


def prepare(ctx: typer.Context) -> None:
    """Create the topics, schema, tokens and key the roles need, if missing (run it once)."""
    from services.cli.client import fail
    from services.common.entrypoint import EXIT_START_FAILED, configure_role_logging
    from services.roles.prepare import prepare as prepare_all

    configure_role_logging()
    problem = prepare_all(settings_of(ctx))
    if problem is not None:
        fail(f"sandstream prepare: {problem}", EXIT_START_FAILED)
    print("sandstream: topics, schema, tokens and credentials key are ready")


COMMANDS = (
    ("executor", executor),
    ("watcher", watcher),
    ("scheduler", scheduler),
    ("api", api),
    ("prepare", prepare),
)
