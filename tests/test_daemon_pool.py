"""The Podman driver's thread pool: bounded, daemon threads, cancellable while queued."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from drivers.daemon_pool import DaemonThreadPool

WAIT = 10.0  # deadline of every wait on a thread


def test_calls_run_in_daemon_threads_at_most_max_workers_at_once() -> None:
    pool = DaemonThreadPool(1, thread_name_prefix="test-pool")
    release = threading.Event()
    seen: list[tuple[str, bool]] = []

    def held() -> str:
        seen.append((threading.current_thread().name, threading.current_thread().daemon))
        assert release.wait(WAIT)
        return "first"

    first = pool.submit(held)
    second = pool.submit(release.is_set)  # True only if it ran after the first was released
    assert not second.running()
    release.set()
    assert (first.result(WAIT), second.result(WAIT)) == ("first", True)
    assert seen == [("test-pool_0", True)]
    pool.shutdown()


def test_shutdown_cancels_queued_calls_and_refuses_new_ones_without_waiting() -> None:
    pool = DaemonThreadPool(1, thread_name_prefix="test-pool")
    release = threading.Event()
    running = pool.submit(release.wait, WAIT)
    queued = pool.submit(lambda: "never")
    pool.shutdown(wait=False, cancel_futures=True)  # returns with a call still running
    assert queued.cancelled() and not running.done()
    with pytest.raises(CancelledError):
        queued.result(WAIT)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    release.set()
    assert running.result(WAIT) is True


def test_a_failing_call_raises_in_its_caller() -> None:
    pool = DaemonThreadPool(2, thread_name_prefix="test-pool")

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        pool.submit(fail).result(WAIT)
    pool.shutdown()
