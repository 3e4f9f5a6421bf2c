"""`sandstream sandbox ...`: create, inspect and control sandboxes; lifecycle commands wait for
the phase they asked for."""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
import typer
from rich.table import Table

from services.api.readmodel import input_label
from services.cli.client import (
    EXIT_TIMEOUT,
    MAX_SERVER_WAIT,
    ApiFailure,
    Client,
    StreamBroken,
    client_of,
    fail,
)
from services.cli.lifecycle_options import (
    lifecycle_fields,
)
from services.cli.render import (
    Output,
    OutputOpt,
    age,
    clock,
    dash,
    err,
    out,
    print_json,
    print_table,
)

app = typer.Typer(help="Create, inspect and control sandboxes.", no_args_is_help=True)

TimeoutOpt = Annotated[
    float, typer.Option("--timeout", min=0.1, help="seconds to wait for the phase asked for")
]
NoWaitOpt = Annotated[
    bool, typer.Option("--no-wait", help="return once the command is accepted, without waiting")
]
CommandIdOpt = Annotated[
    str | None, typer.Option("--command-id", help="idempotency key (a retry gets the outcome)")
]
ExpectedVersionOpt = Annotated[
    int | None,
    typer.Option(
        "--expected-version",
        min=0,
        help="fail (ABORTED) unless at this version (restart: the version read first)",
    ),
]


def pairs(values: list[str], what: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected {what} as KEY=VALUE, got {item!r}")
        result[key] = value
    return result


def providers_text(row: dict[str, Any]) -> str:
    """The attached providers' names, saying which a claim attached (their values reach the
    sandbox's execs: its process was started before the claim)."""
    text = ", ".join(row["providers"]) or "-"
    claimed = row.get("claim_providers") or []
    return (
        f"{text} (attached by its claim, reaching each exec: {', '.join(claimed)})"
        if claimed
        else text
    )


def template_text(ref: dict[str, Any] | None) -> str:
    return f"{ref['name']} revision {ref['revision']}" if ref else "-"


# Lifecycle commands: submit, then wait for the phase asked for


@dataclass(frozen=True)
class Goal:
    verb: str  # shown while waiting: "Creating"
    done: str  # shown when done: "Created"
    phase: str  # the phase asked for


GOALS = {
    "create": Goal("Creating", "Created", "Ready"),
    "stop": Goal("Stopping", "Stopped", "Stopped"),
    "start": Goal("Starting", "Started", "Ready"),
    "restart": Goal("Restarting", "Restarted", "Ready"),
    "suspend": Goal("Suspending", "Suspended", "Suspended"),
    "resume": Goal("Resuming", "Resumed", "Ready"),
    "delete": Goal("Deleting", "Deleted", "Deleted"),
}
SETTLED = ("Ready", "Stopped", "Suspended", "Completed", "Error", "Deleted")


def _submit(
    client: Client,
    method: str,
    path: str,
    body: dict[str, Any],
    name: str,
    deadline: float,
) -> dict[str, Any]:
    """Send a command and return its decided outcome (waiting for it), or fail.

    A request that times out, cannot connect or gets a 503 is sent again, unchanged (the same
    command_id, the same expected_version), until the deadline: the API answers a repeat with
    the first outcome, so a retry never runs a command twice."""

    def send() -> httpx.Response:
        wait = max(0.0, min(MAX_SERVER_WAIT, deadline - time.monotonic()))
        return client.request(
            method,
            path,
            json_body=body,
            params={"wait": f"{wait:.3f}"},
            timeout=wait + 30,
            ok=(200, 201, 202),
            transport_errors=True,
        )

    response = client.retried(send, deadline)
    outcome: dict[str, Any] = response.json()
    while outcome["status"] == "pending":
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            fail(
                f"timed out waiting for the outcome of command {outcome['command_id']}",
                EXIT_TIMEOUT,
            )
        wait = min(MAX_SERVER_WAIT, remaining)
        outcome = client.request(
            "GET",
            f"/v1/commands/{outcome['command_id']}",
            params={"sandbox": name, "wait": f"{wait:.3f}"},
            timeout=wait + 30,
        ).json()
    if outcome["status"] == "rejected":  # decided after the first wait ran out
        fail(f"rejected: {outcome['message']} ({outcome['code']})")
    return outcome


def _verdict(goal: Goal, row: dict[str, Any], outcome: dict[str, Any]) -> bool | str:
    """True: reached; a string: failed, why; False: keep waiting."""
    if row["version"] < (outcome.get("version") or 0):
        return False  # older than the decision
    phase = row["phase"]
    if goal.phase == "Ready" and row["generation"] < (outcome.get("generation") or 0):
        return False
    if phase == goal.phase or (goal.phase == "Stopped" and phase == "Suspended"):
        return True  # a stop has nothing to do where nothing runs (the server said so)
    if phase in SETTLED:
        why = f"sandbox {row['name']} is {phase}"
        if row.get("reason"):
            why += f": {row['reason']}"
        elif phase in ("Completed", "Error") and row.get("exit_code") is not None:
            why += f" (exit code {row['exit_code']})"
        return why + f" (generation {row['generation']})"
    return False


def _await_phase(
    client: Client, goal: Goal, name: str, outcome: dict[str, Any], deadline: float
) -> dict[str, Any]:
    """Follow the sandbox's changes until it reaches the goal; the row it reached."""
    last: dict[str, Any] | None = None
    with err.status(f"{goal.verb} sandbox {name}…") as status:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                phase = last["phase"] if last else "unknown"
                fail(
                    f"timed out waiting for sandbox {name} to be {goal.phase} "
                    f"(current phase: {phase})",
                    EXIT_TIMEOUT,
                )
            params = {
                "name": name,
                "include_deleted": "true",
                "timeout": f"{max(remaining, 0.001):.3f}",
            }
            try:
                for event, _, data in client.events(params, read_timeout=remaining + 30):
                    if event == "denied":  # the token lapsed: following again would be refused
                        fail(data["message"])
                    if event != "sandbox":
                        continue
                    last = data
                    status.update(f"{goal.verb} sandbox {name}… ({data['phase']})")
                    verdict = _verdict(goal, data, outcome)
                    if verdict is True:
                        return data
                    if isinstance(verdict, str):
                        fail(verdict)
            except StreamBroken:
                time.sleep(0.2)  # the API went away for a moment: follow again


def _lifecycle(
    ctx: typer.Context,
    kind: str,
    name: str,
    method: str,
    path: str,
    body: dict[str, Any],
    *,
    timeout: float,
    no_wait: bool,
    output: Output,
) -> None:
    client = client_of(ctx)
    goal = GOALS[kind]
    deadline = time.monotonic() + timeout
    try:
        with err.status(f"{goal.verb} sandbox {name}…"):
            outcome = _submit(client, method, path, body, name, deadline)
    except ApiFailure as exc:
        if exc.body and exc.body.get("status") == "rejected":
            fail(f"rejected: {exc.message} ({exc.api_code})")
        raise
    if no_wait:
        if output is Output.json:
            print_json(outcome)
        else:
            out.print(f"✓ {outcome['message']}")
        return
    row = _await_phase(client, goal, name, outcome, deadline)
    if output is Output.json:
        print_json(row)
    elif kind == "delete":
        out.print(f"✓ Deleted sandbox {name}")
    else:
        out.print(f"✓ {goal.done} sandbox {name} (generation {row['generation']})")
    claim = outcome.get("claim")
    if claim and output is not Output.json:  # a create from a template with a warm pool
        path = "warm" if claim["warm"] else "cold"
        out.print(f"  {path} (pool {claim['pool']}): {claim['reason']}", markup=False)


# ---------------------------------------------------------------------------------------------
# sandbox commands


# Commands that mint a new generation each time they are applied: run twice, they restart
# twice. By default the CLI sends the version it read as expected_version, so a command that
# was applied after all (its answer lost) cannot be applied a second time.
NOT_IDEMPOTENT = frozenset({"restart"})


def _command_body(command_id: str | None, expected_version: int | None) -> dict[str, Any]:
    # The id is chosen here, once: every retry of this invocation sends the same one.
    body: dict[str, Any] = {"command_id": command_id or f"cli-{uuid.uuid4().hex}"}
    if expected_version is not None:
        body["expected_version"] = expected_version
    return body


def _seen_version(ctx: typer.Context, name: str) -> int | None:
    """The sandbox's current version, or None when it does not exist (the command is then
    rejected with NOT_FOUND by the API as usual)."""
    try:
        row = client_of(ctx).request("GET", f"/v1/sandboxes/{name}").json()
    except ApiFailure as exc:
        if exc.status == 404:
            return None
        raise
    return int(row["version"])


def _register_lifecycle(verb: str, method: str, suffix: str, doc: str) -> None:
    """Register `sandstream sandbox VERB NAME`: send the command, wait for its phase."""

    def command(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(help="the sandbox name")],
        command_id: CommandIdOpt = None,
        expected_version: ExpectedVersionOpt = None,
        timeout: TimeoutOpt = 120.0,
        no_wait: NoWaitOpt = False,
        output: OutputOpt = Output.table,
    ) -> None:
        if expected_version is None and verb in NOT_IDEMPOTENT:
            expected_version = _seen_version(ctx, name)
        _lifecycle(ctx, verb, name, method, f"/v1/sandboxes/{name}{suffix}",
                   _command_body(command_id, expected_version),
                   timeout=timeout, no_wait=no_wait, output=output)  # fmt: skip

    command.__doc__ = doc
    app.command(verb)(command)


_register_lifecycle(
    "stop", "POST", ":stop", "Stop a sandbox (its workspace is kept) and wait until it is Stopped."
)
_register_lifecycle(
    "start", "POST", ":start", "Start a stopped sandbox (a new generation) and wait until Ready."
)
_register_lifecycle(
    "restart", "POST", ":restart", "Restart a sandbox (a new generation) and wait until Ready."
)
_register_lifecycle(
    "suspend",
    "POST",
    ":suspend",
    "Suspend a sandbox (its runtime removed, its workspace and everything else kept) and wait "
    "until it is Suspended.",
)
_register_lifecycle(
    "resume",
    "POST",
    ":resume",
    "Resume a suspended sandbox (a new generation on the same workspace) and wait until Ready.",
)
_register_lifecycle(
    "delete", "DELETE", "", "Delete a sandbox (runtime and workspace) and wait until it is gone."
)


@app.command("list")
def list_(
    ctx: typer.Context,
    phase: Annotated[list[str], typer.Option("--phase", help="only this phase (repeatable)")] = [],  # noqa: B006
    label: Annotated[
        list[str], typer.Option("--label", help="KEY=VALUE or KEY (repeatable, ANDed)")
    ] = [],  # noqa: B006
    all_: Annotated[bool, typer.Option("--all", "-a", help="include deleted (tombstones)")] = False,
    output: OutputOpt = Output.table,
) -> None:
    """List sandboxes: NAME, PHASE, GENERATION, AGE."""
    params: dict[str, Any] = {"phase": phase, "label": label, "limit": 500}
    if all_:
        params["include_deleted"] = "true"
    items = list(client_of(ctx).pages("/v1/sandboxes", params))
    if output is Output.json:
        print_json(items)
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("NAME", "PHASE", "GENERATION", "AGE"):
        table.add_column(column, no_wrap=True)
    for item in items:
        table.add_row(item["name"], item["phase"], str(item["generation"]), age(item["created_at"]))
    if not items:
        err.print("no sandboxes")
        return
    print_table(table)


@app.command("get")
def get(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name")],
    output: OutputOpt = Output.table,
) -> None:
    """Show one sandbox."""
    row = client_of(ctx).request("GET", f"/v1/sandboxes/{name}").json()
    if output is Output.json:
        print_json(row)
        return
    spec = row["spec"]
    conditions = ", ".join(f"{c['type']}={c['status']}" for c in row["conditions"])
    fields = [
        ("Name", row["name"]),
        ("ID", row["id"]),
        ("Phase", row["phase"]),
        ("Generation", row["generation"]),
        ("Version", row["version"]),
        ("Image", spec["image"]),
        ("Command", " ".join(spec["command"]) or "(image default)"),
        ("Env", ", ".join(sorted(spec["env"])) or "-"),
        ("Labels", ", ".join(f"{k}={v}" for k, v in sorted(row["labels"].items())) or "-"),
        ("Providers", providers_text(row)),
        ("Template", template_text(row.get("template"))),
        ("Conditions", conditions),
        ("Exit code", dash(row["exit_code"])),
        ("Reason", dash(row["reason"])),
        ("Created", f"{row['created_at']} ({age(row['created_at'])} ago)"),
        ("Updated", row["updated_at"]),
        *lifecycle_fields(row),
    ]
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in fields:
        table.add_row(key, str(value))
    print_table(table)


@app.command("history")
def history(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name")],
    incarnation: Annotated[
        str | None, typer.Option(help="only this incarnation (a sandbox id)", show_default=False)
    ] = None,
    generation: Annotated[
        int | None, typer.Option(min=1, help="only inputs about this generation")
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Every input about a sandbox in order: applied, rejected and ignored, with the reason."""
    params: dict[str, Any] = {"limit": 1000}
    if incarnation is not None:
        params["incarnation"] = incarnation
    if generation is not None:
        params["generation"] = generation
    items = list(client_of(ctx).pages(f"/v1/sandboxes/{name}/history", params))
    if output is Output.json:
        print_json(items)
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("TIME", "INPUT", "BY", "RESULT", "PHASE", "GEN", "VER", "REASON"):
        table.add_column(column, no_wrap=column != "REASON")
    for item in items:
        message = item.get("message") or {}
        table.add_row(
            clock(item["occurred_at"]),
            input_label(item.get("message_type"), item.get("message")),
            dash(message.get("actor")),
            item["disposition"],
            dash(item["phase"]),
            dash(item["generation"]),
            dash(item["version"]),
            item["reason"],
        )
    print_table(table)


@app.command("logs")
def logs(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox", show_default=False)],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing new lines until it stops")
    ] = False,
    tail: Annotated[int | None, typer.Option("--tail", min=0, help="only the last N lines")] = None,
) -> None:
    """Print the sandbox's output (stdout lines to stdout, stderr lines to stderr)."""
    params: dict[str, Any] = {"follow": "true" if follow else "false"}
    if tail is not None:
        params["tail"] = tail
    try:
        for line in client_of(ctx).json_lines(f"/v1/sandboxes/{name}/logs", params):
            if "denied" in line:  # the token lapsed while following
                fail(line["denied"]["message"])
            target = sys.stderr if line["stream"] == "stderr" else sys.stdout
            print(line["text"], file=target, flush=True)
    except StreamBroken as exc:
        fail(f"logs: connection lost ({exc})")


@app.command("watch")
def watch(
    ctx: typer.Context,
    names: Annotated[
        list[str] | None, typer.Argument(help="only these sandboxes", show_default=False)
    ] = None,
    cursor: Annotated[
        int | None, typer.Option("--cursor", min=0, help="resume after this change (event id)")
    ] = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", min=0.1, help="stop after this many seconds")
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Follow sandbox changes as they happen (the current state first, unless --cursor)."""
    client = client_of(ctx)
    deadline = time.monotonic() + timeout if timeout else None
    position = cursor
    while True:
        params: dict[str, Any] = {"name": names or []}
        if position is not None:
            params["cursor"] = position
        remaining = None
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            params["timeout"] = f"{max(remaining, 0.001):.3f}"
        try:
            for event, event_id, data in client.events(params, read_timeout=(remaining or 0) + 60):
                if event_id is not None:
                    position = event_id
                if event == "denied":  # the token lapsed: resuming would be refused
                    fail(data["message"])
                if event != "sandbox":
                    continue
                if output is Output.json:
                    print(json.dumps(data), flush=True)
                else:
                    extra = f"  {data['reason']}" if data.get("reason") else ""
                    out.print(
                        f"{clock(data['updated_at'])}  {data['name']:<24} {data['phase']:<12} "
                        f"gen {data['generation']:<3} v{data['version']:<4} #{event_id}{extra}"
                    )
        except StreamBroken as exc:
            err.print(f"watch: connection lost ({exc}); resuming after #{position}")
            time.sleep(0.5)
            continue
        if deadline is None:
            err.print(f"watch: the server ended the stream; resuming after #{position}")
            continue
        return


# ---------------------------------------------------------------------------------------------
