"""Every input and its decision as JSON Lines or Parquet, streamed in bounded memory.

Rows come from the history in decision order, one keyset page at a time (``entries.stream``),
and go out as they come: a JSON line each, or one Parquet row group per page. Memory is one
page whatever the history's size. Parquet is written by ``services.audit.parquet`` and needs
pyarrow, the ``parquet`` extra; JSON Lines needs only the base install. Each row carries its
hash-chain links, so an exported file can be checked without the database
(``projections.chain.link`` over its content).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from services.audit.entries import Entry, Filter, stream

FORMATS = ("jsonl", "parquet")
PARQUET_EXTRA = "sandstream[parquet]"


class MissingExtra(RuntimeError):
    """A format needs an optional dependency that is not installed; the message names the extra."""


if TYPE_CHECKING:
    from projections.store import Connection


def as_row(e: Entry) -> dict[str, Any]:
    """One exported row: the entry's columns, its actor, the hashes as hex."""
    return {
        "id": e.id, "key": e.key, "topic": e.topic, "partition": e.partition,
        "offset": e.offset, "message_type": e.message_type, "command_id": e.command_id,
        "actor": e.actor, "disposition": e.disposition, "reason": e.reason, "phase": e.phase,
        "generation": e.generation, "version": e.version, "event_types": e.event_types,
        "message": e.message, "occurred_at": e.occurred_at, "recorded_at": e.recorded_at,
        "sandbox_id": str(e.sandbox_id) if e.sandbox_id is not None else None,
        "prev_hash": e.prev_hash.hex() if e.prev_hash is not None else None,
        "entry_hash": e.entry_hash.hex() if e.entry_hash is not None else None,
    }  # fmt: skip


def json_line(e: Entry) -> str:
    row = as_row(e)
    for name in ("occurred_at", "recorded_at"):
        value = row[name]
        row[name] = _utc(value) if value is not None else None
    return json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n"


def _utc(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds")


async def json_lines(conn: Connection, which: Filter, chunk: int = 1000) -> AsyncIterator[str]:
    """The export as JSON Lines text, one page of lines at a time (for HTTP streaming)."""
    async for page in stream(conn, which, chunk):
        yield "".join(json_line(e) for e in page)


def require_parquet() -> None:
    """Raise MissingExtra, naming the extra to install, when pyarrow does not import."""
    try:
        importlib.import_module("pyarrow.parquet")
    except ImportError as e:
        raise MissingExtra(
            f"Parquet export needs pyarrow, which does not import here ({e}): "
            f"install the parquet extra, pip install '{PARQUET_EXTRA}', or use --format jsonl"
        ) from e


async def export(
    conn: Connection,
    which: Filter,
    fmt: str,
    target: Path | IO[str],
    progress: Callable[[int], None] = lambda n: None,
    chunk: int = 5000,
) -> int:
    """Write the filtered history to ``target`` (a path, or a text stream for JSON Lines);
    ``progress`` is told how many rows each page added. Returns the number of rows."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "parquet":
        if not isinstance(target, Path):
            raise ValueError("Parquet needs a file path")
        require_parquet()
        from services.audit import parquet  # pyarrow: the parquet extra's, imported when asked

        rows = ([as_row(e) for e in page] async for page in stream(conn, which, chunk))
        return await parquet.write(rows, target, progress)
    written = 0
    out: IO[str]
    with (
        target.open("w", encoding="utf-8") if isinstance(target, Path) else _Borrowed(target)
    ) as out:
        async for page in stream(conn, which, chunk):
            out.write("".join(json_line(e) for e in page))
            written += len(page)
            progress(len(page))
    return written


class _Borrowed:
    """A stream the caller owns: not closed here."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def __enter__(self) -> IO[str]:
        return self.stream

    def __exit__(self, *_: object) -> None:
        self.stream.flush()
