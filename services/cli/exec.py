"""`sandstream sandbox exec NAME -- CMD...`: run a command in a Ready sandbox and stream its
output as it comes (stdout to stdout, stderr to stderr); the CLI exits with the command's exit
code (124 when the timeout ended it, as timeout(1) does; 1 when it could not run). Ctrl-C
leaves the stream, which ends the command."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Final

import typer

from services.cli.client import StreamBroken, client_of, fail
from services.cli.sandbox import app, pairs

EXIT_TIMED_OUT: Final = 124


@app.command("exec", no_args_is_help=True)
def exec_(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name", show_default=False)],
    command: Annotated[
        list[str],
        typer.Argument(help="the command and its arguments (after --)", show_default=False),
    ],
    env: Annotated[list[str], typer.Option("--env", "-e", help="KEY=VALUE (repeatable)")] = [],  # noqa: B006
    workdir: Annotated[
        str | None, typer.Option("--workdir", "-w", help="working directory in the sandbox")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            min=0.001,
            help="seconds until the command is ended (default and most: the server's limit)",
        ),
    ] = None,
    stdin: Annotated[
        bool, typer.Option("--stdin", "-i", help="send this command's standard input (UTF-8)")
    ] = False,
) -> None:
    """Run a command in a Ready sandbox; exit with its exit code."""
    body: dict[str, Any] = {"command": command, "env": pairs(env, "--env")}
    if workdir is not None:
        body["workdir"] = workdir
    if timeout is not None:
        body["timeout"] = timeout
    if stdin:
        body["stdin"] = sys.stdin.read()
    events = client_of(ctx).sse(
        "POST", f"/v1/sandboxes/{name}/exec", params={"stream": "true"}, json_body=body,
        read_timeout=None,
    )  # fmt: skip
    try:
        for event, _, data in events:
            if event in ("stdout", "stderr"):
                target = sys.stdout if event == "stdout" else sys.stderr
                target.write(data["data"])
                target.flush()
            elif event == "exit":
                if data.get("timed_out"):
                    print("✗ the command ran past its timeout: ended", file=sys.stderr)
                    raise typer.Exit(EXIT_TIMED_OUT)
                raise typer.Exit(int(data["exit_code"]))
            elif event in ("error", "denied"):  # denied: the token lapsed, the command ended
                fail(f"exec: {data.get('message')} ({data.get('code')})")
    except StreamBroken as exc:
        fail(f"exec: connection lost ({exc}); the command was ended")
    fail("exec: the stream ended without the command's exit")
