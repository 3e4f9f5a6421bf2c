"""The `sandstream` command: a client of the HTTP API, plus `up` and `down` for the local stack,
and the roles as separate processes (`processor`, `executor`, `watcher`, `scheduler`, `api`).

Connection: ``--url`` (or SANDSTREAM_API_URL; default from the settings' API host and port) and
a token from ``--token`` / SANDSTREAM_TOKEN, else ``--token-file`` / SANDSTREAM_TOKEN_FILE,
else the admin token file that `sandstream up` writes; ``--ca-file`` (or
SANDSTREAM_API_CA_FILE) verifies an https API with a CA of one's own. Exit codes: 0 done,
1 rejected or failed (the message says why), 2 usage error, 3 timed out waiting.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from services.cli import (
    audit,
    log,
    operations,
    pools,
    processor,
    providers,
    roles,
    sandbox,
    templates,
    tokens,
)
from services.cli import create as _create  # noqa: F401  (sandbox create)
from services.cli import exec as _exec  # noqa: F401  (sandbox exec)
from services.cli import files as _files  # noqa: F401  (sandbox cp, sandbox files ...)
from services.cli import lifecycle as _lifecycle  # noqa: F401  (sandbox hold/release/extend)
from services.cli.client import CliError, Connection
from services.cli.render import err
from services.common.settings import load_settings

app = typer.Typer(
    name="sandstream",
    help="Control plane for agent sandboxes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(tokens.app, name="token")
app.add_typer(audit.app, name="audit")
app.add_typer(processor.app, name="processor")
app.add_typer(log.app, name="log")
app.add_typer(providers.app, name="provider")
app.add_typer(pools.app, name="pool")
app.add_typer(templates.app, name="template")
app.command("provider-sync")(providers.provider_sync)
for _name, _command in (*operations.COMMANDS, *roles.COMMANDS):
    app.command(_name)(_command)


@app.callback()
def root(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option("--url", envvar="SANDSTREAM_API_URL", help="API URL", show_default=False),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="SANDSTREAM_TOKEN", help="API token", show_default=False),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            envvar="SANDSTREAM_TOKEN_FILE",
            help="file holding the API token (default: the admin token `up` writes)",
            show_default=False,
        ),
    ] = None,
    ca_file: Annotated[
        Path | None,
        typer.Option(
            "--ca-file",
            help="CA (PEM) to verify an https API's certificate with (or SANDSTREAM_API_CA_FILE)",
            show_default=False,
        ),
    ] = None,
) -> None:
    settings = load_settings()
    if ca_file is not None:
        settings = settings.model_copy(update={"api_ca_file": ca_file})
    ctx.obj = {"settings": settings, "connection": Connection(url, token, token_file)}


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="sandstream", standalone_mode=True)
    except CliError as exc:
        err.print(f"✗ {exc.message}", markup=False)
        sys.exit(exc.code)
