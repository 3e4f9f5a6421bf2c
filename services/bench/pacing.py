"""Requests offered at a steady rate, open loop: the i-th is due at i / rate whatever became of
the earlier ones, at most as many at once as the client has connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def open_loop(
    rate: float,
    count: int,
    send: Callable[[int], Awaitable[None]],
    connections: int,
    due: Callable[[int], None] = lambda _: None,
) -> tuple[float, list[asyncio.Task[None]]]:
    """``due(i)`` at i's due time, then ``send(i)`` once fewer than ``connections`` sends are
    under way: the rest wait their turn here, in order, and a latency counted from ``due``
    includes the wait. (Handed to httpx at once, they waited in its connection pool, which
    goes through its whole queue on every request: its process's CPU grew with the queue,
    and the load generator became the bottleneck of a system that fell behind.)

    Returns the rate the due times were kept at (the sends a second) and the sends' tasks,
    all started."""
    slots = asyncio.Semaphore(connections)

    async def one(i: int) -> None:
        async with slots:
            await send(i)

    tasks = []
    begin = time.perf_counter()
    for i in range(count):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        due(i)
        tasks.append(asyncio.ensure_future(one(i)))
    sending = time.perf_counter() - begin
    return ((count - 1) / sending if sending > 0 else float("inf")), tasks
