"""``python -m services.chaos``: one checker run; exit status 1 on any finding."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.chaos import report
from services.chaos.run import Plan, remove_home, run
from services.common.entrypoint import LOG_FORMAT
from services.common.log_filter import rate_limit_kafka_logs
from services.common.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.chaos", description=__doc__)
    parser.add_argument("--seed", type=int, default=Plan.seed)
    parser.add_argument("--sandboxes", type=int, default=Plan.sandboxes,
                        help="sandboxes on the shared fake driver")  # fmt: skip
    parser.add_argument("--podman", type=int, default=Plan.podman,
                        help="sandboxes on real Podman (keep them few)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=Plan.duration,
                        help="seconds of workload under faults")  # fmt: skip
    parser.add_argument("--partitions", type=int, default=Plan.partitions)
    parser.add_argument("--up", type=int, default=Plan.ups, metavar="N",
                        help="run N `sandstream up` processes instead of the roles")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    # The Kafka client's retries during broker faults are expected; its errors still show,
    # one line per kind per 30 s.
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    rate_limit_kafka_logs()
    # 503s, and the pool's reconnects, while PostgreSQL restarts.
    for name in ("sandstream.api", "asyncpg.pool"):
        logging.getLogger(name).setLevel(logging.ERROR)
    plan = Plan(seed=args.seed, sandboxes=args.sandboxes, podman=args.podman,
                duration=args.duration, partitions=args.partitions, ups=args.up)  # fmt: skip
    result = asyncio.run(run(plan, load_settings()))
    print(report.table(result), flush=True)
    remove_home(result)
    return 0 if result.ok else 1


sys.exit(main())
