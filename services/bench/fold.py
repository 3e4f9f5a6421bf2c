"""CPU of the decide stage alone: the pure fold of the bench's generated log, in this process.

No Kafka, no PostgreSQL: the records are decoded up front, then folded in 5,000-input batches as
the processor's polls would be, from no rows to the last, each batch timed with
``time.thread_time`` (CPU of this thread, not waiting). A run is the CPU per input of the whole
log; the median of several runs is printed, and the minimum, since other work on the machine
can only add to a run.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from events.codec import COMMANDS, OBSERVATIONS, decode
from events.commands import CommandBase
from events.common import Cause
from projections.fold import OutcomeKey, fold
from projections.lifecycle import Message, Sandbox
from services.bench.workload import lifecycle_messages

BATCH = 5_000


def decoded_log(keys: int) -> list[tuple[Cause, Message]]:
    """The bench's log (create, running, stop, exited per key) as the processor parses it."""
    records, _ = lifecycle_messages(keys)
    inputs: list[tuple[Cause, Message]] = []
    for offset, (topic, _key, value) in enumerate(records):
        adapter: Any = COMMANDS if topic == "commands" else OBSERVATIONS
        message: Message = decode(adapter, value)
        command_id = message.command_id if isinstance(message, CommandBase) else None
        cause = Cause(
            topic=topic, partition=0, offset=offset, message_type=message.type,
            command_id=command_id,
        )  # fmt: skip
        inputs.append((cause, message))
    return inputs


def fold_cpu(inputs: list[tuple[Cause, Message]]) -> float:
    """µs of CPU per input to fold ``inputs`` from no rows, batch by batch."""
    states: dict[str, Sandbox | None] = {}
    outcomes: dict[OutcomeKey, Any] = {}
    gc.collect()  # each run starts with the same heap
    spent = 0.0
    for start in range(0, len(inputs), BATCH):
        began = time.thread_time()
        result = fold(states, outcomes, inputs[start : start + BATCH])
        spent += time.thread_time() - began
        states = result.states
        outcomes.update(result.outcomes)
    return spent / len(inputs) * 1e6


def fold_figures(keys: int, runs: int) -> None:
    inputs = decoded_log(keys)
    figures = [fold_cpu(inputs) for _ in range(runs)]
    print(
        f"fold        {len(inputs):,} inputs, {runs} runs: median "
        f"{statistics.median(figures):.1f} µs/input of CPU, min {min(figures):.1f} "
        f"({' '.join(f'{f:.1f}' for f in figures)})"
    )
