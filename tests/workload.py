"""A deterministic random workload of commands, and the rows the pure core says it must give."""

from __future__ import annotations

import random
from collections import defaultdict, deque
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import factories as f

from events.commands import Command
from events.common import Cause
from projections.fold import fold
from projections.lifecycle import Sandbox
from services.processor.intake import entered

BASE_TIME = datetime(2026, 1, 1, tzinfo=UTC)


def _command(kind: str, key: str, command_id: str, at: datetime) -> Command:
    build = f.COMMAND_BUILDERS[kind]
    return build(key, command_id=command_id, occurred_at=at, actor="workload")


def commands(count: int, keys: int, seed: int) -> list[Command]:
    """``count`` commands over ``keys`` sandboxes; some are retries of an earlier command id."""
    rng = random.Random(seed)
    kinds = list(f.COMMAND_BUILDERS)
    # Creates, starts, stops and restarts most; a command type added later weighs 1 by default.
    heavy = {"CreateSandbox": 3, "StartSandbox": 3, "StopSandbox": 3, "RestartSandbox": 2}
    weights = [heavy.get(kind, 1) for kind in kinds]
    issued: dict[str, list[Command]] = {}
    out: list[Command] = []
    for i in range(count):
        key = f"w-{rng.randrange(keys)}"
        earlier = issued.setdefault(key, [])
        if earlier and rng.random() < 0.05:
            out.append(rng.choice(earlier))  # a client retry: same command id, same body
            continue
        kind = "CreateSandbox" if not earlier else rng.choices(kinds, weights)[0]
        command = _command(kind, key, f"{seed}-{i}", BASE_TIME + timedelta(milliseconds=i))
        earlier.append(command)
        out.append(command)
    return out


def expected_rows(inputs: list[Command]) -> dict[str, Sandbox]:
    """What the rows must be: per key the order is the log order, whatever the partitioning."""
    causes = (
        (Cause(topic="x", partition=0, offset=i, message_type=c.type, command_id=c.command_id), c)
        for i, c in enumerate(inputs)
    )
    result = fold({}, {}, causes)
    return {k: v for k, v in result.states.items() if v is not None}


def as_logged(inputs: list[Command], records: Iterable[Any]) -> list[Command]:
    """The inputs as the processor reads them from their records (the commands topic, in
    partition and offset order): a relayed one (a detach, a rotation) as of its append time
    when that is later than its own (services/processor/intake.py). A key's records are in one
    partition, in the order its inputs were published."""
    logged: dict[bytes, deque[Any]] = defaultdict(deque)
    for record in records:
        logged[record.key].append(record)
    return [cast(Command, entered(c, logged[c.key.encode()].popleft())) for c in inputs]
