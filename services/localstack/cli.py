"""``python -m services.localstack up|down|status|prune [--brokers N]``: the local stack, with
the single Kafka broker (services/localstack/stack.py) or a cluster of N nodes
(services/localstack/cluster.py); ``prune`` removes the isolated environments (of tests and
benchmarks) whose process is gone (services/localstack/isolation.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from aiokafka.errors import KafkaError

from projections.store import DATABASE_ERRORS
from services.common.settings import Settings, load_settings
from services.localstack import cluster, isolation, stack


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.localstack", description="Manage the local sandstream stack."
    )
    parser.add_argument("command", choices=("up", "down", "status", "prune"))
    parser.add_argument("--brokers", type=int, help="Kafka brokers: 1 (the default) or a "
                        "local KRaft cluster of N nodes (SANDSTREAM_KAFKA_BROKERS)")  # fmt: skip
    args = parser.parse_args(argv)
    settings = load_settings()
    if args.brokers is not None:
        settings = settings.model_copy(update={"kafka_brokers": args.brokers})
    clustered = settings.kafka_brokers > 1
    try:
        if args.command == "up":
            (cluster.up if clustered else stack.up)(settings)
        elif args.command == "down":
            cluster.down(settings)  # also the nodes of a cluster started earlier
        elif args.command == "prune":
            return asyncio.run(_prune(settings))
        else:
            components = (cluster.status if clustered else stack.status)(settings)
            return 0 if all(c.running for c in components) else 1
    except stack.StackError as exc:
        print(f"stack: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


_UNREACHABLE: tuple[type[Exception], ...] = (*DATABASE_ERRORS, KafkaError)


async def _prune(settings: Settings) -> int:
    try:
        removed, left = await isolation.prune(settings)
    except _UNREACHABLE as exc:
        print(f"stack: error: prune needs the stack running (`make stack`): {exc!r}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    for gone in removed:
        print(f"stack: pruned {gone.names['pg_schema']} (its process {gone.pid} is gone): "
              "topics, ACLs, schema", flush=True)  # fmt: skip
    print(f"stack: {len(removed)} isolated environment(s) pruned, {left} left (their process "
          "runs, or another host made them)", flush=True)  # fmt: skip
    return 0
