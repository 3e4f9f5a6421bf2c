"""Back-off for every retry loop: the delays, a wait that a stop event ends at once, one log line
per outage, and ``retry`` for a call that is repeated until it succeeds.

- ``Backoff``: ``first``, doubled after each failure in a row, at most ``cap``; ``succeeded()``
  starts again from ``first``. No jitter: the clients that retry together are a handful of role
  processes, not a fleet, and a fixed schedule keeps logs and tests exact. With a logger it
  logs the first failure of an outage (a warning), the later ones at debug level, and the end
  of the outage (info), so a long outage cannot flood the log.
- ``pause``: sleep a delay unless an event is set first (the roles' SIGTERM drain, a closing
  client, news that makes the wait moot); it says whether the event was set.
- ``retry``: run an async call until it returns, waiting out the back-off after each error
  that ``retry_on`` names (a tuple of types, or a predicate); any other error is raised. With a
  ``stop`` event, a stop during a wait returns ``STOPPED`` at once, without another attempt.

It lives in events/, the lowest layer that retries (the observation publisher), so that the
drivers' watch loops and the services share it (imports run events <- projections <- drivers
<- services). Nothing here is bound to asyncio but ``pause`` and ``retry``: a blocking loop (the
CLI) takes its delays from a ``Backoff`` too. Why not tenacity, backoff or stamina:
docs/adr/0006-one-back-off-helper.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar, overload

T = TypeVar("T")
RetryOn = tuple[type[BaseException], ...] | Callable[[BaseException], bool]


def delay_after(failures: int, first: float, cap: float) -> float:
    """The pause after ``failures`` failures in a row (from 1): ``first`` doubled each time, at
    most ``cap``."""
    # 2.0**1000 is still a float; a product past the largest float is inf, which min() caps.
    return min(first * 2.0 ** min(max(failures - 1, 0), 1000), cap)


@dataclass
class Backoff:
    """The delays of one retry loop (see the module's docstring); ``failures`` counts the
    failures in a row since the last success."""

    first: float
    cap: float
    log: logging.Logger | None = None
    what: str = ""  # the log's subject: "podman watch", "publishing <id>"
    failures: int = 0
    _reported: bool = field(default=False, init=False)  # the outage's first failure was logged

    def next(self) -> float:
        """One more failure: the delay to wait before the next attempt."""
        self.failures += 1
        return delay_after(self.failures, self.first, self.cap)

    def failed(self, error: object) -> float:
        """``next()``, logged once per outage (later failures at debug level)."""
        delay = self.next()
        if self.log is None:
            return delay
        if not self._reported:
            self._reported = True
            self.log.warning("%s: %s; retrying in %.1fs, backing off to every %.1fs "
                             "(logged again once it is back)", self.what, error, delay,
                             self.cap)  # fmt: skip
        else:
            self.log.debug("%s: %s (failure %d in a row); retrying in %.1fs",
                           self.what, error, self.failures, delay)  # fmt: skip
        return delay

    def succeeded(self) -> None:
        """Back to ``first``; ends a logged outage with one line."""
        if self._reported and self.log is not None:
            self.log.info("%s: back after %d failed attempts", self.what, self.failures)
        self.failures, self._reported = 0, False


async def pause(event: asyncio.Event | None, seconds: float) -> bool:
    """Sleep ``seconds`` unless ``event`` is set first; returns whether it is set."""
    if event is None:
        await asyncio.sleep(seconds)
        return False
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout=seconds)
    return event.is_set()


class Stopped(enum.Enum):
    """What ``retry`` returns when its stop event ended it."""

    STOPPED = "stopped"


STOPPED: Literal[Stopped.STOPPED] = Stopped.STOPPED


@overload
async def retry(
    call: Callable[[], Awaitable[T]], *, backoff: Backoff, retry_on: RetryOn, stop: None = None
) -> T: ...
@overload
async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    retry_on: RetryOn,
    stop: asyncio.Event,
) -> T | Literal[Stopped.STOPPED]: ...
async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    retry_on: RetryOn,
    stop: asyncio.Event | None = None,
) -> T | Literal[Stopped.STOPPED]:
    """``await call()`` until it returns; after an error ``retry_on`` names, wait out
    ``backoff.failed(error)`` (cut short by ``stop``: then ``STOPPED``)."""
    while True:
        try:
            result = await call()
        except Exception as exc:
            if not retries(exc, retry_on):
                raise
            if await pause(stop, backoff.failed(exc)):
                return STOPPED
            continue
        backoff.succeeded()
        return result


def retries(exc: BaseException, retry_on: RetryOn) -> bool:
    """Whether ``retry_on`` (a tuple of types, or a predicate) names ``exc``."""
    return isinstance(exc, retry_on) if isinstance(retry_on, tuple) else retry_on(exc)
