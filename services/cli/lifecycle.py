"""`sandstream sandbox hold | release | extend`: an operator's hold (start and restart are
refused while it lasts) and a new time to live. Each waits for its outcome, not for a phase."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from services.cli.client import ApiFailure, client_of, fail
from services.cli.lifecycle_options import (
    MaxRestartsOpt,
    RestartBackoffOpt,
    RestartChoice,
    duration_seconds,
    restart_body,
)
from services.cli.render import Output, OutputOpt, out, print_json
from services.cli.sandbox import (
    CommandIdOpt,
    ExpectedVersionOpt,
    TimeoutOpt,
    _command_body,
    _submit,
    app,
)


def _send(
    ctx: typer.Context,
    name: str,
    suffix: str,
    body: dict[str, Any],
    done: str,
    timeout: float,
    output: Output,
) -> None:
    client = client_of(ctx)
    try:
        outcome = _submit(
            client, "POST", f"/v1/sandboxes/{name}{suffix}", body, name, time.monotonic() + timeout
        )
    except ApiFailure as exc:
        if exc.body and exc.body.get("status") == "rejected":
            fail(f"rejected: {exc.message} ({exc.api_code})")
        raise
    if output is Output.json:
        print_json(outcome)
    elif outcome["message"].startswith("nothing to do"):
        out.print(f"✓ {outcome['message']}")
    else:
        out.print(f"✓ {done}")


@app.command("hold")
def hold(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name")],
    reason: Annotated[str, typer.Option("--reason", help="why (shown to whoever starts it)")],
    command_id: CommandIdOpt = None,
    expected_version: ExpectedVersionOpt = None,
    timeout: TimeoutOpt = 60.0,
    output: OutputOpt = Output.table,
) -> None:
    """Hold a sandbox: start and restart are refused, expiry and on-exit wait, until released."""
    body = {**_command_body(command_id, expected_version), "reason": reason}
    _send(ctx, name, ":hold", body, f"Held sandbox {name}: {reason}", timeout, output)


@app.command("release")
def release(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name")],
    command_id: CommandIdOpt = None,
    expected_version: ExpectedVersionOpt = None,
    timeout: TimeoutOpt = 60.0,
    output: OutputOpt = Output.table,
) -> None:
    """Release a held sandbox."""
    body = _command_body(command_id, expected_version)
    _send(ctx, name, ":release", body, f"Released sandbox {name}", timeout, output)


@app.command("extend")
def extend(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name")],
    ttl: Annotated[str, typer.Option("--ttl", help="expire this long from now: 90s, 30m, 2h, 7d")],
    command_id: CommandIdOpt = None,
    expected_version: ExpectedVersionOpt = None,
    timeout: TimeoutOpt = 60.0,
    output: OutputOpt = Output.table,
) -> None:
    """Set a sandbox's time to live anew, counted from now."""
    seconds = duration_seconds(ttl, "--ttl")
    body = {**_command_body(command_id, expected_version), "ttl_seconds": seconds}
    _send(ctx, name, ":extend", body, f"Sandbox {name} expires in {ttl}", timeout, output)


@app.command("restart-policy")
def restart_policy(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name")],
    policy: Annotated[RestartChoice, typer.Argument(help="Never, OnFailure or Always")],
    backoff: RestartBackoffOpt = None,
    max_restarts: MaxRestartsOpt = None,
    command_id: CommandIdOpt = None,
    expected_version: ExpectedVersionOpt = None,
    timeout: TimeoutOpt = 60.0,
    output: OutputOpt = Output.table,
) -> None:
    """Set a sandbox's restart policy, its back-off and its limit (each left out: the default).
    A scheduled restart the new policy would not make is cancelled."""
    body = {**_command_body(command_id, expected_version),
            **restart_body(policy, backoff, max_restarts)}  # fmt: skip
    _send(ctx, name, ":restart-policy", body, f"Sandbox {name} restarts: {policy}", timeout, output)


@app.command("idle-suspend")
def idle_suspend(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name")],
    after: Annotated[
        str, typer.Argument(help="suspend it once unused this long: 90s, 30m, 2h; off: never")
    ],
    command_id: CommandIdOpt = None,
    expected_version: ExpectedVersionOpt = None,
    timeout: TimeoutOpt = 60.0,
    output: OutputOpt = Output.table,
) -> None:
    """Set (or turn off) a sandbox's idle timeout: once Ready and unused through exec, files,
    logs or a watch of it this long, it is suspended; the next exec or file call resumes it."""
    seconds = None if after.strip().lower() == "off" else duration_seconds(after, "AFTER")
    body = {**_command_body(command_id, expected_version), "idle_suspend_seconds": seconds}
    said = f"suspended after {after} unused" if seconds is not None else "never idle-suspended"
    _send(ctx, name, ":idle-suspend", body, f"Sandbox {name} is {said}", timeout, output)
