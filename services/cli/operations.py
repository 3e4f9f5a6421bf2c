"""`sandstream status | up | down | rebuild`: the control plane as a whole."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from services.cli.client import EXIT_FAILED, CliError, client_of, settings_of
from services.cli.render import Output, OutputOpt, out, print_json


def status(ctx: typer.Context, output: OutputOpt = Output.table) -> None:
    """Is the control plane up and ready? Kafka, PostgreSQL, processor lag, sandboxes."""
    try:  # with a token (ops:read) /readyz shows its checks; without one only ready or not
        client = client_of(ctx)
    except CliError:
        client = client_of(ctx, need_token=False)
    ready = client.request("GET", "/readyz", ok=(200, 503)).json()
    counts: dict[str, int] | None = None
    note = ""
    try:
        counts = {}
        for item in client_of(ctx).pages("/v1/sandboxes", {"limit": 500}):
            counts[item["phase"]] = counts.get(item["phase"], 0) + 1
    except CliError as exc:
        note = exc.message
    attention: dict[str, Any] | None = None
    if counts is not None:
        attention = client_of(ctx).request("GET", "/v1/attention").json()
    is_ready = ready.get("status") == "ready"
    if output is Output.json:
        print_json(
            {"url": client.url, "ready": is_ready, **ready, "sandboxes": counts,
             "attention": attention}
        )  # fmt: skip
    else:
        out.print(f"{'API':<12} {client.url}  {'ready' if is_ready else 'NOT READY'}")
        labels = {"processor_lag": "processor"}
        for check, result in ready.get("checks", {}).items():
            label = labels.get(check, check)
            out.print(f"{label:<12} {'ok' if result['ok'] else 'FAIL':<5} {result['detail']}")
        if counts is not None:
            total = sum(counts.values())
            detail = ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
            out.print(f"{'sandboxes':<12} {total} live" + (f": {detail}" if detail else ""))
        if attention is not None:
            soon = attention["expiring_within_seconds"]
            out.print(
                f"{'attention':<12} {attention['past_deadline']} past their deadline, "
                f"{attention['held']} held, {attention['expiring_soon']} expiring within "
                f"{soon:.0f}s"
            )
        else:
            out.print(f"{'sandboxes':<12} unknown ({note})")
    if not is_ready:
        raise typer.Exit(EXIT_FAILED)


def up_command(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option("--port", help="API port (default 8787)")] = None,
    host: Annotated[str | None, typer.Option("--host", help="API address")] = None,
    no_stack: Annotated[
        bool, typer.Option("--no-stack", help="do not start Kafka/PostgreSQL/Podman")
    ] = False,
    driver: Annotated[
        str | None, typer.Option("--driver", help="podman (default) or kubernetes")
    ] = None,
    kubeconfig: Annotated[
        Path | None, typer.Option("--kubeconfig", help="kubeconfig of the cluster (kubernetes)")
    ] = None,
    namespace: Annotated[
        str | None, typer.Option("--namespace", help="namespace of the sandbox Pods")
    ] = None,
    openshell_port: Annotated[
        int | None, typer.Option("--openshell-port", help="OpenShell gRPC port (default 8788)")
    ] = None,
    no_openshell: Annotated[
        bool, typer.Option("--no-openshell", help="do not serve OpenShell's gRPC API")
    ] = False,
    openshell_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--openshell-allow-unauthenticated",
            help="accept OpenShell calls without a token (loopback only, for local use; they "
            "hold SANDSTREAM_OPENSHELL_UNAUTHENTICATED_SCOPES)",
        ),
    ] = False,
) -> None:
    """Start the stack, the control plane and the API in the foreground (Ctrl-C stops)."""
    from services.up.up import up

    settings = settings_of(ctx)
    update: dict[str, Any] = {}
    if openshell_port is not None:
        update["openshell_port"] = openshell_port
    if no_openshell:
        update["openshell_enabled"] = False
    if openshell_unauthenticated:
        update["openshell_allow_unauthenticated"] = True
    if port is not None:
        update["api_port"] = port
    if host is not None:
        update["api_host"] = host
    if driver is not None:
        if driver not in ("podman", "kubernetes"):
            raise CliError(f"--driver: expected podman or kubernetes, got {driver!r}")
        update["driver"] = driver
    if kubeconfig is not None:
        update["kube_config"] = kubeconfig
    if namespace is not None:
        update["kube_namespace"] = namespace
    raise typer.Exit(up(settings.model_copy(update=update), start_stack=not no_stack))


def down_command(
    ctx: typer.Context,
    keep_stack: Annotated[
        bool, typer.Option("--keep-stack", help="stop only `sandstream up`, not the stack")
    ] = False,
) -> None:
    """Stop a running `sandstream up`, then the stack (Kafka, PostgreSQL, Podman)."""
    from services.up.up import down

    raise typer.Exit(down(settings_of(ctx), keep_stack=keep_stack))


def rebuild_command(
    ctx: typer.Context,
    keep_schema: Annotated[
        bool, typer.Option("--keep-schema", help="keep the rebuilt schema for inspection")
    ] = False,
    output: OutputOpt = Output.table,
) -> None:
    """Rebuild the rows from sandbox.events into a fresh schema and compare with the live rows.

    Talks to Kafka and PostgreSQL directly (settings from SANDSTREAM_* variables); exits 1 when
    the rebuilt rows differ from the live ones.
    """
    import asyncio

    from events.log_reader import LogTruncated
    from services.processor.rebuild import rebuild_and_compare

    try:
        report = asyncio.run(rebuild_and_compare(settings_of(ctx), keep_schema=keep_schema))
    except LogTruncated as exc:  # said plainly: the log cannot be replayed
        raise CliError(f"cannot rebuild: {exc}") from None
    if output is Output.json:
        print_json(
            {
                "equal": report.equal,
                "rebuilt": report.rebuilt,
                "live": report.live,
                "schema": report.schema if keep_schema else None,
                "differences": report.differences,
            }
        )
    else:
        mark = "✓" if report.equal else "✗"
        out.print(f"{mark} rebuilt {report.rebuilt} rows from the log, {report.live} live rows")
        for line in report.differences:
            out.print(f"  differs: {line}")
        if keep_schema:
            out.print(f"  rebuilt rows kept in schema {report.schema}")
    if not report.equal:
        raise typer.Exit(EXIT_FAILED)


# Registered on the root app in this order (the order of `sandstream --help`).
COMMANDS = (
    ("status", status),
    ("up", up_command),
    ("down", down_command),
    ("rebuild", rebuild_command),
)
