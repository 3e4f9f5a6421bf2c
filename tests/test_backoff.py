"""The back-off every retry loop shares (events/backoff.py): its delays, the wait a stop event
ends at once, which errors are retried, and one log line per outage. Pure or on the event loop
alone: no test waits out a delay (the ones that would take an hour are ended by their event)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from events.backoff import STOPPED, Backoff, delay_after, pause, retry
from services.executor.calls import RetryPolicy

LOG = logging.getLogger("sandstream.test-backoff")
HOUR = 3600.0


class Flaky:
    """A call that raises ``errors`` in turn, then returns how many attempts it took."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.attempts = 0

    async def __call__(self) -> int:
        self.attempts += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.attempts


def test_delays_double_from_the_first_up_to_the_cap() -> None:
    backoff = Backoff(0.2, 5.0)
    assert [backoff.next() for _ in range(8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    assert backoff.failures == 8


def test_a_success_starts_the_delays_again_from_the_first() -> None:
    backoff = Backoff(0.5, 10.0)
    assert [backoff.next() for _ in range(3)] == [0.5, 1.0, 2.0]
    backoff.succeeded()
    assert backoff.failures == 0
    assert [backoff.next() for _ in range(2)] == [0.5, 1.0]


def test_an_outage_of_any_length_stays_at_the_cap() -> None:
    # 2 ** 1100 is past the largest float: the delay must still be the cap, not an error.
    assert delay_after(1100, 0.2, 5.0) == 5.0
    assert delay_after(10**9, 0.2, 5.0) == 5.0
    assert delay_after(10**9, 0.0, 5.0) == 0.0  # a first delay of 0 never grows
    assert delay_after(1, 7.0, 5.0) == 5.0  # a first delay above the cap is capped too


def test_the_executor_s_driver_retries_use_the_same_schedule() -> None:
    policy = RetryPolicy(first_delay=0.5, max_delay=10.0, give_up_after=60.0)
    assert [policy.delay(a) for a in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert policy.next_delay(3, elapsed=58.5) is None  # 58.5 + 2 s would pass the 60 s
    assert policy.next_delay(3, elapsed=58.0) == 2.0


async def test_pause_ends_at_once_when_its_event_is_set_during_the_wait() -> None:
    event = asyncio.Event()
    asyncio.get_running_loop().call_soon(event.set)  # runs once pause is waiting
    # A deadline, not a measurement: without the event this would wait an hour.
    assert await asyncio.wait_for(pause(event, HOUR), 10) is True


async def test_pause_says_whether_its_event_is_set() -> None:
    event = asyncio.Event()
    assert await pause(event, 0) is False
    assert await pause(None, 0) is False
    event.set()
    assert await asyncio.wait_for(pause(event, HOUR), 10) is True


async def test_retry_repeats_the_errors_it_names_until_the_call_returns() -> None:
    call = Flaky(ConnectionError("refused"), ConnectionError("refused"))
    backoff = Backoff(0.0, 0.0)
    assert await retry(call, backoff=backoff, retry_on=(ConnectionError,)) == 3
    assert backoff.failures == 0  # the success reset the back-off


async def test_retry_raises_an_error_it_does_not_name_at_once() -> None:
    call = Flaky(ConnectionError("refused"), ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):
        await retry(call, backoff=Backoff(0.0, 0.0), retry_on=(ConnectionError,))
    assert call.attempts == 2


async def test_retry_classifies_with_a_predicate() -> None:
    """As the processor does: an error retries when what caused it is a lost backend."""

    def lost_backend(exc: BaseException) -> bool:
        return isinstance(exc.__cause__, ConnectionError)

    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = ConnectionError("reset")
    assert await retry(Flaky(wrapped), backoff=Backoff(0.0, 0.0), retry_on=lost_backend) == 2
    with pytest.raises(RuntimeError, match="plain"):
        await retry(Flaky(RuntimeError("plain")), backoff=Backoff(0, 0), retry_on=lost_backend)


async def test_a_stop_during_the_wait_ends_retry_at_once_without_another_attempt() -> None:
    stop = asyncio.Event()
    attempts = 0

    async def fails_then_stop_comes() -> None:
        nonlocal attempts
        attempts += 1
        asyncio.get_running_loop().call_soon(stop.set)  # runs once retry is waiting
        raise ConnectionError("refused")

    backoff = Backoff(HOUR, HOUR)
    result = await asyncio.wait_for(
        retry(fails_then_stop_comes, backoff=backoff, retry_on=(ConnectionError,), stop=stop), 10
    )  # a deadline, not a measurement: without the stop this would wait an hour
    assert result is STOPPED and attempts == 1


async def test_a_stop_ends_retry_after_the_attempt_under_way() -> None:
    """A stop set before the call still lets its first attempt run (it may succeed)."""
    stop = asyncio.Event()
    stop.set()
    call = Flaky(ConnectionError("refused"))
    backoff = Backoff(HOUR, HOUR)
    result = await asyncio.wait_for(
        retry(call, backoff=backoff, retry_on=(ConnectionError,), stop=stop), 10
    )
    assert result is STOPPED and call.attempts == 1
    assert await retry(Flaky(), backoff=backoff, retry_on=(ConnectionError,), stop=stop) == 1


async def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOG.name)
    backoff = Backoff(0.0, 0.0, LOG, "the thing")
    down = [ConnectionError("refused")] * 4
    assert await retry(Flaky(*down), backoff=backoff, retry_on=(ConnectionError,)) == 5
    assert await retry(Flaky(*down[:1]), backoff=backoff, retry_on=(ConnectionError,)) == 2

    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOG.name]
    assert [level for level, _ in lines] == [
        logging.WARNING, *[logging.DEBUG] * 3, logging.INFO,  # the first outage
        logging.WARNING, logging.INFO,  # the second
    ]  # fmt: skip
    assert lines[0][1].startswith("the thing: refused; retrying in 0.0s")
    assert lines[4][1] == "the thing: back after 4 failed attempts"
    assert lines[6][1] == "the thing: back after 1 failed attempts"


def test_failures_not_logged_end_without_a_line(caplog: pytest.LogCaptureFixture) -> None:
    """``next()`` is silent (a lost connection that is not an error), and so is its end."""
    caplog.set_level(logging.DEBUG, logger=LOG.name)
    backoff = Backoff(0.5, 10.0, LOG, "the feed")
    assert backoff.next() == 0.5
    backoff.succeeded()
    assert [r for r in caplog.records if r.name == LOG.name] == []
