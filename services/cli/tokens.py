"""`sandstream token ...`: API tokens in the local tokens file."""

from __future__ import annotations

from typing import Annotated

import typer

from services.cli.client import fail, settings_of
from services.cli.render import err

app = typer.Typer(help="Manage API tokens (the local tokens file).", no_args_is_help=True)


@app.command("create")
def token_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="who uses the token (commands' actor)")],
    scope: Annotated[
        list[str], typer.Option("--scope", help="sandbox:read, sandbox:write, audit:read")
    ] = ["sandbox:read"],  # noqa: B006
) -> None:
    """Add a token to the tokens file and print it (once: only its hash is stored)."""
    from services.api.auth import add_token

    settings = settings_of(ctx)
    try:
        value = add_token(settings.tokens_file, name, tuple(scope))
    except (ValueError, OSError) as exc:
        fail(str(exc))
    err.print(f"token {name!r} ({', '.join(sorted(scope))}) added to {settings.tokens_file}")
    print(value)


# ---------------------------------------------------------------------------------------------
