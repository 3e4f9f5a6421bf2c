"""`sandstream processor [run]`: run a lifecycle processor (services/cli/roles.py);
`sandstream processor skip | retry`: move a stopped input partition on.

The processor stops a partition at a record PostgreSQL refuses to store even as a dead letter
(`/readyz` names it). These talk to PostgreSQL directly (settings from SANDSTREAM_* variables);
the running processor notices within a second and resumes the partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
from collections.abc import AsyncIterator
from typing import Annotated

import asyncpg
import typer

from services.cli.client import fail, settings_of
from services.cli.render import out
from services.cli.roles import HealthHost, HealthPort, PortFile, processor_run
from services.common.settings import Settings

app = typer.Typer(
    help="Run a lifecycle processor (`sandstream processor` or `processor run`), or operate its "
    "input partitions (`skip`, `retry`).",
    invoke_without_command=True,
)


@app.callback()
def run_without_subcommand(
    ctx: typer.Context,
    health_port: HealthPort = None,
    health_host: HealthHost = None,
    port_file: PortFile = None,
) -> None:
    """Without a subcommand: run one lifecycle processor (as `sandstream processor run`)."""
    if ctx.invoked_subcommand is None:
        processor_run(ctx, health_port, health_host, port_file)


app.command("run")(processor_run)

TopicOpt = Annotated[str, typer.Option("--topic", help="input topic of the record")]
PartitionOpt = Annotated[int, typer.Option("--partition", help="partition it stopped")]
OffsetOpt = Annotated[int, typer.Option("--offset", help="offset of the record it stopped at")]


@app.command("skip")
def skip(
    ctx: typer.Context,
    topic: TopicOpt,
    partition: PartitionOpt,
    offset: OffsetOpt,
    reason: Annotated[str, typer.Option("--reason", help="why, for the history")] = "",
) -> None:
    """Skip the record a partition stopped at (recorded in the history); the partition resumes."""
    from projections.stopped import NotStoppedThere, skip_record

    settings = settings_of(ctx)
    note = reason or "no reason given"

    async def run() -> str:
        async with _pool(settings) as pool, pool.acquire() as conn:
            stopped = await skip_record(conn, topic, partition, offset, getpass.getuser(), note)
        return stopped.reason

    try:
        refused = asyncio.run(run())
    except NotStoppedThere as exc:
        fail(str(exc))
    out.print(f"✓ skipped {topic} partition {partition} offset {offset} ({refused})")


@app.command("retry")
def retry(ctx: typer.Context, topic: TopicOpt, partition: PartitionOpt, offset: OffsetOpt) -> None:
    """Let the processor try the record a partition stopped at again (after fixing the cause)."""
    from projections.stopped import NotStoppedThere, retry_record

    settings = settings_of(ctx)

    async def run() -> None:
        async with _pool(settings) as pool, pool.acquire() as conn:
            await retry_record(conn, topic, partition, offset)

    try:
        asyncio.run(run())
    except NotStoppedThere as exc:
        fail(str(exc))
    out.print(f"✓ {topic} partition {partition} released: the processor retries offset {offset}")


@contextlib.asynccontextmanager
async def _pool(settings: Settings) -> AsyncIterator[asyncpg.Pool[asyncpg.Record]]:
    from services.common.database import connect_pool

    pool = await connect_pool(settings)
    try:
        yield pool
    finally:
        await pool.close()
