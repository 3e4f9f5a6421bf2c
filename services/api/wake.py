"""Wake on access: an exec or a file call on a Suspended sandbox resumes it and proceeds once
it is Ready, within a bounded wait (``wake_timeout_seconds``); on a Suspending one it waits for
the suspend to end first, within the same wait. Every door that runs something
in a sandbox (the HTTP API's exec and files, OpenShell's ExecSandbox) calls ``woken``; a read
of the row never does.

The resume's command id names the suspended row as it was read and the caller
(``wake:<id>:<generation>:v<version>:<actor digest>``), so one caller's calls that find the same
suspended sandbox at once are decided as one ResumeSandbox (one published twice is a
duplicate), and each waits for it. The version is in it because a resume can be refused
(held): the release changes the row, so the next call's resume is a new command, not a
duplicate of the refused one. The caller is in it because a command id is its first sender's
(services/api/idempotency.py): another token's call reusing it was refused as a conflict, a
500; now each caller's resume is its own, the later decided as idempotent (already resuming).

A sandbox whose time to live ended is not woken: checked on the row as the call read it, again
on the row once a suspend it waited for ended, and by the processor, which refuses the resume
(it says it is a wake: ``ResumeSandbox.wake``) when the expiry was decided first.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Final

from events.commands import ResumeSandbox
from events.common import Phase
from events.publisher import now
from projections.lifecycle import expired
from services.api import readmodel
from services.api.errors import ApiError
from services.api.gateway import CommandGateway, PublishFailed
from services.api.readmodel import SandboxView

# Where a woken sandbox can end instead of Ready: the wait is over, the call fails.
SETTLED: Final = (Phase.STOPPED, Phase.SUSPENDED, Phase.COMPLETED, Phase.ERROR, Phase.DELETING)


class WakeFailed(Exception):
    """The sandbox was not woken: why, and whether it was the wait that ran out."""

    def __init__(self, reason: str, *, timed_out: bool = False, unavailable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out
        self.unavailable = unavailable  # the resume could not be sent (Kafka): retry


async def woken(
    gateway: CommandGateway, view: SandboxView, actor: str, timeout: float
) -> SandboxView:
    """``view`` itself unless it is Suspending or Suspended, or starting by a resume; else the
    row once its resume made it Ready. A suspend still in progress (an idle suspend that began
    just before the call) is waited for first, within the same bound, then resumed; a resume
    another call sent (the sandbox Provisioning or Starting because of it) is waited for."""
    if view.phase in (Phase.PROVISIONING, Phase.STARTING) and await _resuming(gateway, view):
        loop = asyncio.get_running_loop()
        return await _ready(gateway, view, view.generation - 1, loop.time() + timeout, timeout)
    if view.phase not in (Phase.SUSPENDING, Phase.SUSPENDED):
        return view
    _not_expired(view)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    settled = await _suspended(gateway, view, deadline)
    if settled.generation > view.generation and settled.phase not in SETTLED:
        return await _ready(gateway, view, view.generation, deadline, timeout)  # another woke it
    if settled.phase is not Phase.SUSPENDED:
        return settled  # the suspend failed: the caller answers for the phase it ended in
    _not_expired(settled)  # its time to live may have ended while the suspend went on
    caller = hashlib.sha256(actor.encode()).hexdigest()[:16]
    command = ResumeSandbox(
        type="ResumeSandbox",
        command_id=f"wake:{settled.id}:{settled.generation}:v{settled.version}:{caller}",
        key=settled.member_key,
        occurred_at=now(),
        actor=actor,
        wake=True,  # the rule refuses it too if the time to live ends before it is decided
    )
    try:
        outcome = (await gateway.submit(command, max(deadline - loop.time(), 0.001))).outcome
    except PublishFailed as exc:
        raise WakeFailed(f"its resume was not sent: {exc}", unavailable=True) from None
    if outcome is None:
        raise WakeFailed(f"its resume was not decided within {timeout:g}s", timed_out=True)
    if not outcome.accepted:
        raise WakeFailed(f"its resume was refused: {outcome.message}")
    return await _ready(gateway, settled, settled.generation, deadline, timeout)


def _not_expired(view: SandboxView) -> None:
    """As a sandbox its expiry stopped, one whose time to live ended is started by no call."""
    if expired(view.reason, view.expires_at):
        raise WakeFailed(
            "its time to live has ended: resume or start it (sandbox:write), or extend it first"
        )


async def _resuming(gateway: CommandGateway, view: SandboxView) -> bool:
    """Whether ``view``'s generation was started by a resume (a wake's, or anyone's)."""
    return bool(await gateway.pool.fetchval(_RESUMED, view.id, view.generation))


# The resume that started a generation (the history, by incarnation: history_incarnation).
_RESUMED: Final = (
    "SELECT EXISTS (SELECT 1 FROM history WHERE sandbox_id = $1 AND generation = $2 "
    "AND message_type = 'ResumeSandbox' AND disposition = 'applied')"
)


async def _ready(
    gateway: CommandGateway, view: SandboxView, after: int, deadline: float, timeout: float
) -> SandboxView:
    """The row once a generation after ``after`` is Ready, by ``deadline``."""
    loop = asyncio.get_running_loop()
    while True:
        mark = gateway.feed.mark()
        row = await readmodel.get_sandbox(gateway.pool, view.member_key)
        if row is None or row.id != view.id:
            raise WakeFailed("it was deleted while it was being resumed")
        if row.generation > after and row.phase is Phase.READY:
            return row
        if row.generation > after and row.phase in SETTLED:
            raise WakeFailed(f"it was resumed, then became {row.phase.value}: {row.reason}")
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise WakeFailed(
                f"it was resumed but is not Ready within {timeout:g}s ({row.phase.value})",
                timed_out=True,
            )
        await gateway.feed.wait(mark, remaining)


async def _suspended(gateway: CommandGateway, view: SandboxView, deadline: float) -> SandboxView:
    """The row once it is no longer Suspending (the same incarnation), by ``deadline``."""
    loop = asyncio.get_running_loop()
    while True:
        mark = gateway.feed.mark()
        row = await readmodel.get_sandbox(gateway.pool, view.member_key)
        if row is None or row.id != view.id:
            raise WakeFailed("it was deleted while it was being suspended")
        if row.phase is not Phase.SUSPENDING:
            return row
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise WakeFailed("its suspend did not end in time to resume it", timed_out=True)
        await gateway.feed.wait(mark, remaining)


def http_error(name: str, failed: WakeFailed) -> ApiError:
    """The HTTP answer to a failed wake: 504 when the wait ran out, 503 when the resume could
    not be sent, else 409."""
    status, code = (
        (504, "DEADLINE_EXCEEDED")
        if failed.timed_out
        else (503, "UNAVAILABLE")
        if failed.unavailable
        else (409, "FAILED_PRECONDITION")
    )
    return ApiError(status, code, f"sandbox {name!r} was Suspended and {failed.reason}")


async def woken_for_http(
    gateway: CommandGateway, view: SandboxView, actor: str, timeout: float
) -> SandboxView:
    """``woken``, its failure an ApiError."""
    try:
        return await woken(gateway, view, actor, timeout)
    except WakeFailed as exc:
        raise http_error(view.name, exc) from None
