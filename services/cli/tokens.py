"""`sandstream token ...`: API tokens in the local tokens file (create, list, revoke)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.table import Table

from services.cli.client import fail, settings_of
from services.cli.render import Output, OutputOpt, err, print_json, print_table
from services.common.tokens import (
    SCOPES,
    StoredToken,
    TokenFileError,
    add_token,
    parse_expiry,
    read_tokens,
    revoke_token,
)

app = typer.Typer(help="Manage API tokens (the local tokens file).", no_args_is_help=True)


@app.command("create")
def token_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="who uses the token (commands' actor)")],
    scope: Annotated[
        list[str], typer.Option("--scope", help=", ".join(SCOPES) + " (repeat for several)")
    ] = ["sandbox:read"],  # noqa: B006
    expires: Annotated[
        str | None,
        typer.Option(
            "--expires",
            help="when the token stops working: a duration from now (30d, 12h, 90m, 2w), a "
            "date (2027-01-31, its first instant UTC) or a time (2027-01-31T12:00:00+00:00)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Add a token to the tokens file and print it (once: only its hash is stored)."""
    settings = settings_of(ctx)
    try:
        expires_at = parse_expiry(expires) if expires is not None else None
        value = add_token(settings.tokens_file, name, tuple(scope), expires_at)
    except (ValueError, OSError, TokenFileError) as exc:
        fail(str(exc))
    until = f", expires {_moment(expires_at)}" if expires_at is not None else ""
    err.print(f"token {name!r} ({', '.join(sorted(scope))}{until}) added to {settings.tokens_file}")
    print(value)


@app.command("list")
def token_list(ctx: typer.Context, output: OutputOpt = Output.table) -> None:
    """The tokens: name, scopes, created, expires, revoked (never a token's value or hash)."""
    settings = settings_of(ctx)
    try:
        tokens = read_tokens(settings.tokens_file)
    except TokenFileError as exc:
        fail(str(exc))
    now = datetime.now(UTC)
    if output is Output.json:
        print_json([_json(t, now) for t in tokens])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("NAME", "SCOPES", "CREATED", "EXPIRES", "REVOKED", "STATE"):
        table.add_column(column)
    for t in tokens:
        table.add_row(
            t.name,
            ",".join(sorted(t.scopes)),
            t.created_at or "-",
            _moment(t.expires_at),
            _moment(t.revoked_at),
            _state(t, now),
        )
    print_table(table)


@app.command("revoke")
def token_revoke(
    ctx: typer.Context, name: Annotated[str, typer.Argument(help="the token's name")]
) -> None:
    """Revoke a token: a running API refuses it (401) from its next request on."""
    settings = settings_of(ctx)
    try:
        count = revoke_token(settings.tokens_file, name)
    except (ValueError, OSError, TokenFileError) as exc:
        fail(str(exc))
    err.print(f"token {name!r} revoked" + (f" ({count} tokens of that name)" if count > 1 else ""))


def _moment(moment: datetime | None) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds") if moment else "-"


def _state(token: StoredToken, now: datetime) -> str:
    if token.revoked_at is not None:
        return "revoked"
    return "expired" if token.ended(now) else "active"


def _json(token: StoredToken, now: datetime) -> dict[str, object]:
    return {
        "name": token.name,
        "scopes": sorted(token.scopes),
        "created_at": token.created_at,
        "expires_at": _moment(token.expires_at) if token.expires_at else None,
        "revoked_at": _moment(token.revoked_at) if token.revoked_at else None,
        "state": _state(token, now),
    }
