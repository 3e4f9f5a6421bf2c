"""Wake on access: an exec or a file call on a Suspended sandbox resumes it and proceeds once
it is Ready, within a bounded wait (``wake_timeout_seconds``). Every door that runs something
in a sandbox (the HTTP API's exec and files, OpenShell's ExecSandbox) calls ``woken``; a read
of the row never does.

The resume's command id names the suspended generation (``wake:<id>:<generation>``), so calls
that find the same suspended sandbox at once are decided as one ResumeSandbox (one published
twice is a duplicate), and each waits for it.
"""

from __future__ import annotations

import asyncio
from typing import Final

from events.commands import ResumeSandbox
from events.common import Phase
from events.publisher import now
from services.api import readmodel
from services.api.errors import ApiError
from services.api.gateway import CommandGateway
from services.api.readmodel import SandboxView

# Where a woken sandbox can end instead of Ready: the wait is over, the call fails.
SETTLED: Final = (Phase.STOPPED, Phase.SUSPENDED, Phase.COMPLETED, Phase.ERROR, Phase.DELETING)


class WakeFailed(Exception):
    """The sandbox was not woken: why, and whether it was the wait that ran out."""

    def __init__(self, reason: str, *, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out


async def woken(
    gateway: CommandGateway, view: SandboxView, actor: str, timeout: float
) -> SandboxView:
    """``view`` itself unless it is Suspended; else the row once its resume made it Ready."""
    if view.phase is not Phase.SUSPENDED:
        return view
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    command = ResumeSandbox(
        type="ResumeSandbox",
        command_id=f"wake:{view.id}:{view.generation}",
        key=view.member_key,
        occurred_at=now(),
        actor=actor,
    )
    outcome = (await gateway.submit(command, timeout)).outcome
    if outcome is None:
        raise WakeFailed(f"its resume was not decided within {timeout:g}s", timed_out=True)
    if not outcome.accepted:
        raise WakeFailed(f"its resume was refused: {outcome.message}")
    while True:
        mark = gateway.feed.mark()
        row = await readmodel.get_sandbox(gateway.pool, view.member_key)
        if row is None or row.id != view.id:
            raise WakeFailed("it was deleted while it was being resumed")
        if row.generation > view.generation and row.phase is Phase.READY:
            return row
        if row.generation > view.generation and row.phase in SETTLED:
            raise WakeFailed(f"it was resumed, then became {row.phase.value}: {row.reason}")
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise WakeFailed(
                f"it was resumed but is not Ready within {timeout:g}s ({row.phase.value})",
                timed_out=True,
            )
        await gateway.feed.wait(mark, remaining)


def http_error(name: str, failed: WakeFailed) -> ApiError:
    """The HTTP answer to a failed wake: 504 when the wait ran out, else 409."""
    status, code = (504, "DEADLINE_EXCEEDED") if failed.timed_out else (409, "FAILED_PRECONDITION")
    return ApiError(status, code, f"sandbox {name!r} was Suspended and {failed.reason}")


async def woken_for_http(
    gateway: CommandGateway, view: SandboxView, actor: str, timeout: float
) -> SandboxView:
    """``woken``, its failure an ApiError."""
    try:
        return await woken(gateway, view, actor, timeout)
    except WakeFailed as exc:
        raise http_error(view.name, exc) from None
