"""`sandstream log ...`: which Kafka log PostgreSQL follows, and adopting a replaced one."""

from __future__ import annotations

import asyncio
import getpass
from typing import Annotated, Any

import typer

from services.cli.client import fail, settings_of
from services.cli.render import Output, OutputOpt, out, print_json
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings

app = typer.Typer(help="The Kafka log the stored offsets belong to.", no_args_is_help=True)


async def _show(settings: Settings) -> dict[str, Any]:
    from services.common.database import connect_pool
    from services.common.log_identity import differences, read_log_identity, recorded_identity

    topics = [settings.topic_commands, settings.topic_observations]
    current = await read_log_identity(kafka_client_args(settings, "audit"), topics)
    pool = await connect_pool(settings)
    try:
        async with pool.acquire() as conn:
            recorded = await recorded_identity(conn, topics)
    finally:
        await pool.close()
    return {
        "cluster_id": current.cluster_id,
        "topics": {
            t: {
                "topic_id": str(current.topic_ids[t]),
                "recorded": (
                    {"cluster_id": recorded[t][0], "topic_id": str(recorded[t][1])}
                    if t in recorded
                    else None
                ),
            }
            for t in topics
        },
        "differences": differences(recorded, current),
    }


@app.command("show")
def log_show(ctx: typer.Context, output: OutputOpt = Output.table) -> None:
    """The Kafka log's ids and those recorded in PostgreSQL (exit 1 if they differ)."""
    shown = asyncio.run(_show(settings_of(ctx)))
    if output is Output.json:
        print_json(shown)
    else:
        out.print(f"cluster {shown['cluster_id']}")
        for line in shown["differences"] or ["the log is the one the stored offsets belong to"]:
            out.print(f"  {line}")
    if shown["differences"]:
        raise typer.Exit(1)


async def _adopt(settings: Settings, actor: str, reason: str) -> dict[str, Any]:
    from services.common.database import connect_pool
    from services.common.log_identity import adopt_log, read_log_identity

    topics = [settings.topic_commands, settings.topic_observations]
    current = await read_log_identity(kafka_client_args(settings, "audit"), topics)
    pool = await connect_pool(settings)
    try:
        adoption = await adopt_log(pool, current, actor=actor, reason=reason)
    finally:
        await pool.close()
    return {"adoption": adoption.id, "topics": adoption.topics, "given_up": adoption.given_up}


@app.command("adopt")
def log_adopt(
    ctx: typer.Context,
    reason: Annotated[str, typer.Option("--reason", help="why the log was replaced (recorded)")],
    output: OutputOpt = Output.table,
) -> None:
    """Follow the current Kafka log from its start, after the old one was wiped or re-created.

    The stored input offsets start again at 0, the old log's history rows are kept (their
    topic renamed to ``topic@old-topic-id``) and the adoption is recorded in ``log_adoptions``.
    Talks to Kafka and PostgreSQL directly (settings from SANDSTREAM_* variables).
    """
    if not reason.strip():
        fail("--reason must say why the log was replaced")
    done = asyncio.run(_adopt(settings_of(ctx), getpass.getuser(), reason))
    if output is Output.json:
        print_json(done)
    else:
        topics = ", ".join(done["topics"])
        out.print(
            f"adopted the current log for {topics} (adoption {done['adoption']}); "
            f"inputs of the old log given up: {done['given_up']}"
        )
