"""`sandstream provider ...`, `sandstream sandbox attach|detach` and `sandstream provider-sync`.

Values come from ``--from-file`` (``KEY=VALUE`` lines, ``#`` comments) or ``--from-env NAME``
(the value of this process's variable NAME), never from the command line itself, so they stay
out of shell history and process listings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from services.cli import sandbox
from services.cli.client import Client, fail
from services.cli.render import Output, OutputOpt, clock, print_json, print_table
from services.cli.roles import HealthHost, HealthPort, PortFile, run_role_command
from services.cli.sandbox import CommandIdOpt
from services.common.entrypoint import LOG_FORMAT
from services.common.settings import Settings

if TYPE_CHECKING:
    from services.provider_sync.sources import Source

app = typer.Typer(help="Credential providers: values in, key names and fingerprints out.")

FromFile = Annotated[
    Path | None,
    typer.Option("--from-file", help="KEY=VALUE lines (# comments)", show_default=False),
]
FromEnv = Annotated[
    list[str],
    typer.Option("--from-env", help="take KEY's value from this environment (repeatable)"),
]
NoRestart = Annotated[
    bool, typer.Option("--no-restart", help="restart no one: values apply at the next start")
]
RetryOpt = Annotated[
    float,
    typer.Option(
        "--timeout", min=0.1, help="seconds to keep resending a write the API did not answer"
    ),
]


def _write(
    client: Client,
    method: str,
    path: str,
    body: dict[str, Any],
    command_id: str | None,
    timeout: float,
    **request: Any,
) -> Any:
    """A provider write's answer (JSON). The request id is chosen here, once, and every resend
    (``Client.retried``: a timeout, no connection, a 503) carries it: the API answers a repeat
    with the first outcome, so a resent rotation restarts no one twice."""
    sent = {**body, "command_id": command_id or f"cli-{uuid.uuid4().hex}"}

    def send() -> Any:
        return client.request(method, path, json_body=sent, transport_errors=True, **request)

    return client.retried(send, time.monotonic() + timeout).json()


def read_values(from_file: Path | None, from_env: list[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    if from_file is not None:
        try:
            text = from_file.read_text()
        except OSError as exc:
            fail(f"cannot read {from_file}: {exc.strerror}")
        except UnicodeDecodeError as exc:  # the bytes are not shown: they may be a secret
            fail(f"cannot read {from_file}: not UTF-8 text (at byte {exc.start})")
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                fail(f"{from_file}:{number}: expected KEY=VALUE")  # the line is not shown
            values[key.strip()] = value
    for name in from_env:
        if name not in os.environ:
            fail(f"--from-env {name}: not set in this environment")
        values[name] = os.environ[name]
    return values


def _client(ctx: typer.Context) -> Client:
    return Client(ctx.obj["settings"], ctx.obj["connection"])


def _show(provider: dict[str, Any], output: Output) -> None:
    if output is Output.json:
        print_json(provider)
        return
    table = Table("KEY", "FINGERPRINT", "UPDATED", box=None, pad_edge=False)
    for key in provider["keys"]:
        table.add_row(key["name"], key["fingerprint"][:24] + "…", clock(key["updated_at"]))
    print(f"provider {provider['name']} (type {provider['type']}, revision "
          f"{provider['revision']})")  # fmt: skip
    print_table(table)


def show_receipt(receipt: dict[str, Any], output: Output) -> None:
    if output is Output.json:
        print_json(receipt)
        return
    for change in receipt["providers"]:
        parts = [f"{k} {', '.join(change[k])}" for k in ("baseline", "rotated", "removed")
                 if change[k]]  # fmt: skip
        print(f"provider {change['name']} revision {change['revision']}: "
              + ("; ".join(parts) or "unchanged"))  # fmt: skip
    if not receipt["sandboxes"]:
        print("no attached sandbox is affected")
    else:
        table = Table("SANDBOX", "PROVIDERS", "ACTION", "WHY", box=None, pad_edge=False)
        for line in receipt["sandboxes"]:
            table.add_row(line["sandbox"], ", ".join(line["providers"]), line["action"],
                          line["reason"])  # fmt: skip
        print_table(table)
    pending = [line["sandbox"] for line in receipt["sandboxes"] if line["delivery"] == "pending"]
    if pending:
        print(f"pending: Kafka has not acknowledged the commands for {', '.join(pending)} yet; "
              "they are stored with the values and sent until it does")  # fmt: skip


@app.command("create")
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the provider name")],
    type_: Annotated[str, typer.Option("--type", help="the kind of credential")] = "generic",
    from_file: FromFile = None,
    from_env: FromEnv = [],  # noqa: B006
    command_id: CommandIdOpt = None,
    timeout: RetryOpt = 60.0,
    output: OutputOpt = Output.table,
) -> None:
    """Create a provider; its first values are a baseline (nothing restarts)."""
    body = {"name": name, "type": type_, "credentials": read_values(from_file, from_env)}
    created = _write(_client(ctx), "POST", "/v1/providers", body, command_id, timeout, ok=(201,))
    _show(created, output)


@app.command("get")
def get(ctx: typer.Context, name: str, output: OutputOpt = Output.table) -> None:
    """One provider: key names and fingerprints (never values)."""
    _show(_client(ctx).request("GET", f"/v1/providers/{name}").json(), output)


@app.command("list")
def list_(ctx: typer.Context, output: OutputOpt = Output.table) -> None:
    """Every provider."""
    items = list(_client(ctx).pages("/v1/providers", {"limit": 500}))
    if output is Output.json:
        print_json(items)
        return
    table = Table("NAME", "TYPE", "KEYS", "REVISION", "UPDATED", box=None, pad_edge=False)
    for p in items:
        table.add_row(p["name"], p["type"], ", ".join(k["name"] for k in p["keys"]),
                      str(p["revision"]), clock(p["updated_at"]))  # fmt: skip
    print_table(table) if items else print("no providers")


@app.command("update")
def update(
    ctx: typer.Context,
    name: str,
    from_file: FromFile = None,
    from_env: FromEnv = [],  # noqa: B006
    no_restart: NoRestart = False,
    command_id: CommandIdOpt = None,
    timeout: RetryOpt = 60.0,
    output: OutputOpt = Output.table,
) -> None:
    """Replace a provider's values (keys left out are removed); prints what happens to every
    attached sandbox."""
    values = read_values(from_file, from_env)
    if not values:
        fail("no values: pass --from-file and/or --from-env")
    body = {"credentials": values, "no_restart": no_restart}
    path = f"/v1/providers/{name}/credentials"
    show_receipt(_write(_client(ctx), "PUT", path, body, command_id, timeout), output)


@app.command("delete")
def delete(
    ctx: typer.Context,
    name: str,
    force: Annotated[bool, typer.Option("--force", help="detach it everywhere first")] = False,
    no_restart: Annotated[
        bool,
        typer.Option(
            "--no-restart",
            help="with --force: Ready sandboxes keep running (its values leave at their next "
            "start) instead of restarting without it",
        ),
    ] = False,
    command_id: CommandIdOpt = None,
    timeout: RetryOpt = 60.0,
) -> None:
    """Delete a provider (refused while attached unless --force, and while a template names
    it even with --force; a Ready sandbox it is detached from restarts without its values)."""
    params = {"force": str(force).lower(), "no_restart": str(no_restart).lower()}
    path = f"/v1/providers/{name}"
    result = _write(_client(ctx), "DELETE", path, {}, command_id, timeout, params=params)
    detached = f" (detached from {', '.join(result['detached'])})" if result["detached"] else ""
    print(f"✓ Deleted provider {name}{detached}")
    if result["unsent"]:
        print(f"pending: Kafka has not acknowledged {len(result['unsent'])} detach commands yet; "
              "they are stored and sent until it does")  # fmt: skip


SandboxName = Annotated[str, typer.Argument(help="the sandbox name")]
ProviderArg = Annotated[str, typer.Argument(help="the provider name")]


def _attachment(ctx: typer.Context, name: str, suffix: str, body: dict[str, Any],
                output: Output) -> None:  # fmt: skip
    outcome = (
        _client(ctx)
        .request(
            "POST",
            f"/v1/sandboxes/{name}{suffix}",
            json_body=body,
            params={"wait": "30"},
            ok=(200, 202),
        )
        .json()
    )
    if output is Output.json:
        print_json(outcome)
    elif outcome["status"] == "rejected":
        fail(f"rejected: {outcome['message']} ({outcome['code']})")
    else:
        print(f"✓ {outcome['message']}")


@sandbox.app.command("attach")
def attach(
    ctx: typer.Context, name: SandboxName, provider: ProviderArg, output: OutputOpt = Output.table
) -> None:
    """Attach a provider (applies at the sandbox's next start)."""
    _attachment(ctx, name, ":attach", {"provider": provider}, output)


@sandbox.app.command("detach")
def detach(
    ctx: typer.Context,
    name: SandboxName,
    provider: ProviderArg,
    no_restart: Annotated[
        bool,
        typer.Option(
            "--no-restart", help="keep a Ready sandbox running: the values leave at its next start"
        ),
    ] = False,
    output: OutputOpt = Output.table,
) -> None:
    """Detach a provider: a Ready sandbox restarts without its values (unless --no-restart)."""
    body = {"provider": provider, "no_restart": no_restart}
    _attachment(ctx, name, ":detach", body, output)


def provider_sync(
    ctx: typer.Context,
    directory: Annotated[
        Path | None, typer.Option("--dir", help="one folder per provider, a file per key")
    ] = None,
    kube_selector: Annotated[
        str | None,
        typer.Option(
            "--kube-selector", help="label selector of Kubernetes Secrets, one per provider"
        ),
    ] = None,
    kube_namespace: Annotated[
        str | None,
        typer.Option("--kube-namespace", help="their namespace (default: the driver's)"),
    ] = None,
    no_restart: NoRestart = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="seconds")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="one reconcile, then exit")] = False,
    health_port: HealthPort = None,
    health_host: HealthHost = None,
    port_file: PortFile = None,
) -> None:
    """Keep providers in step with a directory (the layout of a mounted Kubernetes Secret) or
    with Kubernetes Secrets selected by label; one instance is active (a lease)."""
    from services.provider_sync.controller import sync_source

    settings: Settings = ctx.obj["settings"]
    if (directory is None) == (kube_selector is None):
        raise typer.BadParameter("give one of --dir and --kube-selector")
    if once:
        source = sync_source(settings, directory, kube_selector, kube_namespace)
        assert source is not None
        asyncio.run(_sync_once(settings, source, not no_restart))
        return
    from services.roles.provider_sync import ProviderSyncRole

    role = ProviderSyncRole(settings, directory=directory, kube_selector=kube_selector,
                            kube_namespace=kube_namespace, restart=not no_restart,
                            interval=interval)  # fmt: skip
    run_role_command(role, settings, health_host, health_port, port_file)


async def _sync_once(settings: Settings, source: Source, restart: bool) -> None:
    from services.provider_sync.controller import ProviderSync
    from services.provider_sync.service import open_service

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    async with open_service(settings) as service:
        sync = ProviderSync(service, source, restart=restart)
        try:
            receipt = await sync.reconcile()
        finally:
            await source.close()
        print("nothing changed" if receipt is None else
              f"updated {', '.join(a.change.provider for a in receipt.applied)}"
              + (f" ({len(receipt.unsent)} commands pending: the API sends them)"
                 if receipt.unsent else ""))  # fmt: skip
