"""The `sandstream` command: a client of the HTTP API, plus `up` and `down` for the local stack.

Connection: ``--url`` (or SANDSTREAM_API_URL; default from the settings' API host and port) and
a token from ``--token`` / SANDSTREAM_TOKEN, else ``--token-file`` / SANDSTREAM_TOKEN_FILE,
else the admin token file that `sandstream up` writes. Exit codes: 0 done, 1 rejected or
failed (the message says why), 2 usage error, 3 timed out waiting.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.table import Table

from services.auth import TokenFileError, read_token_value
from services.settings import Settings, load_settings

EXIT_FAILED = 1
EXIT_TIMEOUT = 3
MAX_SERVER_WAIT = 60.0

# Piped output is not cut at 80 columns (a terminal's width is used when there is one).
out = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)

app = typer.Typer(
    name="sandstream",
    help="Control plane for agent sandboxes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
sandbox_app = typer.Typer(help="Create, inspect and control sandboxes.", no_args_is_help=True)
token_app = typer.Typer(help="Manage API tokens (the local tokens file).", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(token_app, name="token")


class Output(StrEnum):
    table = "table"
    json = "json"


OutputOpt = Annotated[
    Output, typer.Option("--output", "-o", help="table for people, json for scripts")
]
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
    typer.Option("--expected-version", min=0, help="fail (ABORTED) unless at this version"),
]


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    raise CliError(message, code)


# ---------------------------------------------------------------------------------------------
# The API client


@dataclass
class Connection:
    url: str | None
    token: str | None
    token_file: Path | None


class Client:
    def __init__(self, settings: Settings, conn: Connection, *, need_token: bool = True) -> None:
        self.url = (conn.url or settings.api_base_url).rstrip("/")
        token = conn.token
        if not token and need_token:
            path = conn.token_file or settings.admin_token_file
            hint = "Pass --token, set SANDSTREAM_TOKEN or --token-file, or run `sandstream up`"
            try:
                token = read_token_value(path)
            except OSError as exc:
                fail(f"no API token: cannot read {path} ({exc.strerror}). {hint} (it writes one).")
            except TokenFileError as exc:
                fail(f"no API token: {exc}. {hint} (it writes one).")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30.0)

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Any = None,
        timeout: float | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> httpx.Response:
        try:
            response = self.http.request(
                method,
                path,
                json=json_body,
                params=params,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as exc:
            fail(f"cannot reach the API at {self.url} ({exc}); is `sandstream up` running?")
        if response.status_code not in ok:
            raise ApiFailure.of(response)
        return response

    def pages(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The items of a paginated GET, following ``next_page_token`` to the end."""
        params = dict(params)
        while True:
            page = self.request("GET", path, params=params).json()
            yield from page["items"]
            if not page.get("next_page_token"):
                return
            params["page_token"] = page["next_page_token"]

    def events(
        self, params: dict[str, Any], read_timeout: float
    ) -> Iterator[tuple[str, int | None, dict[str, Any]]]:
        """Server-sent events of /v1/watch: (event, id, data)."""
        try:
            with self.http.stream(
                "GET",
                "/v1/watch",
                params=params,
                timeout=httpx.Timeout(30.0, read=read_timeout),
            ) as response:
                if response.status_code != 200:
                    response.read()
                    raise ApiFailure.of(response)
                event, event_id = "message", None
                data: list[str] = []
                for line in response.iter_lines():
                    if not line:
                        if data:
                            yield event, event_id, json.loads("\n".join(data))
                        event, event_id, data = "message", None, []
                        continue
                    if line.startswith(":"):
                        continue
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if field == "event":
                        event = value
                    elif field == "id":
                        event_id = int(value) if value.isdigit() else None
                    elif field == "data":
                        data.append(value)
        except httpx.TransportError as exc:
            raise StreamBroken(str(exc)) from exc


class StreamBroken(Exception):
    pass


class ApiFailure(CliError):
    def __init__(self, status: int, code: str, message: str, body: Any) -> None:
        super().__init__(message)
        self.status = status
        self.api_code = code
        self.body = body

    @classmethod
    def of(cls, response: httpx.Response) -> ApiFailure:
        try:
            body = response.json()
            code, message = str(body["code"]), str(body["message"])
        except (ValueError, KeyError, TypeError):
            body = None
            code, message = "HTTP_" + str(response.status_code), response.text[:500]
        return cls(response.status_code, code, message, body)


# ---------------------------------------------------------------------------------------------
# Helpers


def settings_of(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj
    assert isinstance(obj, dict)
    settings = obj["settings"]
    assert isinstance(settings, Settings)
    return settings


def client_of(ctx: typer.Context, *, need_token: bool = True) -> Client:
    obj = ctx.find_root().obj
    assert isinstance(obj, dict)
    return Client(obj["settings"], obj["connection"], need_token=need_token)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2), flush=True)


def print_table(table: Table) -> None:
    """A table without the padding rich leaves at the end of lines."""
    with out.capture() as captured:
        out.print(table)
    print("\n".join(line.rstrip() for line in captured.get().splitlines()), flush=True)


def pairs(values: list[str], what: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected {what} as KEY=VALUE, got {item!r}")
        result[key] = value
    return result


def age(timestamp: str) -> str:
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = max(0, int((datetime.now(UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def clock(timestamp: str | None) -> str:
    if not timestamp:
        return "-"
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00")).astimezone()
    return then.strftime("%H:%M:%S")


def _dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


# ---------------------------------------------------------------------------------------------
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
    "delete": Goal("Deleting", "Deleted", "Deleted"),
}
SETTLED = ("Ready", "Stopped", "Completed", "Error", "Deleted")


def _submit(
    client: Client,
    method: str,
    path: str,
    body: dict[str, Any],
    name: str,
    deadline: float,
) -> dict[str, Any]:
    """Send a command and return its decided outcome (waiting for it), or fail."""
    wait = max(0.0, min(MAX_SERVER_WAIT, deadline - time.monotonic()))
    response = client.request(
        method,
        path,
        json_body=body,
        params={"wait": f"{wait:.3f}"},
        timeout=wait + 30,
        ok=(200, 201, 202),
    )
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
    if phase == goal.phase:
        return True
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


# ---------------------------------------------------------------------------------------------
# sandbox commands


@sandbox_app.command("create")
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name (a DNS label)")],
    image: Annotated[str, typer.Option("--image", help="container image", show_default=False)],
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
    command_id: CommandIdOpt = None,
    timeout: TimeoutOpt = 120.0,
    no_wait: NoWaitOpt = False,
    output: OutputOpt = Output.table,
) -> None:
    """Create a sandbox and wait until it is Ready."""
    spec: dict[str, Any] = {
        "image": image,
        "command": list(command or []),
        "env": pairs(env, "--env"),
        "labels": pairs(label, "--label"),
    }
    if stop_timeout is not None:
        spec["stop_timeout_seconds"] = stop_timeout
    body: dict[str, Any] = {"name": name, "spec": spec, "providers": provider}
    if command_id:
        body["command_id"] = command_id
    _lifecycle(ctx, "create", name, "POST", "/v1/sandboxes", body,
               timeout=timeout, no_wait=no_wait, output=output)  # fmt: skip


def _command_body(command_id: str | None, expected_version: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if command_id:
        body["command_id"] = command_id
    if expected_version is not None:
        body["expected_version"] = expected_version
    return body


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
        _lifecycle(ctx, verb, name, method, f"/v1/sandboxes/{name}{suffix}",
                   _command_body(command_id, expected_version),
                   timeout=timeout, no_wait=no_wait, output=output)  # fmt: skip

    command.__doc__ = doc
    sandbox_app.command(verb)(command)


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
    "delete", "DELETE", "", "Delete a sandbox (runtime and workspace) and wait until it is gone."
)


@sandbox_app.command("list")
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


@sandbox_app.command("get")
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
        ("Providers", ", ".join(row["providers"]) or "-"),
        ("Conditions", conditions),
        ("Exit code", _dash(row["exit_code"])),
        ("Reason", _dash(row["reason"])),
        ("Created", f"{row['created_at']} ({age(row['created_at'])} ago)"),
        ("Updated", row["updated_at"]),
    ]
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in fields:
        table.add_row(key, str(value))
    print_table(table)


@sandbox_app.command("history")
def history(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the sandbox name")],
    output: OutputOpt = Output.table,
) -> None:
    """Every input about a sandbox in order: applied, rejected and ignored, with the reason."""
    items = list(client_of(ctx).pages(f"/v1/sandboxes/{name}/history", {"limit": 1000}))
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
            _input_label(item),
            _dash(message.get("actor")),
            item["disposition"],
            _dash(item["phase"]),
            _dash(item["generation"]),
            _dash(item["version"]),
            item["reason"],
        )
    print_table(table)


def _input_label(item: dict[str, Any]) -> str:
    message = item.get("message") or {}
    kind = item.get("message_type") or "?"
    if kind == "RuntimeSnapshot":
        state, code = message.get("state"), message.get("exit_code")
        if state == "exited" and code is not None:
            return f"Snapshot(exited {code})"
        return f"Snapshot({state})"
    if kind == "DriverOperationResult":
        return f"Result({message.get('operation')} {message.get('outcome')})"
    if kind == "RuntimeRemoved":
        return "Removed"
    return kind.removesuffix("Sandbox") if kind != "CreateSandbox" else "Create"


@sandbox_app.command("watch")
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
# status, up, down, token


@app.command("status")
def status(ctx: typer.Context, output: OutputOpt = Output.table) -> None:
    """Is the control plane up and ready? Kafka, PostgreSQL, processor lag, sandboxes."""
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
    is_ready = ready.get("status") == "ready"
    if output is Output.json:
        print_json({"url": client.url, "ready": is_ready, **ready, "sandboxes": counts})
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
        else:
            out.print(f"{'sandboxes':<12} unknown ({note})")
    if not is_ready:
        raise typer.Exit(EXIT_FAILED)


@app.command("up")
def up_command(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option("--port", help="API port (default 8787)")] = None,
    host: Annotated[str | None, typer.Option("--host", help="API address")] = None,
    no_stack: Annotated[
        bool, typer.Option("--no-stack", help="do not start Kafka/PostgreSQL/Podman")
    ] = False,
) -> None:
    """Start the stack, the control plane and the API in the foreground (Ctrl-C stops)."""
    from services.up import up

    settings = settings_of(ctx)
    update: dict[str, Any] = {}
    if port is not None:
        update["api_port"] = port
    if host is not None:
        update["api_host"] = host
    raise typer.Exit(up(settings.model_copy(update=update), start_stack=not no_stack))


@app.command("down")
def down_command(
    ctx: typer.Context,
    keep_stack: Annotated[
        bool, typer.Option("--keep-stack", help="stop only `sandstream up`, not the stack")
    ] = False,
) -> None:
    """Stop a running `sandstream up`, then the stack (Kafka, PostgreSQL, Podman)."""
    from services.up import down

    raise typer.Exit(down(settings_of(ctx), keep_stack=keep_stack))


@app.command("rebuild")
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

    from services.rebuild import rebuild_and_compare

    report = asyncio.run(rebuild_and_compare(settings_of(ctx), keep_schema=keep_schema))
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


@token_app.command("create")
def token_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="who uses the token (commands' actor)")],
    scope: Annotated[
        list[str], typer.Option("--scope", help="sandbox:read and/or sandbox:write")
    ] = ["sandbox:read"],  # noqa: B006
) -> None:
    """Add a token to the tokens file and print it (once: only its hash is stored)."""
    from services.auth import add_token

    settings = settings_of(ctx)
    try:
        value = add_token(settings.tokens_file, name, tuple(scope))
    except (ValueError, OSError) as exc:
        fail(str(exc))
    err.print(f"token {name!r} ({', '.join(sorted(scope))}) added to {settings.tokens_file}")
    print(value)


# ---------------------------------------------------------------------------------------------
# Entry point


@app.callback()
def root(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option("--url", envvar="SANDSTREAM_API_URL", help="API URL", show_default=False),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="SANDSTREAM_TOKEN", help="API token", show_default=False),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            envvar="SANDSTREAM_TOKEN_FILE",
            help="file holding the API token (default: the admin token `up` writes)",
            show_default=False,
        ),
    ] = None,
) -> None:
    ctx.obj = {"settings": load_settings(), "connection": Connection(url, token, token_file)}


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="sandstream", standalone_mode=True)
    except CliError as exc:
        err.print(f"✗ {exc.message}", markup=False)
        sys.exit(exc.code)
