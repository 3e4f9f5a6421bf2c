"""`sandstream sandbox create`: a sandbox from a spec (the options) or from a template
(``--template``, with the overrides a template allows)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import typer

from services.cli.lifecycle_options import (
    ExitChoice,
    ExpiryChoice,
    MaxRestartsOpt,
    RestartBackoffOpt,
    RestartChoice,
    duration_seconds,
    restart_body,
)
from services.cli.render import Output, OutputOpt
from services.cli.sandbox import (
    CommandIdOpt,
    NoWaitOpt,
    TimeoutOpt,
    _lifecycle,
    app,
    pairs,
)


def spec_body(
    image: str,
    command: list[str] | None,
    env: list[str],
    label: list[str],
    stop_timeout: int | None,
    restart: dict[str, Any],
) -> dict[str, Any]:
    """A spec from the options of `sandbox create` and `template create`."""
    spec: dict[str, Any] = {
        "image": image,
        "command": list(command or []),
        "env": pairs(env, "--env"),
        "labels": pairs(label, "--label"),
    }
    if stop_timeout is not None:
        spec["stop_timeout_seconds"] = stop_timeout
    return spec | restart


def template_ref(text: str) -> dict[str, Any]:
    """``NAME`` or ``NAME:REVISION`` as the API's template reference."""
    name, sep, revision = text.partition(":")
    if not sep:
        return {"name": name}
    if not revision.isdigit() or int(revision) < 1:
        raise typer.BadParameter(
            f"expected NAME or NAME:REVISION, got {text!r}", param_hint="--template"
        )
    return {"name": name, "revision": int(revision)}


@app.command("create")
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name (a DNS label)")],
    image: Annotated[
        str | None,
        typer.Option("--image", help="container image (or --template)", show_default=False),
    ] = None,
    template: Annotated[
        str | None,
        typer.Option(
            "--template",
            help="make it from this template: NAME or NAME:REVISION (then only --env, --label, "
            "--ttl and --provider may be given: env added or replaced, labels and providers "
            "added)",
            show_default=False,
        ),
    ] = None,
    command: Annotated[
        list[str] | None, typer.Argument(help="the command to run (after --)", show_default=False)
    ] = None,
    label: Annotated[list[str], typer.Option("--label", help="KEY=VALUE (repeatable)")] = [],  # noqa: B006
    env: Annotated[list[str], typer.Option("--env", help="KEY=VALUE (repeatable)")] = [],  # noqa: B006
    provider: Annotated[
        list[str], typer.Option("--provider", help="credential provider (repeatable)")
    ] = [],  # noqa: B006
    stop_timeout: Annotated[
        int | None, typer.Option("--stop-timeout", min=0, help="seconds from SIGTERM to SIGKILL")
    ] = None,
    ttl: Annotated[
        str | None,
        typer.Option("--ttl", help="time to live, e.g. 90s, 30m, 2h, 7d (default: the server's)"),
    ] = None,
    on_expiry: Annotated[
        ExpiryChoice | None,
        typer.Option("--on-expiry", help="what the end of the ttl does [default: stop]"),
    ] = None,
    on_exit: Annotated[
        ExitChoice | None,
        typer.Option(
            "--on-exit", help="delete: delete it once its main process ended [default: keep]"
        ),
    ] = None,
    restart_policy: Annotated[
        RestartChoice | None,
        typer.Option(
            "--restart-policy",
            help="restart it after its main process ends: OnFailure (non-zero exit, vanished, "
            "failed launch) or Always (also exit 0); default Never",
        ),
    ] = None,
    restart_backoff: RestartBackoffOpt = None,
    max_restarts: MaxRestartsOpt = None,
    command_id: CommandIdOpt = None,
    timeout: TimeoutOpt = 120.0,
    no_wait: NoWaitOpt = False,
    output: OutputOpt = Output.table,
) -> None:
    """Create a sandbox (from a spec or a template) and wait until it is Ready."""
    body: dict[str, Any] = {"name": name, "providers": provider}
    if template is not None:
        given = {"--image": image, "--stop-timeout": stop_timeout, "--on-expiry": on_expiry,
                 "--on-exit": on_exit, "--restart-policy": restart_policy,
                 "--restart-backoff": restart_backoff, "--max-restarts": max_restarts,
                 "COMMAND": command or None}  # fmt: skip
        for option, value in given.items():
            if value is not None:
                raise typer.BadParameter(
                    "set by the template; not with --template", param_hint=option
                )
        body["template"] = template_ref(template)
        body["overrides"] = {"env": pairs(env, "--env"), "labels": pairs(label, "--label")}
    else:
        if image is None:
            raise typer.BadParameter("needed (or --template)", param_hint="--image")
        restart = restart_body(restart_policy, restart_backoff, max_restarts)
        body["spec"] = spec_body(image, command, env, label, stop_timeout, restart)
        body["on_expiry"] = (on_expiry or ExpiryChoice.stop).value
        body["on_exit"] = (on_exit or ExitChoice.keep).value
    if ttl is not None:
        body["ttl_seconds"] = duration_seconds(ttl, "--ttl")
    body["command_id"] = command_id or f"cli-{uuid.uuid4().hex}"  # the same on every retry
    _lifecycle(ctx, "create", name, "POST", "/v1/sandboxes", body,
               timeout=timeout, no_wait=no_wait, output=output)  # fmt: skip
