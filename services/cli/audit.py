"""`sandstream audit verify | chain | at | explain | export | rebuild | diff | promote`.

They talk to Kafka and PostgreSQL directly (settings from SANDSTREAM_* variables), like
`sandstream rebuild`; the HTTP API serves `at`, `explain`, `chain` and `export` too (scope
audit:read). Every command first says how far back the log still reaches.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import asyncpg
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from projections.lifecycle import decide
from services.audit import entries, export, page, shadow, timeline
from services.audit.anchors import read_anchors
from services.audit.chains import ChainReport, check_chains
from services.audit.reach import Reach, log_reach
from services.audit.verify import Options, load_rules, verify
from services.cli.client import EXIT_FAILED, fail, settings_of
from services.cli.render import Output, OutputOpt, err, out, print_json
from services.common.settings import Settings

app = typer.Typer(
    help="Audit: verify, hash chains, time travel, explain, export, shadow rebuild.",
    no_args_is_help=True,
)
T = TypeVar("T")

TimeOpt = Annotated[
    datetime | None, typer.Option(help="ISO time (UTC when no zone is given)", show_default=False)
]


def _utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def _run(settings: Settings, work: Callable[[asyncpg.Connection[Any]], Awaitable[T]]) -> T:
    async def main() -> T:
        conn = await asyncpg.connect(
            settings.pg_dsn, server_settings={"search_path": settings.pg_schema}
        )
        try:
            return await work(conn)
        finally:
            await conn.close()

    return asyncio.run(main())


def _say_reach(reach: Reach, output: Output) -> None:
    if output is Output.table:
        (out if reach.complete else err).print(reach.statement(), markup=False, soft_wrap=True)


@app.command("verify")
def verify_command(
    ctx: typer.Context,
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="only this sandbox")] = None,
    since: TimeOpt = None,
    until: TimeOpt = None,
    from_offset: Annotated[int | None, typer.Option(help="report from this offset")] = None,
    to_offset: Annotated[int | None, typer.Option(help="report up to this offset")] = None,
    rules: Annotated[
        str | None,
        typer.Option(help="module[:function] of pinned rules (a release's decide)"),
    ] = None,
    keep_scratch: Annotated[bool, typer.Option(help="keep the scratch schema")] = False,
    accept_unverifiable: Annotated[
        bool,
        typer.Option(
            help="exit 0 even if some sandboxes could not be verified (their oldest inputs "
            "are no longer in the log)"
        ),
    ] = False,
    output: OutputOpt = Output.table,
) -> None:
    """Re-decide every input from the log in a scratch schema and compare with the record;
    check the history's hash chains against the log's checkpoints. Exits 1 on any divergence
    or broken link, and when a sandbox could not be verified (unless accepted)."""
    options = Options(
        key=sandbox, since=_utc(since), until=_utc(until), from_offset=from_offset,
        to_offset=to_offset, keep_scratch=keep_scratch, accept_unverifiable=accept_unverifiable,
    )  # fmt: skip
    if rules is not None:
        try:
            options = replace(options, rules=load_rules(rules), rules_name=rules)
        except (ImportError, AttributeError) as exc:
            fail(f"--rules {rules}: {exc}", 2)
    report = asyncio.run(verify(settings_of(ctx), options))
    chains = report.chains
    assert chains is not None
    if output is Output.json:
        print_json(
            {
                "ok": report.ok, "log_reach_complete": report.reach.complete,
                "log_reach": report.reach.statement(), "rules": report.rules,
                "inputs": report.inputs, "sandboxes": report.sandboxes,
                "pending": report.pending, "not_verifiable": sorted(report.not_verifiable),
                "divergences": [asdict(d) for d in report.divergences],
                "broken_links": _chain_problems(chains), "anchored_chains": chains.anchored,
                "scratch_schema": report.scratch if keep_scratch else None,
            }
        )  # fmt: skip
    else:
        _say_reach(report.reach, output)
        out.print(
            f"re-decided {report.inputs} inputs of {report.sandboxes} sandboxes on "
            f"{len(report.partitions)} partitions with {report.rules}",
            markup=False,
            soft_wrap=True,
        )
        if report.pending:
            out.print(f"{report.pending} newer inputs are not decided yet (not compared)")
        if report.not_verifiable:
            mark = "" if accept_unverifiable else "✗ "
            out.print(
                f"{mark}not verifiable (inputs older than the log): "
                + ", ".join(sorted(report.not_verifiable))
                + ("" if accept_unverifiable else " (--accept-unverifiable to accept that)"),
                markup=False,
                soft_wrap=True,
            )
        for d in report.divergences:
            out.print(f"✗ divergence: {d.describe()}", markup=False, soft_wrap=True)
        out.print(
            f"history chains: {_chains_summary(chains)}" + (", intact" if chains.intact else ""),
            markup=False,
            soft_wrap=True,
        )
        _print_problems(chains)
        mark = "✓" if report.ok else "✗"
        out.print(
            f"{mark} {len(report.divergences)} divergences, "
            f"{len(_chain_problems(chains))} broken links",
            markup=False,
            soft_wrap=True,
        )
        if keep_scratch:
            out.print(
                f"re-decided record kept in schema {report.scratch}", markup=False, soft_wrap=True
            )
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


@app.command("chain")
def chain_command(
    ctx: typer.Context,
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="only this sandbox")] = None,
) -> None:
    """Check the history's hash chains, and that each still holds the newest head the log's
    checkpoints name (PostgreSQL and the checkpoints topic; no replay). Exits 1 on a broken
    link or a chain cut short."""
    settings = settings_of(ctx)
    anchors = asyncio.run(read_anchors(settings))  # first: see read_anchors
    report = _run(settings, lambda conn: check_chains(conn, sandbox, anchors))
    _print_problems(report)
    mark = "✓" if report.intact else "✗"
    out.print(f"{mark} {_chains_summary(report)}", markup=False, soft_wrap=True)
    if not report.intact:
        raise typer.Exit(EXIT_FAILED)


def _chains_summary(report: ChainReport) -> str:
    unchained = f", {report.unchained} older entries unchained" if report.unchained else ""
    anchored = (
        f", {report.anchored} chains' heads checked against the log's checkpoints"
        if report.anchored is not None
        else ""
    )
    return f"{report.chains} chains, {report.checked} entries{unchained}{anchored}"


def _chain_problems(report: ChainReport) -> list[str]:
    return (
        [f"broken link: {b.describe()}" for b in report.broken]
        + [f"cut short: {c.describe()}" for c in report.cut]
        + [f"unreadable checkpoint: {u}" for u in report.unreadable]
    )


def _print_problems(report: ChainReport) -> None:
    for problem in _chain_problems(report):
        out.print(f"✗ {problem}", markup=False, soft_wrap=True)


def _steps(settings: Settings, name: str) -> tuple[list[timeline.Step], Reach]:
    found = _run(settings, lambda conn: entries.of_sandbox(conn, name))
    if not found:
        fail(f"sandbox {name!r} has no recorded inputs")
    reach = asyncio.run(log_reach(settings, {e.partition for e in found}))
    return timeline.replay(found, settings.topic_commands, limits=settings.lifecycle_limits), reach


@app.command("at")
def at_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="sandbox name")],
    time: TimeOpt = None,
    offset: Annotated[
        str | None,
        typer.Option(
            help="TOPIC:OFFSET of one of its inputs (TOPIC: commands, observations "
            "or a topic name)",
            show_default=False,
        ),
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """The sandbox's state as of a time or an input, with the inputs that produced it."""
    settings = settings_of(ctx)
    if (time is None) == (offset is None):
        fail("give exactly one of --time and --offset", 2)
    steps, reach = _steps(settings, name)
    try:
        prefix = timeline.at(
            steps, time=_utc(time), position=_position(settings, offset) if offset else None
        )
    except timeline.NotRecorded as exc:
        fail(str(exc))
    state = prefix[-1].state
    if output is Output.json:
        print_json(
            {
                "log_reach": reach.statement(), "log_reach_complete": reach.complete,
                "state": _state(state), "inputs": [_step(s) for s in prefix],
            }
        )  # fmt: skip
        return
    _say_reach(reach, output)
    if state is None:
        out.print(f"{name}: no row as of then", markup=False, soft_wrap=True)
    else:
        out.print(
            f"{name} as of {prefix[-1].entry.topic}@{prefix[-1].entry.offset}: "
            f"{state.phase.value}, generation {state.generation}, version {state.version}, "
            f"incarnation {state.sandbox_id}",
            markup=False,
            soft_wrap=True,
        )
    out.print(f"produced by {len(prefix)} inputs:", markup=False, soft_wrap=True)
    for s in prefix:
        out.print(f"  {_line(s)}", markup=False, soft_wrap=True)


def _position(settings: Settings, text: str) -> tuple[str, int]:
    topic, _, number = text.rpartition(":")
    aliases = {"commands": settings.topic_commands, "observations": settings.topic_observations}
    if not topic or not number.isdigit():
        fail(f"--offset {text!r}: expected TOPIC:OFFSET, e.g. commands:17", 2)
    return aliases.get(topic, topic), int(number)


def _line(s: timeline.Step) -> str:
    e = s.entry
    when = e.occurred_at.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3] if e.occurred_at else "?"
    return (
        f"{when}  {e.topic}@{e.offset}  {timeline.describe_input(e)}\n"
        f"      -> {timeline.describe_decision(s)}"
    )


def _state(state: Any) -> dict[str, Any] | None:
    if state is None:
        return None
    return {
        "key": state.key, "sandbox_id": str(state.sandbox_id), "phase": state.phase.value,
        "generation": state.generation, "version": state.version,
        "providers": list(state.providers), "exit_code": state.exit_code,
        "reason": state.reason, "updated_at": state.updated_at.isoformat(),
    }  # fmt: skip


def _step(s: timeline.Step) -> dict[str, Any]:
    e = s.entry
    return {
        "topic": e.topic, "partition": e.partition, "offset": e.offset,
        "occurred_at": e.occurred_at.isoformat() if e.occurred_at else None,
        "input": timeline.describe_input(e), "disposition": s.disposition, "reason": s.reason,
        "events": [ev.type for ev in s.events], "agrees_with_record": s.agrees,
    }  # fmt: skip


@app.command("explain")
def explain_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="sandbox name")],
    html: Annotated[
        Path | None, typer.Option("--html", help="also write a self-contained page here")
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """The causal chain of the current state: every input, the decision, the driver calls."""
    settings = settings_of(ctx)
    steps, reach = _steps(settings, name)
    story = timeline.explain(name, steps)
    if html is not None:
        html.write_text(page.render(story, reach, datetime.now(UTC)), encoding="utf-8")
    if output is Output.json:
        print_json(
            {
                "log_reach": reach.statement(), "state": _state(story.state),
                "inputs": [
                    _step(s) | {"driver_calls": [
                        {"operation": c.operation, "generation": c.generation,
                         "results": [_step(r) for r in c.results]}
                        for c in story.calls.get(i, [])
                    ]}
                    for i, s in enumerate(story.steps)
                ],
            }
        )  # fmt: skip
        return
    _say_reach(reach, output)
    state = story.state
    out.print(
        f"{name}: "
        + (
            f"{state.phase.value}, generation {state.generation}, version {state.version}, "
            f"incarnation {state.sandbox_id}"
            if state
            else "no row"
        )
        + f" — {len(story.steps)} inputs since this incarnation was created",
        markup=False,
        soft_wrap=True,
    )
    for i, s in enumerate(story.steps):
        out.print(_line(s), markup=False, soft_wrap=True)
        for c in story.calls.get(i, []):
            results = ", ".join(
                f"{r.entry.body.get('outcome')} ({r.entry.topic}@{r.entry.offset})"
                for r in c.results
            )
            out.print(
                f"      => executor: {c.operation} generation {c.generation}: "
                + (results or "no result recorded yet"),
                markup=False,
                soft_wrap=True,
            )
    if html is not None:
        out.print(f"page written to {html}", markup=False, soft_wrap=True)


@app.command("export")
def export_command(
    ctx: typer.Context,
    target: Annotated[Path, typer.Argument(help="file to write ('-' for stdout, JSON Lines)")],
    fmt: Annotated[str, typer.Option("--format", help="jsonl or parquet")] = "jsonl",
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="only this sandbox")] = None,
    since: TimeOpt = None,
    until: TimeOpt = None,
    types: Annotated[
        list[str] | None, typer.Option("--type", help="input type (repeatable)")
    ] = None,
) -> None:
    """Every input and its decision as JSON Lines or Parquet, streamed (bounded memory)."""
    settings = settings_of(ctx)
    if fmt not in export.FORMATS:
        fail(f"--format must be one of {', '.join(export.FORMATS)}", 2)
    if str(target) == "-" and fmt != "jsonl":
        fail("only JSON Lines can go to stdout", 2)
    if fmt == "parquet":
        try:  # before anything is read or written
            export.require_parquet()
        except export.MissingExtra as e:
            fail(str(e), 2)
    which = entries.Filter(key=sandbox, since=_utc(since), until=_utc(until), types=types or ())
    reach = asyncio.run(log_reach(settings))
    err.print(reach.statement(), markup=False, soft_wrap=True)

    async def work(conn: asyncpg.Connection[Any]) -> int:
        total = await entries.count(conn, which)
        with Progress(
            TextColumn("exporting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=err, transient=True, disable=not sys.stderr.isatty(),
        ) as bar:  # fmt: skip
            task = bar.add_task("export", total=total)
            where: Path | Any = sys.stdout if str(target) == "-" else target
            return await export.export(
                conn, which, fmt, where, progress=lambda n: bar.advance(task, n)
            )

    written = _run(settings, work)
    err.print(
        f"✓ exported {written} inputs ({fmt})" + ("" if str(target) == "-" else f" to {target}")
    )


def _rules_of(spec: str | None) -> tuple[Any, str]:
    if spec is None:
        return decide, "projections.lifecycle.decide (this checkout)"
    try:
        return load_rules(spec), spec
    except (ImportError, AttributeError) as exc:
        fail(f"--rules {spec}: {exc}", 2)


@app.command("rebuild")
def rebuild_command(
    ctx: typer.Context,
    shadow_schema: Annotated[
        str, typer.Option("--shadow", help="the side schema to rebuild into (must be new)")
    ],
    rules: Annotated[
        str | None, typer.Option(help="module[:function] of other rules to decide with")
    ] = None,
) -> None:
    """Rebuild the read model from the log into a side schema while the live one serves."""
    settings = settings_of(ctx)
    decide_with, name = _rules_of(rules)
    _say_reach(asyncio.run(log_reach(settings)), Output.table)
    try:
        count = asyncio.run(shadow.build(settings, shadow_schema, decide_with))
    except shadow.ShadowError as exc:
        fail(str(exc))
    out.print(f"✓ re-decided {count} inputs into schema {shadow_schema} with {name}", markup=False)
    out.print(
        f"next: `sandstream audit diff {shadow_schema}`, then "
        f"`sandstream audit promote {shadow_schema}`",
        markup=False,
        soft_wrap=True,
    )


@app.command("diff")
def diff_command(
    ctx: typer.Context,
    shadow_schema: Annotated[str, typer.Argument(help="the shadow schema")],
) -> None:
    """Compare a shadow with the live read model: decisions, rows, outcomes. Exits 1 if
    they differ."""
    settings = settings_of(ctx)
    found = _run(settings, lambda conn: shadow.diff(conn, settings.pg_schema, shadow_schema))
    for line in shadow.describe(found):
        out.print(line, markup=False, soft_wrap=True)
    if found.ahead:
        out.print(f"the live read model is {found.ahead} inputs ahead (promote catches up)")
    mark = "✓ equal" if found.equal else "✗ differs"
    out.print(f"{mark} over the inputs both have decided", markup=False)
    if not found.equal:
        raise typer.Exit(EXIT_FAILED)


@app.command("promote")
def promote_command(
    ctx: typer.Context,
    shadow_schema: Annotated[str, typer.Argument(help="the shadow schema")],
    rules: Annotated[str | None, typer.Option(help="the rules the shadow was rebuilt with")] = None,
) -> None:
    """Catch the shadow up and switch it in atomically, the processor fenced meanwhile; the
    replaced tables are kept in <shadow>_previous."""
    settings = settings_of(ctx)
    decide_with, _ = _rules_of(rules)
    try:
        found = asyncio.run(shadow.promote(settings, shadow_schema, decide_with))
    except shadow.ShadowError as exc:
        fail(str(exc))
    for line in shadow.describe(found):
        out.print(line, markup=False, soft_wrap=True)
    out.print(
        f"✓ promoted {shadow_schema} into {settings.pg_schema}; the replaced tables are in "
        f"{shadow_schema}_previous",
        markup=False,
        soft_wrap=True,
    )
