"""`sandstream pool ...`: warm pools: create, list, get (the status: members by phase, claims
warm and cold, hit rate, claim latency), scale, update, delete.

A write without ``--revision`` is based on the revision it reads first: a change made by
someone else in between is refused (409), never overwritten.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from services.cli.client import Client, client_of
from services.cli.render import Output, OutputOpt, clock, dash, print_json, print_table

app = typer.Typer(help="Warm pools: Ready members of a template, adopted by creates from it.")

RevisionOpt = Annotated[
    int | None,
    typer.Option(
        "--revision", min=1, help="the pool revision this change is based on (default: the "
        "one read just before)", show_default=False,
    ),
]  # fmt: skip
StrategyOpt = Annotated[
    str | None,
    typer.Option(
        "--strategy", help="on a template change: Recreate (replace unclaimed members now) or "
        "OnReplenish (as they are claimed)", show_default=False,
    ),
]  # fmt: skip


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def show(pool: dict[str, Any], output: Output) -> None:
    if output is Output.json:
        print_json(pool)
        return
    s = pool["status"]
    members = ", ".join(f"{k} {v}" for k, v in sorted(s["members"].items())) or "none"
    print(f"pool {pool['name']} (revision {pool['revision']}): template {pool['template']} "
          f"(revision {dash(s['template_revision'])}), size {pool['size']}, "
          f"{pool['strategy']}")  # fmt: skip
    print(f"members: {members}; requested {s['requested']}, outdated {s['outdated']}, "
          f"claimed {s['claimed']}")  # fmt: skip
    if s["problem"]:
        print(f"problem: {s['problem']}")
    claims = s["claims"]
    rate = claims["hit_rate"]
    print(f"claims: warm {claims['warm']['count']}, cold {claims['cold']['count']}, hit rate "
          + ("-" if rate is None else f"{rate:.0%}"))  # fmt: skip
    table = Table("PATH", "CLAIMS", "P50", "P90", "P99", box=None, pad_edge=False)
    for path in ("warm", "cold"):
        c = claims[path]
        table.add_row(path, str(c["count"]), _seconds(c["p50_seconds"]),
                      _seconds(c["p90_seconds"]), _seconds(c["p99_seconds"]))  # fmt: skip
    print_table(table)


def _current(client: Client, name: str) -> int:
    revision: int = client.request("GET", f"/v1/pools/{name}").json()["revision"]
    return revision


def _update(ctx: typer.Context, name: str, revision: int | None, **changes: Any) -> Any:
    client = client_of(ctx)
    body = {k: v for k, v in changes.items() if v is not None}
    body["expected_revision"] = revision if revision is not None else _current(client, name)
    return client.request("PATCH", f"/v1/pools/{name}", json_body=body).json()


@app.command("create")
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the pool name (at most 54 characters)")],
    template: Annotated[str, typer.Option("--template", help="the template of its members")],
    size: Annotated[int, typer.Option("--size", min=0, help="members to keep Ready")],
    strategy: StrategyOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Create a warm pool; the controller then keeps SIZE members of TEMPLATE Ready."""
    body: dict[str, Any] = {"name": name, "template": template, "size": size}
    if strategy is not None:
        body["strategy"] = strategy
    show(client_of(ctx).request("POST", "/v1/pools", json_body=body, ok=(201,)).json(), output)


@app.command("get")
def get(ctx: typer.Context, name: str, output: OutputOpt = Output.table) -> None:
    """One pool and its status: members by phase, claims warm and cold, hit rate, latency."""
    show(client_of(ctx).request("GET", f"/v1/pools/{name}").json(), output)


@app.command("list")
def list_(ctx: typer.Context, output: OutputOpt = Output.table) -> None:
    """Every pool, with its Ready members and hit rate."""
    items = client_of(ctx).request("GET", "/v1/pools").json()["items"]
    if output is Output.json:
        print_json(items)
        return
    table = Table("NAME", "TEMPLATE", "SIZE", "READY", "STRATEGY", "HIT RATE", "UPDATED",
                  box=None, pad_edge=False)  # fmt: skip
    for p in items:
        rate = p["status"]["claims"]["hit_rate"]
        table.add_row(p["name"], p["template"], str(p["size"]), str(p["status"]["ready"]),
                      p["strategy"], "-" if rate is None else f"{rate:.0%}",
                      clock(p["updated_at"]))  # fmt: skip
    print_table(table) if items else print("no pools")


@app.command("scale")
def scale(
    ctx: typer.Context,
    name: str,
    size: Annotated[int, typer.Argument(min=0, help="members to keep Ready (0: none)")],
    revision: RevisionOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Set a pool's size: up creates members, down deletes unclaimed ones (Ready ones last)."""
    show(_update(ctx, name, revision, size=size), output)


@app.command("update")
def update(
    ctx: typer.Context,
    name: str,
    size: Annotated[int | None, typer.Option("--size", min=0, show_default=False)] = None,
    strategy: StrategyOpt = None,
    template: Annotated[
        str | None, typer.Option("--template", help="another template", show_default=False)
    ] = None,
    revision: RevisionOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Change a pool's size, strategy or template (its members roll by the strategy)."""
    show(_update(ctx, name, revision, size=size, strategy=strategy, template=template), output)


@app.command("delete")
def delete(
    ctx: typer.Context, name: str, revision: RevisionOpt = None, output: OutputOpt = Output.table
) -> None:
    """Delete a pool: its unclaimed members are deleted, claimed sandboxes stay."""
    params = {"expected_revision": revision} if revision is not None else None
    deleted = client_of(ctx).request("DELETE", f"/v1/pools/{name}", params=params).json()
    if output is Output.json:
        print_json(deleted)
    else:
        print(f"pool {name} deleted; its unclaimed members are being deleted")
