"""`sandstream template ...`: create, get, list, update (a new revision) and delete templates.

`update` reads the newest revision, replaces what its options give (--env, --label or
--provider given replace the whole map or list) and writes the next revision based on the one
it read, so a change made meanwhile by someone else is refused (409), never overwritten.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from services.cli.client import client_of
from services.cli.lifecycle_options import (
    ExitChoice,
    ExpiryChoice,
    MaxRestartsOpt,
    RestartBackoffOpt,
    RestartChoice,
    duration_seconds,
    idle_field,
    restart_body,
)
from services.cli.render import Output, OutputOpt, age, err, out, print_json, print_table
from services.cli.sandbox import pairs

app = typer.Typer(help="Sandbox templates: named, versioned specs.", no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(help="the template name (a DNS label)")]
Command = Annotated[
    list[str] | None, typer.Argument(help="the command to run (after --)", show_default=False)
]
Labels = Annotated[list[str] | None, typer.Option("--label", help="KEY=VALUE (repeatable)")]
Env = Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE (repeatable)")]
Providers = Annotated[
    list[str] | None, typer.Option("--provider", help="credential provider (repeatable)")
]
StopTimeout = Annotated[
    int | None, typer.Option("--stop-timeout", min=0, help="seconds from SIGTERM to SIGKILL")
]
Ttl = Annotated[str | None, typer.Option("--ttl", help="each sandbox's time to live, e.g. 2h")]
OnExpiry = Annotated[ExpiryChoice | None, typer.Option("--on-expiry", help="[default: stop]")]
OnExit = Annotated[ExitChoice | None, typer.Option("--on-exit", help="[default: keep]")]
Policy = Annotated[
    RestartChoice | None, typer.Option("--restart-policy", help="Never, OnFailure or Always")
]
IdleSuspend = Annotated[
    str | None,
    typer.Option(
        "--idle-suspend",
        help="suspend each sandbox made from it once Ready and unused this long, e.g. 15m; "
        "off: never (default: never)",
    ),
]
Description = Annotated[str | None, typer.Option("--description", help="what it is for")]
ExpectedRevision = Annotated[
    int | None,
    typer.Option("--expected-revision", min=1, help="fail (409) unless it is at this revision"),
]


def _fields(
    current: dict[str, Any],
    *,
    image: str | None,
    command: list[str] | None,
    env: list[str] | None,
    label: list[str] | None,
    provider: list[str] | None,
    stop_timeout: int | None,
    ttl: str | None,
    on_expiry: ExpiryChoice | None,
    on_exit: ExitChoice | None,
    restart: dict[str, Any],
    idle_suspend: str | None,
    description: str | None,
) -> dict[str, Any]:
    """A template body: ``current`` (empty for a create) with what the options give."""
    spec = dict(current.get("spec") or {})
    if image is not None:
        spec["image"] = image
    if "image" not in spec:
        raise typer.BadParameter("needed", param_hint="--image")
    if command:
        spec["command"] = list(command)
    if env:
        spec["env"] = pairs(env, "--env")
    if label:
        spec["labels"] = pairs(label, "--label")
    if stop_timeout is not None:
        spec["stop_timeout_seconds"] = stop_timeout
    spec |= restart
    if idle_suspend is not None and idle_suspend.strip().lower() == "off":
        spec.pop("idle_suspend_seconds", None)
    elif idle_suspend is not None:
        spec["idle_suspend_seconds"] = duration_seconds(idle_suspend, "--idle-suspend")
    kept = ("providers", "ttl_seconds", "on_expiry", "on_exit", "description")
    body: dict[str, Any] = {k: current[k] for k in kept if k in current}
    body["spec"] = spec
    if provider:
        body["providers"] = provider
    if ttl is not None:
        body["ttl_seconds"] = duration_seconds(ttl, "--ttl")
    if on_expiry is not None:
        body["on_expiry"] = on_expiry.value
    if on_exit is not None:
        body["on_exit"] = on_exit.value
    if description is not None:
        body["description"] = description
    return body


def _show(row: dict[str, Any], output: Output) -> None:
    if output is Output.json:
        print_json(row)
        return
    spec = row["spec"]
    fields = [
        ("Name", row["name"]),
        ("Revision", row["revision"]),
        ("Description", row["description"] or "-"),
        ("Image", spec["image"]),
        ("Command", " ".join(spec["command"]) or "(image default)"),
        ("Env", ", ".join(sorted(spec["env"])) or "-"),
        ("Labels", ", ".join(f"{k}={v}" for k, v in sorted(spec["labels"].items())) or "-"),
        ("Providers", ", ".join(row["providers"]) or "-"),
        ("Restart policy", spec.get("restart_policy") or "Never"),
        idle_field(row),
        ("TTL", f"{row['ttl_seconds']}s" if row["ttl_seconds"] else "-"),
        ("On expiry / exit", f"{row['on_expiry']} / {row['on_exit']}"),
        ("Created", f"{row['created_at']} by {row['created_by']}"),
        ("Updated", f"{row['updated_at']} by {row['updated_by']}"),
    ]
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in fields:
        table.add_row(key, str(value))
    print_table(table)


@app.command("create")
def create(
    ctx: typer.Context,
    name: NameArg,
    image: Annotated[str, typer.Option("--image", help="container image", show_default=False)],
    command: Command = None,
    label: Labels = None,
    env: Env = None,
    provider: Providers = None,
    stop_timeout: StopTimeout = None,
    ttl: Ttl = None,
    on_expiry: OnExpiry = None,
    on_exit: OnExit = None,
    restart_policy: Policy = None,
    restart_backoff: RestartBackoffOpt = None,
    max_restarts: MaxRestartsOpt = None,
    idle_suspend: IdleSuspend = None,
    description: Description = None,
    output: OutputOpt = Output.table,
) -> None:
    """Create a template (revision 1)."""
    body = _fields({}, image=image, command=command, env=env, label=label, provider=provider,
                   stop_timeout=stop_timeout, ttl=ttl, on_expiry=on_expiry, on_exit=on_exit,
                   restart=restart_body(restart_policy, restart_backoff, max_restarts),
                   idle_suspend=idle_suspend, description=description)  # fmt: skip
    row = client_of(ctx).request("POST", "/v1/templates", json_body={"name": name, **body},
                                 ok=(201,)).json()  # fmt: skip
    if output is Output.json:
        print_json(row)
    else:
        out.print(f"✓ Created template {name} (revision {row['revision']})")


@app.command("update")
def update(
    ctx: typer.Context,
    name: NameArg,
    image: Annotated[str | None, typer.Option("--image", help="container image")] = None,
    command: Command = None,
    label: Labels = None,
    env: Env = None,
    provider: Providers = None,
    stop_timeout: StopTimeout = None,
    ttl: Ttl = None,
    on_expiry: OnExpiry = None,
    on_exit: OnExit = None,
    restart_policy: Policy = None,
    restart_backoff: RestartBackoffOpt = None,
    max_restarts: MaxRestartsOpt = None,
    idle_suspend: IdleSuspend = None,
    description: Description = None,
    expected_revision: ExpectedRevision = None,
    output: OutputOpt = Output.table,
) -> None:
    """Write the next revision: the newest with what the options change."""
    client = client_of(ctx)
    current = client.request("GET", f"/v1/templates/{name}").json()
    body = _fields(current, image=image, command=command, env=env, label=label,
                   provider=provider, stop_timeout=stop_timeout, ttl=ttl, on_expiry=on_expiry,
                   on_exit=on_exit,
                   restart=restart_body(restart_policy, restart_backoff, max_restarts),
                   idle_suspend=idle_suspend, description=description)  # fmt: skip
    body["expected_revision"] = expected_revision or current["revision"]
    row = client.request("PUT", f"/v1/templates/{name}", json_body=body).json()
    if output is Output.json:
        print_json(row)
    else:
        out.print(f"✓ Updated template {name} (revision {row['revision']})")


@app.command("get")
def get(
    ctx: typer.Context,
    name: NameArg,
    revision: Annotated[int | None, typer.Option("--revision", min=1, help="this one")] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Show a template (its newest revision, or --revision)."""
    params = {"revision": revision} if revision is not None else None
    _show(client_of(ctx).request("GET", f"/v1/templates/{name}", params=params).json(), output)


@app.command("list")
def list_(ctx: typer.Context, output: OutputOpt = Output.table) -> None:
    """List templates (each at its newest revision; every page of them)."""
    items = list(client_of(ctx).pages("/v1/templates", {"limit": 500}))
    if output is Output.json:
        print_json(items)
        return
    if not items:
        err.print("no templates")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "REVISION", "IMAGE", "UPDATED", "DESCRIPTION"):
        table.add_column(column)
    for t in items:
        table.add_row(t["name"], str(t["revision"]), t["spec"]["image"],
                      f"{age(t['updated_at'])} ago", t["description"])  # fmt: skip
    print_table(table)


@app.command("delete")
def delete(
    ctx: typer.Context,
    name: NameArg,
    expected_revision: ExpectedRevision = None,
    output: OutputOpt = Output.table,
) -> None:
    """Delete a template (sandboxes made from it are left alone)."""
    params = {"expected_revision": expected_revision} if expected_revision else None
    row = client_of(ctx).request("DELETE", f"/v1/templates/{name}", params=params).json()
    if output is Output.json:
        print_json(row)
    else:
        out.print(f"✓ Deleted template {name} (was at revision {row['revision']})")
