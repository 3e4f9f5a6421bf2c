"""``python -m services.localstack up|down|status [--brokers N]``: the local stack, with the
single Kafka broker (services/localstack/stack.py) or a cluster of N nodes
(services/localstack/cluster.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services.common.settings import load_settings
from services.localstack import cluster, stack


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.localstack", description="Manage the local sandstream stack."
    )
    parser.add_argument("command", choices=("up", "down", "status"))
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
        else:
            components = (cluster.status if clustered else stack.status)(settings)
            return 0 if all(c.running for c in components) else 1
    except stack.StackError as exc:
        print(f"stack: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
