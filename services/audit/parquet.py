"""The export's Parquet form: one row group per page of the history, zstd-compressed.

The only module that imports pyarrow, which comes with the ``parquet`` extra
(``pip install 'sandstream[parquet]'``); ``services.audit.export`` imports this one only when
a Parquet export is asked for, so everything else runs without it (the container image has no
pyarrow).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("key", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("message_type", pa.string()),
        ("command_id", pa.string()),
        ("actor", pa.string()),
        ("disposition", pa.string()),
        ("reason", pa.string()),
        ("phase", pa.string()),
        ("generation", pa.int32()),
        ("version", pa.int64()),
        ("event_types", pa.list_(pa.string())),
        ("message", pa.string()),
        ("occurred_at", pa.timestamp("us", tz="UTC")),
        ("recorded_at", pa.timestamp("us", tz="UTC")),
        ("sandbox_id", pa.string()),
        ("prev_hash", pa.string()),
        ("entry_hash", pa.string()),
    ]
)


async def write(
    pages: AsyncIterator[list[dict[str, Any]]], target: Path, progress: Callable[[int], None]
) -> int:
    """Write each page of rows as a row group of ``target``; the number of rows."""
    written = 0
    with pq.ParquetWriter(target, SCHEMA, compression="zstd") as writer:
        async for rows in pages:
            writer.write_batch(pa.RecordBatch.from_pylist(rows, SCHEMA))
            written += len(rows)
            progress(len(rows))
        if written == 0:  # an empty file still has the schema
            writer.write_table(SCHEMA.empty_table())
    return written
