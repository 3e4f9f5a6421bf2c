"""Output for people and scripts: the consoles, tables, JSON, times."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

# Piped output is not cut at 80 columns (a terminal's width is used when there is one).
out = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class Output(StrEnum):
    table = "table"
    json = "json"


OutputOpt = Annotated[
    Output, typer.Option("--output", "-o", help="table for people, json for scripts")
]


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2), flush=True)


def print_table(table: Table) -> None:
    """A table without the padding rich leaves at the end of lines."""
    with out.capture() as captured:
        out.print(table)
    print("\n".join(line.rstrip() for line in captured.get().splitlines()), flush=True)


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


def dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


# ---------------------------------------------------------------------------------------------
