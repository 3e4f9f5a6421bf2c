"""Export the JSON Schemas of every wire message into ``docs/schemas/``.

    python -m events.schema_export            # (re)write the files
    python -m events.schema_export --check    # exit 1 if a file is missing or stale

The schemas are pydantic's validation schemas: what ``events.codec.decode`` accepts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from pydantic import TypeAdapter

from events.codec import COMMANDS, EVENTS, OBSERVATIONS
from events.deadletter import DeadLetter
from events.outcomes import CommandOutcome

SCHEMA_DIR: Final = Path(__file__).resolve().parent.parent / "docs" / "schemas"
REGENERATE: Final = "python -m events.schema_export"

ADAPTERS: Final[dict[str, tuple[str, TypeAdapter[Any]]]] = {
    "commands.json": ("sandstream command (topic sandbox.commands)", COMMANDS),
    "observations.json": ("sandstream observation (topic sandbox.observations)", OBSERVATIONS),
    "events.json": ("sandstream decided event (topic sandbox.events)", EVENTS),
    "outcome.json": ("sandstream command outcome", TypeAdapter(CommandOutcome)),
    "deadletter.json": (
        "sandstream dead letter (topic sandbox.deadletter)",
        TypeAdapter(DeadLetter),
    ),
}


def render(title: str, adapter: TypeAdapter[Any]) -> str:
    schema = {
        **adapter.json_schema(),
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
    }
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def rendered() -> dict[str, str]:
    """File name -> the content it should have."""
    return {name: render(title, adapter) for name, (title, adapter) in ADAPTERS.items()}


def stale(directory: Path = SCHEMA_DIR) -> list[str]:
    """The names of the files that are missing or differ from the models."""
    out = []
    for name, text in rendered().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(name)
    return out


def write(directory: Path = SCHEMA_DIR) -> list[str]:
    """Write every file that is missing or stale; return their names."""
    directory.mkdir(parents=True, exist_ok=True)
    changed = stale(directory)
    texts = rendered()
    for name in changed:
        (directory / name).write_text(texts[name], encoding="utf-8")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m events.schema_export", description="Export the message JSON Schemas."
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if any file is stale")
    parser.add_argument("--dir", type=Path, default=SCHEMA_DIR, help="output directory")
    args = parser.parse_args(argv)
    directory: Path = args.dir
    if args.check:
        names = stale(directory)
        if names:
            print(
                f"stale JSON Schemas in {directory}: {', '.join(names)}; run `{REGENERATE}`",
                file=sys.stderr,
            )
            return 1
        print(f"JSON Schemas in {directory} are up to date")
        return 0
    names = write(directory)
    print(f"wrote {', '.join(names)}" if names else f"JSON Schemas in {directory} are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
